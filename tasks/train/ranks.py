"""Training on every GPU of the node: `train.gpus` ranks started by torch's elastic launcher from the
train task, rank 0's metrics followed live, a failed rank named with its error.

Over several nodes (train.nodes > 1, flows/train_nodes.py `train_nodes`) each node's launcher joins one c10d
rendezvous that the run's own node hosts (`Rendezvous`); the ranks are renumbered so that the run's
node holds ranks 0..gpus-1 (`host_first_rank`): rank 0, which checkpoints and commits the draft, is always there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from tasks.core import stopping
from tasks.core.config import RunConfig, TrainConfig
from tasks.store.artifacts import ArtifactRef, Store
from tasks.train import MetricsCallback, TrainError, log, wants_cuda

RANK_ENTRY = "import tasks.train.ranks as r; r.rank_main()"  # what each rank's `python -c` runs


RANK_LOG_TAIL_LINES = 25


def node_address() -> str:
    """How other nodes reach this one (and the one address its training stores listen on): DRAFTLINE_NODE_ADDR,
    else this host's fully qualified name."""
    import socket

    return os.environ.get("DRAFTLINE_NODE_ADDR") or socket.getfqdn()


def train_ranks(train: TrainConfig) -> int:
    """How many ranks `train.gpus` asks for here: every visible GPU by default, 1 on a CPU."""
    if not wants_cuda(train):
        return train.gpus or 1
    visible = torch.cuda.device_count()
    n = visible if train.gpus is None else train.gpus
    if n > visible:
        raise TrainError(f"train.gpus={n} but only {visible} GPU(s) are visible (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); lower train.gpus or leave it unset "
                         "to use every visible GPU")
    return n


