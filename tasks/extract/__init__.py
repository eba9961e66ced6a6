"""The extract stage (`stage.py`): the target's hidden states for every shard, as parts on the store;
its shard plans and addresses (`shards.py`), which `draftline export` and the flow read without it.
"""
