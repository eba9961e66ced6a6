"""draftline's stages and what they share, as plain Python (no Prefect: flows/ wraps them in tasks).

Packages from the bottom up, each importing only those before it (tests/repo/test_layout.py): core, store,
formats, engine, address, data, extract, train, benchmark; each `__init__.py` says what lives there.

The stage interface. Every stage has one entry, `run_<stage>(cfg, store, *inputs) -> ArtifactRef`, or, for
a stage that runs shard by shard, `<stage>_shard(cfg, store, plan, engine) -> ArtifactRef` per shard
(regeneration and extraction). It returns the artifact committed at its address (tasks/address/digests.py)
when there is one, else computes and commits it, through the one rule `Store.found_or_compute`. What the
caller wants to hear while it runs (progress, training metrics, log lines) comes through keyword-only
`on_<event>` callbacks; an engine, or a factory of engines, is an input like the others.
"""
