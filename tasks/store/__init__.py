"""The artifact store (`artifacts.py`: `STORE/STAGE/DIGEST/` on file:// or s3://, manifests written last), what it
holds as data (`model.py`: `Manifest`, `ArtifactRef`, the store's errors), manifests read many at once
(`manifests.py`; on S3 from a folder's LIST and the index a sharded stage's end writes: `manifest_index.py`), one artifact read (`reader.py`) and written (`writer.py`; on S3 as a multipart upload:
`uploads.py`), what a reader believes of the store (`trust.py`: plain names and paths, capped reads), what gc may
delete (`gc.py`), where a store is and how to reach it (`location.py`), the typed manifest stats a stage reads from
an upstream artifact (`stats.py`), one lock per address that dies with its holder (`leases.py`), the node-local,
content-addressed part cache training reads through (`part_cache.py`), what a stage is to the flow
(`stages.py`: `Stage`, `ShardedStage` and the one `ShardPlan` every sharded stage's shard plans derive from), what
a config produces on the store (`resolve.py`: every stage's address, found or not) and the one Store per process
and store (`opened.py`).
"""
