"""The artifact store (`artifacts.py`: `STORE/STAGE/DIGEST/` on file:// or s3://, manifests written last),
the typed manifest stats a stage reads from an upstream artifact (`stats.py`), one lock per address that
dies with its holder (`leases.py`) and the node-local, content-addressed part cache training reads through
(`part_cache.py`).
"""
