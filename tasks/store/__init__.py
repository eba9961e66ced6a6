"""The artifact store (`artifacts.py`: `STORE/STAGE/DIGEST/` on file:// or s3://, manifests written last),
the typed manifest stats a stage reads from an upstream artifact (`stats.py`), one lock per address that
dies with its holder (`leases.py`), the node-local, content-addressed part cache training reads through
(`part_cache.py`), what a stage is to the flow (`stages.py`: `Stage`, `ShardedStage` and the one
`ShardPlan` every sharded stage's shard plans derive from), what a config produces on the store (`resolve.py`:
every stage's address, found or not) and the one Store per process and store (`opened.py`).
"""
