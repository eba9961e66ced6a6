"""The artifact store (`artifacts.py`: `STORE/STAGE/DIGEST/` on file:// or s3://, manifests written last), one
artifact read (`reader.py`) and written (`writer.py`), what gc may delete (`gc.py`), where a store is and how to
reach it (`location.py`), the typed manifest stats a stage reads from an upstream artifact (`stats.py`), one lock
per address that dies with its holder (`leases.py`), the node-local, content-addressed part cache training reads
through (`part_cache.py`), and what a stage is to the flow (`stages.py`: `Stage`, `ShardedStage` and the one
`ShardPlan` every sharded stage's shard plans derive from).
"""