def launched_as_rank() -> bool:
    """True inside a process torchrun (or our launcher) started: it trains as one rank of WORLD_SIZE."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ


class _MetricsTail:
    """Follows rank 0's JSON-lines metrics file from a thread and hands each record to `on_metrics`
    as it lands; `stop()` delivers what is left. A record is a whole line: a half-written one waits.
    When the run is asked to stop (tasks/core/stopping.py: Ctrl-C, SIGTERM) it calls `on_stop_request` once."""

    def __init__(self, path: str, on_metrics: MetricsCallback | None,
                 on_stop_request: Callable[[], None] | None = None):
        self.path, self.on_metrics, self.on_stop_request = path, on_metrics, on_stop_request
        self.records = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draftline-rank0-metrics", daemon=True)
        self._warned = False

    def start(self) -> "_MetricsTail":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        pos, rest = 0, b""
        while True:
            last = self._stop.is_set()
            try:
                with open(self.path, "rb") as fh:
                    fh.seek(pos)
                    chunk = fh.read()
            except FileNotFoundError:
                chunk = b""
            pos += len(chunk)
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        log.warning("rank 0 wrote a metrics line that is not JSON: %r", line[:200])
                        continue
                    self._deliver(rec)
            if last:
                return
            if self.on_stop_request is not None and stopping.requested():
                self.on_stop_request()
                self.on_stop_request = None
            self._stop.wait(0.2)

    def _deliver(self, rec: dict[str, Any]) -> None:
        self.records += 1
        if self.on_metrics is None:
            return
        try:
            self.on_metrics(rec)
        except Exception as exc:  # noqa: BLE001 - a reporting failure must not stop the training it reports
            if not self._warned:
                log.warning("metrics callback failed (%s: %s); training goes on", type(exc).__name__, exc)
                self._warned = True


def _rank_log_tail(folder: str, local_rank: int) -> str:
    """The last lines a rank wrote to stderr (torch elastic's log layout: RUN/attempt_N/RANK/stderr.log)."""
    import glob

    lines: list[str] = []
    for path in sorted(glob.glob(os.path.join(folder, "*", "attempt_*", str(local_rank), "stderr.log"))):
        with open(path, errors="replace") as fh:
            lines = fh.read().splitlines()
    return "\n".join(lines[-RANK_LOG_TAIL_LINES:])


def describe_rank_failure(failures: dict[int, Any], world: int, log_dir: str) -> str:
    """One message for the ranks that failed (torch elastic's ProcessFailure per rank): the rank
    that started it first (killed by a signal from outside, else the earliest error), its error
    and traceback (or its last log lines when a signal left none), the others in a line each."""
    def tier(f: Any) -> int:  # 0: killed from outside (SIGKILL: OOM killer, a drill); 1: an error; 2: stopped
        if f.exitcode < 0:
            return 2 if f.signal_name() in ("SIGTERM", "SIGINT") else 0
        return 1

    def what(f: Any) -> tuple[str, str]:
        if f.exitcode < 0:
            return f"killed by {f.signal_name()} (exit code {f.exitcode}, pid {f.pid})", ""
        msg = f.message
        if isinstance(msg, dict):
            return msg.get("message", "<no message>"), msg.get("extraInfo", {}).get("py_callstack", "")
        return f"exited with code {f.exitcode} (pid {f.pid}): {msg}", ""

    order = sorted(failures, key=lambda r: (tier(failures[r]), failures[r].timestamp, r))
    root = order[0]
    head, trace = what(failures[root])
    lines = [f"training rank {root} of {world} failed: {head}"]
    for r in order[1:]:
        f = failures[r]
        lines.append(f"rank {r} of {world} was stopped ({f.signal_name()}, pid {f.pid})" if tier(f) == 2
                     else f"rank {r} of {world} also failed: {what(f)[0]}")
    if trace:
        lines += [f"rank {root} traceback:", trace.rstrip()]
    else:
        tail = _rank_log_tail(log_dir, failures[root].local_rank)
        if tail:
            lines += [f"rank {root}'s last log lines:", tail]
    lines.append(f"The other ranks were stopped; every rank's log is under {log_dir}. Fix the cause if it is one, "
                 "then retry the run (`draftline retry`): it resumes from the last checkpoint, if one was written, "
                 "with this or another train.gpus.")
    return "\n".join(lines)


def listening_store(addr: str, port: int = 0, timeout: float = 600.0) -> Any:
    """A TCPStore server listening on ADDR only (torch's own binds every interface, whatever host it is
    given): the socket is bound here and handed to it."""
    import datetime as dt
    import socket

    from torch.distributed import TCPStore

    family, _, _, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(where)
    sock.listen(512)
    port = sock.getsockname()[1]
    return TCPStore(addr, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                    master_listen_fd=sock.detach(), timeout=dt.timedelta(seconds=timeout))


def _bound_store_server(self: Any, master_addr: str, master_port: int) -> Any:
    """torch's elastic rendezvous starts the workers' store on the first node: here on the address it tells
    the workers (`master_addr`, the launch's local_addr), not on every interface."""
    return listening_store(master_addr, master_port)


def secret_run_id(digest: str) -> str:
    """A rendezvous id nobody can guess: torch's c10d rendezvous keeps its state (which it unpickles) under
    `torch.rendezvous.RUN_ID` in the store, and the control keys are RUN_ID/...; the TCPStore has no
    authentication and no way to list keys, so without the id a stranger who connects can read and write
    nothing the nodes read. Logs show `Rendezvous.label` (the id without its secret)."""
    import secrets

    return f"draftline-{digest[:12]}-{secrets.token_hex(16)}"


@dataclass(frozen=True)
class Rendezvous:
    """One attempt's rendezvous over NODES nodes: torch's c10d rendezvous at ENDPOINT (host:port, on the
    run's own node, HOST there), RUN_ID unique and secret per attempt (`secret_run_id`), and CONTROL
    (host:port), through which the nodes agree on the node count, the host's group rank and heartbeats.
    Both are one TCPStore of the run's node (`store(is_master=True)`), listening on the address the nodes
    use only."""

    endpoint: str
    control: str
    run_id: str
    nodes: int = 1
    host: bool = False

    @property
    def label(self) -> str:
        """The run id as logs show it: without its secret part."""
        return self.run_id[: self.run_id.rfind("-") + 9] + "..."

    def store(self, timeout: float = 600.0, is_master: bool = False) -> Any:
        import datetime as dt

        from torch.distributed import TCPStore

        addr, port = self.control.rsplit(":", 1)
        if is_master:
            return listening_store(addr, int(port), timeout)
        return TCPStore(addr, int(port), is_master=False, wait_for_workers=False,
                        timeout=dt.timedelta(seconds=timeout))


def host_first_rank(group_rank: int, host_group: int, nodes: int, local_rank: int, local_world: int) -> int:
    """The global rank of a process when the node groups are rotated so that the host node (the run's
    own, group HOST_GROUP in torch's rendezvous order, which sorts by hostname and pid) comes first."""
    if not (0 <= group_rank < nodes and 0 <= host_group < nodes and 0 <= local_rank < local_world):
        raise ValueError(f"group {group_rank}/host {host_group} of {nodes} nodes, local rank {local_rank} of "
                         f"{local_world}")
    return ((group_rank - host_group) % nodes) * local_world + local_rank


def _renumber_host_first(rdzv: dict[str, Any]) -> None:
    """Set RANK so that the run's own node holds ranks 0..local_world-1 (see `host_first_rank`): its local
    rank 0 publishes its group rank on the control store, every rank reads it. Every node must start the
    same number of ranks (train.gpus)."""
    spec = Rendezvous(**rdzv)
    group, nodes = int(os.environ["GROUP_RANK"]), int(os.environ["GROUP_WORLD_SIZE"])
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    world = int(os.environ["WORLD_SIZE"])
    if world != nodes * local_world:
        raise TrainError(f"{nodes} nodes started {world} ranks in all, not {nodes} x {local_world}: every node "
                         "must start the same number of ranks; set train.gpus to a count every node has")
    store = spec.store()
    key = f"{spec.run_id}/host-group"
    if spec.host and local == 0:
        store.set(key, str(group))
    os.environ["RANK"] = str(host_first_rank(group, int(store.get(key)), nodes, local, local_world))


def launch_ranks(cfg: RunConfig, store: Store, vocab_ref: ArtifactRef, extract_refs: list[ArtifactRef],
                 ranks: int, on_metrics: MetricsCallback | None = None,
                 rendezvous: Rendezvous | None = None, *, digest: str) -> ArtifactRef | None:
    """Train on `ranks` processes of this node started by torch's elastic launcher (what torchrun
    runs): each is a fresh Python that calls `train_here` as one DDP rank (NCCL on GPUs, gloo on a
    CPU) for the train artifact at DIGEST (the stage's address, which the ranks take). Rank 0 appends
    its metrics to a JSON-lines file that this process follows while they run.
    A rank that fails stops the others (the launcher's doing) and this call raises TrainError naming
    the rank, with its error and traceback. Rank logs go to a temporary folder, kept on failure.
    With RENDEZVOUS (several nodes) this node's `ranks` join the others' there; only the host node's
    call returns the artifact (rank 0 is there), the others return None."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from tasks.core.owners import owned_tempdir
    from tasks.store.model import COMMITTED_HERE

    folder = owned_tempdir("ranks")
    paths = {k: os.path.join(folder, name) for k, name in
             (("args", "args.json"), ("metrics", "metrics.jsonl"), ("result", "result.json"), ("logs", "logs"))}
    with open(paths["args"], "w") as fh:  # no secrets: the store's credentials come from each rank's environment
        json.dump({"cfg": cfg.model_dump(mode="json"), "store": store.uri, "vocab": vocab_ref.model_dump(mode="json"),
                   "extract": [r.model_dump(mode="json") for r in extract_refs], "digest": digest,
                   "metrics": paths["metrics"], "result": paths["result"],
                   "rendezvous": asdict(rendezvous) if rendezvous is not None and rendezvous.nodes > 1 else None}, fh)
    # Ctrl-C and SIGTERM stay with the run's own handlers (flows/interrupts.py): they raise in this thread, and
    # the launcher stops the ranks on the way out. (It takes a signal nobody sends, restored below; torch < 2.8
    # has no such option and takes SIGTERM/SIGINT itself, which stops the ranks too.)
    quiet = {"signals_to_handle": "SIGUSR2"} if "signals_to_handle" in LaunchConfig.__dataclass_fields__ else {}
    # No store torch starts listens on every interface: the rendezvous store is ours (the run's node hosts it,
    # `Rendezvous.store`; one node: on 127.0.0.1, here), and the workers' store the first node starts binds
    # the address it advertises (local_addr: this node's address, 127.0.0.1 for one node).
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    if not hasattr(DynamicRendezvousHandler, "_create_tcp_store_server"):  # a torch that starts it elsewhere
        log.warning("this torch starts the workers' store on every interface (no _create_tcp_store_server to "
                    "bind it): keep the nodes' network private")
    DynamicRendezvousHandler._create_tcp_store_server = _bound_store_server
    private, nodes, local_addr, rdzv = _rendezvous_args(rendezvous, digest)
    launch = LaunchConfig(
        min_nodes=nodes, max_nodes=nodes, nproc_per_node=ranks, rdzv_backend="c10d", **rdzv, local_addr=local_addr,
        max_restarts=0,  # a failed rank fails the task; the retry resumes from the checkpoint
        monitor_interval=0.5, logs_specs=DefaultLogsSpecs(log_dir=paths["logs"], redirects=Std.ALL), **quiet)
    log.info("train %s: starting %d ranks with torch's elastic launcher%s; rank logs under %s", digest, ranks,
             f" (one of {nodes} nodes, rendezvous {rendezvous.endpoint} id {rendezvous.label})" if nodes > 1 else "",
             paths["logs"])
    saved = {}  # the launcher sets handlers in the main thread only; whatever it set, ours come back after
    if threading.current_thread() is threading.main_thread():
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                                        signal.SIGQUIT)}
    tail = _MetricsTail(paths["metrics"], on_metrics, lambda: _terminate_ranks(folder)).start()
    try:
        elastic_launch(launch, sys.executable)("-c", RANK_ENTRY, paths["args"])
    except (ChildFailedError, SignalException) as exc:
        stopping.check(f"training on {ranks} ranks (they were stopped; a rerun resumes from the last checkpoint)")
        if isinstance(exc, SignalException):
            raise TrainError(f"training on {ranks} ranks was stopped by {exc.sigval.name}; the ranks were "
                             f"terminated (logs under {paths['logs']}); a retry resumes from the last checkpoint"
                             ) from None
        raise TrainError(describe_rank_failure(exc.failures, ranks * nodes, paths["logs"])) from None
    except RendezvousError as exc:  # a node that never joined (or left while the others waited)
        raise TrainError(f"the {nodes} nodes' launchers did not meet at the rendezvous {rdzv['rdzv_endpoint']} "
                         f"({type(exc).__name__}: {exc}); a retry runs on the nodes there are then") from None
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
        tail.stop()
        del private  # the private rendezvous's store stops listening
    if rendezvous is not None and not rendezvous.host:
        shutil.rmtree(folder, ignore_errors=True)
        return None  # rank 0 is on the run's own node, which commits the artifact
    with open(paths["result"]) as fh:
        result = json.load(fh)
    ref = ArtifactRef.model_validate(result["ref"])
    if result["executed"]:
        COMMITTED_HERE.add(ref.attempt)  # our ranks computed it: the run summary counts it as executed
    shutil.rmtree(folder, ignore_errors=True)
    return ref


def _rendezvous_args(rendezvous: Rendezvous | None, digest: str) -> tuple[Any, int, str, dict[str, Any]]:
    """Where the launcher's ranks meet: (the private store to keep alive, or None; nodes; this node's address;
    the launcher's rdzv arguments). One node: like torchrun --standalone, a private rendezvous on the loopback;
    several: every node's launcher at the same rendezvous, exactly `nodes` of them (no waiting for more)."""
    if rendezvous is None:
        private = listening_store("127.0.0.1")
        return private, 1, "127.0.0.1", {"run_id": secret_run_id(digest),
                                         "rdzv_endpoint": f"127.0.0.1:{private.port}",
                                         "rdzv_configs": {"is_host": False}}
    return None, rendezvous.nodes, node_address(), {
        "run_id": rendezvous.run_id, "rdzv_endpoint": rendezvous.endpoint,
        "rdzv_configs": {"is_host": False, "join_timeout": 600, "read_timeout": 300}}


def _terminate_ranks(folder: str) -> None:
    """SIGTERM the ranks whose pid files are in `folder` (the run was asked to stop); the launcher
    then sees them end and returns."""
    import glob

    for path in glob.glob(os.path.join(folder, "rank-*.pid")):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(open(path).read()), signal.SIGTERM)


