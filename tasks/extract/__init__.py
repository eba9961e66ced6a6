"""The extract stage (`stage.py`): the target's hidden states for every shard, as parts on the store;
its shard plans and addresses (`shards.py`), which `draftline export` and the flow read without it, and the
check each shard makes of the states it stores against the target's own next token (`verify.py`).
"""
