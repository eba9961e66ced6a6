"""draftline's stages and what they share, as plain Python (no Prefect: flows/ wraps them in tasks).

Packages from the bottom up, each importing only those before it (tests/repo/test_layout.py): core, store,
formats, engine, address, data, extract, train, benchmark, cost; each `__init__.py` says what lives there. The
stages, in the order the flow runs them, are one line each of the stage registry (tasks/core/stages.py).

The stage interface. Every stage module exports one object the flow iterates, `STAGE_DEF`
(tasks/store/stages.py): a `Stage`, whose entry `run_<stage>(cfg, store, *inputs) -> ArtifactRef` commits
its artifact, or a `ShardedStage` (regeneration, extraction) with `plan` (its shards, each a `ShardPlan`),
`<stage>_shard(cfg, store, plan, engine) -> ArtifactRef` per shard and `assemble_<stage>` for the stage's
own artifact from its shards' (every stage, sharded ones included, commits a stage artifact; the next stage
takes that one ref). Each returns the artifact committed at its address (tasks/address/digests.py) when
there is one, else computes and commits it, through the one rule `Store.found_or_compute`; the address comes
in as the keyword `digest` (the flow computes it once, by the stage's `address`) or, without it, from that
same `address` function. What the caller
wants to hear while it runs (progress, training metrics, log lines) comes through keyword-only
`on_<event>` callbacks; an engine, or a factory of engines, is an input like the others.
"""