def _exit_with_parent() -> None:
    """A rank whose launcher died (the flow's process killed) stops too instead of training on unseen."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="draftline-parent-watch", daemon=True).start()


def _rank_main() -> None:
    args = json.loads(open(sys.argv[-1]).read())
    if args.get("rendezvous"):
        _renumber_host_first(args["rendezvous"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank {rank}/{world} %(levelname)s %(name)s: %(message)s")
    _exit_with_parent()
    with open(os.path.join(os.path.dirname(sys.argv[-1]), f"rank-{rank}.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    cfg = RunConfig.model_validate(args["cfg"])
    if not wants_cuda(cfg.train) and "OMP_NUM_THREADS" not in os.environ:
        # ranks share the CPU: oversubscribed OpenMP threads spin against each other
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    store = Store.from_config(cfg.store.model_copy(update={"uri": args["store"]}))
    sink = open(args["metrics"], "a", buffering=1) if rank == 0 else None

    def on_metrics(rec: dict[str, Any]) -> None:
        if sink is not None:
            sink.write(json.dumps(rec, default=str) + "\n")  # line-buffered: one whole line per record

    from tasks.train.loop import train_here  # this rank is one process of the train stage

    try:
        ref = train_here(cfg, store, ArtifactRef.model_validate(args["vocab"]),
                         [ArtifactRef.model_validate(r) for r in args["extract"]], on_metrics, digest=args["digest"])
    finally:
        if sink is not None:
            sink.close()
    if rank == 0:
        tmp = args["result"] + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"ref": ref.model_dump(mode="json"), "executed": ref.executed_here}, fh)
        os.replace(tmp, args["result"])


def rank_main() -> None:
    """Entry point of one rank that `launch_ranks` started (`python -c RANK_ENTRY ARGS.json`). An
    exception is written to torch elastic's error file, from which the launcher reports it."""
    from torch.distributed.elastic.multiprocessing.errors import record

    record(_rank_main)()
