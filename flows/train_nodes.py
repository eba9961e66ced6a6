"""Training over several nodes (train.nodes > 1): torch's elastic launcher on the run's node and on child
flow runs of the slice flow with stage=train (flows/nodes.py starts and waits for them; `train_child` runs
there), one c10d rendezvous hosted by the run's node, a control store there for the node count and the nodes'
heartbeats, which name a node lost mid-training. A child no node takes within TAKE_BACK_AFTER is cancelled:
the run trains on the nodes there are. A child finds its inputs and its train address on the store itself
(tasks/store/resolve.py), never from a flow run's parameters.
"""

from __future__ import annotations

# The train stage's parts are imported where used: they import torch, which is heavy (seconds), and a run
# that never trains over several nodes never needs them.

import dataclasses
import threading
import time
from typing import Any

from prefect.client.orchestration import get_client
from prefect.runtime import flow_run

from flows.flow_runs import submitting_worker
from flows.nodes import start_children, wait_children, wait_claimed
from tasks.core import stopping
from tasks.core.config import RunConfig
from tasks.store.artifacts import ArtifactRef, Store
from tasks.store.resolve import Address, Resolution, resolve
from tasks.train import TrainError
from tasks.train.stage import head_variants, training_shards

# Training over several nodes (train.nodes > 1): the nodes' heartbeats on the run node's control store
NODE_BEAT = 2.0        # seconds between a training node's heartbeats
NODE_LOST_AFTER = 8.0  # a node whose heartbeat has not changed this long (and whose run has not ended) is lost


def train_nodes(cfg: RunConfig, store: Store, config: dict[str, Any], vocab: ArtifactRef,
                extracted: ArtifactRef, digest: str, logger, on_metrics) -> ArtifactRef:
    """train.nodes > 1: torch's elastic launcher on this node and on train.nodes - 1 child flow runs of
    `child_deployment` (the slice flow with stage=train), one c10d rendezvous hosted here. The nodes that
    take their child within TAKE_BACK_AFTER seconds train (the others are cancelled: the run trains on the
    nodes there are); rank 0 is on this node. A node that stops heartbeating while training failed is named
    in the error; `draftline retry` resumes from the last checkpoint on whatever nodes are there then.
    CONFIG: the run's config for the children (`child_config`); DIGEST: the train artifact's address (the
    flow's task found it not committed, flows/caching.py), which every node's ranks take."""
    from tasks.train.inputs import resolve_inputs
    from tasks.train.ranks import Rendezvous, launch_ranks, node_address, secret_run_id, train_ranks

    shards = training_shards(store, extracted)
    ranks = train_ranks(cfg.train)
    resolve_inputs(cfg, store, vocab, shards, digest=digest)  # bad inputs fail here, before any node is taken
    host = node_address()
    # one store on this node, listening on the address the nodes use only: torch's rendezvous and our control
    control = Rendezvous(endpoint="", control=f"{host}:0", run_id="").store(is_master=True)
    spec = Rendezvous(endpoint=f"{host}:{control.port}", control=f"{host}:{control.port}",
                      run_id=secret_run_id(digest), host=True)
    # The secret run id travels to the child runs as a flow-run parameter (docs/SECURITY.md says who sees it).
    children = start_children("train", cfg, store, config, [[] for _ in range(cfg.train.nodes)], logger, {
        "rendezvous": {"endpoint": spec.endpoint, "control": spec.control, "run_id": spec.run_id},
        "train_inputs": {"vocab": vocab.model_dump(mode="json"),
                         "extract": [r.model_dump(mode="json") for r in shards], "digest": digest}})
    claimed = wait_claimed(children, logger, "train", "its parent trains on the nodes there are")
    nodes = 1 + len(claimed)
    control.set(f"{spec.run_id}/nodes", str(nodes))
    spec = dataclasses.replace(spec, nodes=nodes)
    logger.info(f"train: {nodes} of {cfg.train.nodes} node(s) x {ranks} rank(s) = {nodes * ranks} rank(s); "
                f"rendezvous {spec.endpoint} (id {spec.label}), this node holds rank 0"
                + (f"; nodes: this one and {', '.join(c.name for c in claimed)}" if claimed else ""))
    try:
        ref = launch_ranks(cfg, store, vocab, shards, ranks, on_metrics, rendezvous=spec, digest=digest)
    except TrainError as exc:
        lost = lost_nodes(control, spec, claimed)
        if not lost:
            raise
        names = []
        with get_client(sync_client=True) as client:
            for run in lost:
                worker = submitting_worker(client, run)
                names.append(f"{worker.name if worker is not None else 'its node'} (child flow run {run.name}, "
                             f"{run.id})")
        msg = (f"training node lost: {'; '.join(names)} stopped heartbeating mid-training (the node died or "
               f"its process was killed), so the {nodes * ranks} ranks stopped. `draftline retry` this run: it "
               "resumes from the last checkpoint on the nodes there are then.")
        logger.error(msg)
        raise TrainError(msg + "\n" + str(exc)) from None
    errors = wait_children([(c, []) for c in claimed], store, {}, logger, stage="train")
    for e in errors:
        logger.warning(f"train: {e}")
    return ref


