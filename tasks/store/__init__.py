"""The artifact store (`artifacts.py`: `STORE/STAGE/DIGEST/` on file:// or s3://, manifests written last)
and the node-local, content-addressed part cache training reads through (`part_cache.py`).
"""