def lost_nodes(control: Any, spec: Any, claimed: list[Any]) -> list[Any]:
    """The child runs whose node stopped heartbeating on the control store (unchanged for NODE_LOST_AFTER
    seconds) while their run did not end: those nodes died (a node whose training failed ends its run)."""
    def beats() -> dict[Any, bytes | None]:
        out = {}
        for run in claimed:
            key = f"{spec.run_id}/beat/{run.id}"
            out[run.id] = control.get(key) if control.check([key]) else None
        return out

    first = beats()
    deadline = time.time() + NODE_LOST_AFTER
    lost: dict[Any, Any] = {}
    with get_client(sync_client=True) as client:
        while time.time() < deadline:
            stopping.wait(1.0, "telling a lost training node from a slow one")
            now = beats()
            for run in claimed:
                state = client.read_flow_run(run.id).state
                if now[run.id] == first[run.id] and (state is None or not state.is_final() or state.is_crashed()):
                    lost[run.id] = run
                else:
                    lost.pop(run.id, None)
    return list(lost.values())


def child_train_address(found: Resolution, inputs: dict[str, Any]) -> Address:
    """The train address a child node's ranks commit at: the head of this node's own resolution (its config on
    the store, tasks/store/resolve.py; a flow run's parameters are not trusted to name a store path) whose address
    the parent sent (absent from parents of earlier versions: the first head). None of them: the nodes run
    different draftline versions."""
    heads = found.addresses.get("train") or []
    sent = inputs.get("digest")
    for a in heads:
        if sent is None or a.digest == sent:
            return a
    raise TrainError(f"train: the run's node sent train address {str(sent)[:80]!r}, this node computes "
                     f"{', '.join(a.digest for a in heads) or 'none'} from the same inputs: the nodes run different "
                     "draftline versions (or the run's parameters were altered). Fix: install the run node's "
                     "draftline version on this node, then `draftline retry` the run")


def train_child(cfg: RunConfig, store: Store, rendezvous: dict[str, Any], inputs: dict[str, Any], logger) -> dict:
    """One node of a run's training (the slice flow with stage=train): heartbeats on the run node's control
    store, waits for the node count there, then starts train.gpus ranks in the rendezvous."""

    from tasks.train.ranks import Rendezvous, launch_ranks, train_ranks

    spec = Rendezvous(**rendezvous)
    control = spec.store()
    stop = threading.Event()

    def beat() -> None:
        n = 0
        try:
            beat_store = spec.store()  # its own connection: the store client is not shared across threads
            while not stop.is_set():
                n += 1
                beat_store.set(f"{spec.run_id}/beat/{flow_run.id}", str(n))
                stop.wait(NODE_BEAT)
        except Exception as exc:  # noqa: BLE001 - the run's node is gone: its training fails this node's too
            logger.warning(f"train: no more heartbeats to the run's node ({spec.control}): {exc}")

    threading.Thread(target=beat, name="draftline-node-beat", daemon=True).start()
    try:
        nodes = int(control.get(f"{spec.run_id}/nodes"))
        found = resolve(cfg, store, until="train")
        vocab, extracted = found.ref("vocab"), found.ref("extract")
        if vocab is None or extracted is None:
            raise TrainError(f"train: this config's {found.missing} artifact is not on {store.uri}: the run's node "
                             "and this node must share one s3:// store")
        head = child_train_address(found, inputs)
        head_cfg = dict(head_variants(cfg))[head.variant]
        ranks = train_ranks(cfg.train)
        logger.info(f"train: this node runs {ranks} of the {nodes} nodes' ranks of head {head.variant}; rendezvous "
                    f"{spec.endpoint} (id {spec.label})")
        launch_ranks(head_cfg, store, vocab, training_shards(store, extracted), ranks,
                     rendezvous=dataclasses.replace(spec, nodes=nodes), digest=head.digest)
    finally:
        stop.set()
    return {"stage": "train", "nodes": nodes, "ranks": ranks}
