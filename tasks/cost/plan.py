"""The cost model behind `draftline plan CONFIG` (cli/commands/plan.py): the tokens, store bytes, hours and money a run will take, before it starts.

Everything comes from two places: the config (samples, lengths, layer ids, regeneration tokens, steps, batch
sizes) and the rates in configs/rates.yaml, each of which names its source and kind (a run in
benchmarks/RESULTS.md, a cited published figure, or an assumption). The rates that depend on the hardware
come from a machine profile (`--machine`: a rented B300 NVL8 node, or the user's own 8 x RTX PRO 6000
workstation). Training FLOPs per token are `tasks.train.model.flops_per_token` of the draft this config
would train (speculators' Eagle3DraftModel, built on the meta device: no memory, no weights); extraction
FLOPs are 2 x the target's active parameters per token, the MFU convention of benchmarks/RESULTS.md.

What runs where is the code's: extraction and regeneration are dealt over the nodes (`extract.nodes`;
REGENERATE_FANS_OUT below), training reads its parts through the node-local part cache (NODE_PART_CACHE), and
training runs on `train.nodes` nodes (one in the presets), the benchmark on one. Cost is counted three ways: the nodes held for the whole
wall-clock, a schedule that rents the nodes per stage, and the busy node-hours alone.

`make_plan` is a plain function (config, rates and the run's lengths in, numbers out: it reads no store; the
rates are tasks/cost/rates.py's, the lengths tasks/cost/lengths.py's, the draft's shape tasks/cost/shape_cache.py's,
built once per draft and kept in draftline's cache home); `render` prints the markdown that
docs/kimi-k2.5.md shows verbatim (tests/unit/cost/test_plan.py keeps them equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.core.config import RunConfig
from tasks.cost.lengths import Lengths, length_notes
from tasks.cost.rates import DEFAULT_MACHINE, SHAPE_KEYS, PlanError, Rate
from tasks.cost.shape import Shape, head_cost_rate, hidden_bytes_per_token
from tasks.cost.shape_cache import cached_shape
from tasks.data.encoding import AUTO_CONVERSATIONS_PER_WORKER, AUTO_MAX_WORKERS, default_workers
from tasks.engine.target import text_config
from tasks.train.preflight import head_problems

CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two fp32 moments (tasks/train/checkpoints.py Checkpointer.write)

# What the code does, as switches so a plan can show what each is worth (tests flip them): regeneration shards
# are dealt over the nodes like extraction's (flows/shard_nodes.py run_nodes); False prices regeneration on one node.
REGENERATE_FANS_OUT = True
# Training reads its parts through the node-local part cache (tasks/store/part_cache.py), so epochs after the first
# read from the node's NVMe what the cache holds; False prices every epoch downloading every part again.
NODE_PART_CACHE = True


@dataclass
class Stage:
    stage: str
    nodes: int  # nodes it runs on (rented for it when renting per stage)
    tokens: float
    what: str  # what the tokens are
    bytes_bf16: float  # written to the store
    bytes_fp8: float
    kept: float  # bytes that stay on the store after the run, at the config's storage dtype
    node_hours: float  # busy
    wall_hours: float


@dataclass
class Plan:
    config: str
    machine: str
    nodes: int
    gpus: int
    price: float
    stages: list[Stage]
    notes: list[str]
    rates: list[Rate]
    totals: dict[str, float] = field(default_factory=dict)
    dominant: str = ""
    levers: list[dict[str, Any]] = field(default_factory=list)


def _override(cfg: RunConfig, section: str, **values: Any) -> RunConfig:
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=values)})


def make_plan(cfg: RunConfig, rates: dict[str, Any], *, nodes: int = 1, config_name: str = "",
              lengths: Lengths | None = None, shape: Shape | None = None, levers: bool = True) -> Plan:
    """The plan of CFG's run on `rates` (a machine's, load_rates) over NODES nodes: per stage its tokens, store
    bytes, busy node-hours and wall-clock hours; the totals and costs; the notes that say what each rests on;
    with LEVERS, the same plan with one thing changed at a time. LENGTHS: the run's own (tasks/cost/lengths.py),
    else the rates' assumptions; SHAPE: the target's and draft's sizes (when not given: tasks/cost/shape_cache.py's, built once per draft)."""
    shape = _checked_shape(cfg, rates, nodes, shape)
    lengths = lengths or Lengths()
    r = {k: v.value for k, v in rates["rates"].items()}
    t = {k: v.value for k, v in shape.target.rates.items()}
    gpus, price = int(r["node.gpus"]), r["node.gpu_hour_price"]
    w = _workload(cfg, r, lengths)
    # one vLLM engine start: a fixed part (compile, CUDA graphs, KV cache) plus the bytes each GPU of the engine
    # loads (its 1 / tensor_parallel_size share of the weights) at engine.start_s_per_gb
    start_h = (r["engine.start_fixed_s"] + t["weights_gb"] / cfg.extract.tensor_parallel_size
               * r["engine.start_s_per_gb"]) / 3600
    ex = _extraction(cfg, r, t, shape, w.tokens)
    tr = _training(cfg, r, shape, w.tokens, ex)
    bench = _benchmark_work(cfg, r, t, start_h) if cfg.benchmark.enabled else None
    stages = _stages(cfg, r, t, nodes, w, start_h, ex, tr, bench)
    totals = _totals(stages, r, nodes, gpus * price, tr, ex)
    dominant = max(stages, key=lambda s: s.wall_hours).stage
    notes = _workload_notes(cfg, shape, lengths, w, tr, bench, gpus, price, stages)
    notes += _stage_notes(cfg, r, t, shape, w, ex, tr, start_h, bench)
    notes += _cost_notes(stages, totals, nodes, tr, ex.dtype, r["storage.gb_month_price"], dominant)
    plan = Plan(config_name, rates.get("machine", DEFAULT_MACHINE), nodes, gpus, price, stages, notes,
                _listed_rates(cfg, rates, shape, lengths, w, ex, tr), totals, dominant)
    if levers:
        plan.levers = _levers(cfg, rates, plan, nodes=nodes, lengths=lengths, shape=shape)
    return plan


def _checked_shape(cfg: RunConfig, rates: dict[str, Any], nodes: int, shape: Shape | None) -> Shape:
    """SHAPE (or cached_shape's), once the node count, the sample count, the heads and the target's weights pass."""
    if nodes < 1:
        raise PlanError(f"--nodes must be 1 or more, got {nodes}")
    if rates.get("max_nodes") and nodes > rates["max_nodes"]:
        raise PlanError(f"--nodes {nodes}: the machine {rates['machine']} is {rates['max_nodes']} node(s); plan the "
                        f"rest of the run on the pool with --machine {DEFAULT_MACHINE}")
    if not cfg.data.max_samples:
        raise PlanError("data.max_samples is not set: a plan needs the number of samples (set it, or "
                        "--set data.max_samples=N)")
    shape = shape or cached_shape(cfg, rates)
    # a head this target cannot train is refused as `draftline run` refuses it (tasks/train/preflight.py)
    problems = head_problems(cfg, text_config(shape.target.hf_config))
    if problems:
        raise PlanError("\n".join(problems))
    if "weights_gb" not in shape.target.rates:
        raise PlanError(f"configs/rates.yaml: targets: {shape.target.known_as or cfg.target.model}: add weights_gb "
                        "(value, unit, kind, source), or pass --rate target.weights_gb=...: an engine start is priced "
                        "by the bytes it loads")
    return shape


@dataclass
class Workload:
    """The samples and their tokens: the prompt plus the answer (the target's, or the data's), within max_length;
    and the processes prepare encodes them on (data.workers, else its default on node.cpus cores)."""
    samples: int
    prompt: float
    answer: float
    per_sample: float
    tokens: float
    prepare_workers: int = 1


def _workload(cfg: RunConfig, r: dict[str, float], lengths: Lengths) -> Workload:
    samples = min(cfg.data.max_samples, lengths.samples or cfg.data.max_samples)
    prompt = lengths.prompt if lengths.prompt is not None else r["regenerate.prompt_tokens"]
    room = cfg.regenerate.max_tokens if cfg.regenerate.enabled else max(cfg.data.max_length - prompt, 0)
    answer = (min(lengths.answer, room) if lengths.answer is not None else r["regenerate.answer_fill"] * room)
    per_sample = min(cfg.data.max_length, prompt + answer)
    workers = cfg.data.workers or default_workers(int(r["node.cpus"]), samples + cfg.data.heldout)
    return Workload(samples, prompt, per_sample - prompt, per_sample, samples * per_sample, workers)


@dataclass
class Extraction:
    """Extraction's rates: bytes per token stored, compute- and store-bound tokens/s per node, in each dtype."""
    bpt: dict[str, int]
    rate_name: str
    mfu: float
    compute_rate: float
    store_rate: dict[str, float]
    rate: dict[str, float]
    dtype: str
    hours: float  # node-hours of prefill at the config's dtype (engine starts apart)


def _extraction(cfg: RunConfig, r: dict[str, float], t: dict[str, float], shape: Shape, tokens: float) -> Extraction:
    bpt = {d: hidden_bytes_per_token(shape.n_layers, shape.hidden, d) for d in ("bf16", "fp8")}
    rate_name = "extract.mfu_moe" if shape.target.experts else "extract.mfu_dense"
    mfu = r[rate_name]
    peak = r["node.matmul_tflops"] * 1e12
    compute_rate = int(r["node.gpus"]) * peak * mfu / (2 * t["active_params"])
    store_rate = {d: r["node.store_write_gb_s"] * 1e9 / bpt[d] for d in bpt}
    rate = {d: min(compute_rate, store_rate[d]) for d in bpt}
    dtype = cfg.extract.storage_dtype
    return Extraction(bpt, rate_name, mfu, compute_rate, store_rate, rate, dtype, tokens / rate[dtype] / 3600)


@dataclass
class Training:
    """Training over train.nodes nodes (torch's elastic launcher over each one's GPUs, one rendezvous;
    batch_tokens per rank), as fast as the slower of their compute and their reads (each node reads its ranks'
    share); the heads train one after another, each at its own steps and FLOPs per token."""
    tnodes: int
    ranks: int
    heads: list[Any]
    head_steps: list[int]
    steps: int
    tokens: float
    rate_name: str
    mfu: float
    per_gpu: float
    node_rate: float
    costs: list[float]
    head_compute: list[float]
    compute_h: float
    data_bytes: float
    hit: float
    from_cache: float
    from_store: float
    read_rate: dict[str, float]
    read_h: dict[str, float]
    head_read: list[float]
    head_h: list[float]
    hours: float
    binding: str
    written: float
    kept: float
    keep: int | None


def _training(cfg: RunConfig, r: dict[str, float], shape: Shape, tokens: float, ex: Extraction) -> Training:
    tnodes = int(getattr(cfg.train, "nodes", 1) or 1)
    ranks = (cfg.train.gpus or int(r["node.gpus"])) * tnodes
    heads = cfg.train.heads
    head_steps = [h.max_steps or cfg.train.max_steps for h in heads]  # one train task per head, one after another
    steps = sum(head_steps)
    train_tokens = steps * cfg.train.batch_tokens * ranks
    # auto is flex_attention on a GPU where it compiles (tasks.train.model.resolve_attn_impl)
    rate_name = "train.mfu_flex_attention" if cfg.train.attn_impl in ("auto", "flex_attention") else "train.mfu_sdpa"
    mfu = r[rate_name]
    peak = r["node.matmul_tflops"] * 1e12
    per_gpu = peak * mfu / shape.train_flops
    node_rate = per_gpu * ranks * (r["train.multi_gpu_efficiency"] if ranks > 1 else 1.0)  # all nodes together
    costs = [shape.head_cost(h, cfg.train) for h in heads]  # each head's FLOPs per token over the EAGLE-3 draft's
    head_compute = [s * f * cfg.train.batch_tokens * ranks / node_rate / 3600 for s, f in zip(head_steps, costs)]
    compute_h = sum(head_compute)
    bpt = ex.bpt[ex.dtype]
    data_bytes = tokens * bpt
    hit = min(1.0, r["node.cache_tb"] * 1e12 / data_bytes) if NODE_PART_CACHE and data_bytes else 0.0
    first = min(train_tokens, tokens)  # the first epoch comes from the store
    from_cache = (train_tokens - first) * hit
    from_store = train_tokens - from_cache
    read_rate = {"store": r["node.store_read_gb_s"] * 1e9 / bpt, "node cache": r["node.cache_read_gb_s"] * 1e9 / bpt}
    read_h = {"store": from_store / read_rate["store"] / tnodes / 3600,
              "node cache": from_cache / read_rate["node cache"] / tnodes / 3600}
    # the heads train one after another, each as fast as the slower of its compute and its reads (its steps' share)
    head_read = [sum(read_h.values()) * st / steps for st in head_steps]
    head_h = [max(c, rd) for c, rd in zip(head_compute, head_read)]
    binding = "compute" if compute_h >= sum(read_h.values()) else max(read_h, key=read_h.get) + " read"
    ckpt_sizes = [shape.head_params(h, cfg.train) * CHECKPOINT_BYTES_PER_PARAM for h in heads]
    keep = int(getattr(cfg.train, "keep_checkpoints", 0) or 0) or None  # read defensively: older configs lack it
    written = sum(s // cfg.train.checkpoint_every * c for s, c in zip(head_steps, ckpt_sizes))
    kept = sum(min(s // cfg.train.checkpoint_every, keep or s) * c for s, c in zip(head_steps, ckpt_sizes))
    return Training(tnodes, ranks, heads, head_steps, steps, train_tokens, rate_name, mfu, per_gpu, node_rate, costs,
                    head_compute, compute_h, data_bytes, hit, from_cache, from_store, read_rate, read_h, head_read,
                    head_h, sum(head_h), binding, written, kept, keep)


@dataclass
class BenchmarkWork:
    """The engines tasks/benchmark/stage.py starts (the baseline, one per head and benchmark.drafts and k, and
    the offline replay's hidden-state engine) and the tokens they generate at batch size 1 and above."""
    engines: int
    decoding: int
    tokens: float
    hours: float
    engine_h: float  # one decoding engine: its start and its share of the decodes (a head's engines: one per k)


def _benchmark_work(cfg: RunConfig, r: dict[str, float], t: dict[str, float], start_h: float) -> BenchmarkWork:
    decoding = 1 + (len(cfg.train.heads) + len(cfg.benchmark.drafts)) * len(cfg.benchmark.num_speculative_tokens)
    engines = decoding + int(cfg.benchmark.offline_replay and cfg.benchmark.temperature == 0)
    per_bs = sum(e.num_prompts for e in cfg.benchmark.evals) * cfg.benchmark.max_tokens * decoding
    single = per_bs if 1 in cfg.benchmark.batch_sizes else 0
    batched = per_bs * len([b for b in cfg.benchmark.batch_sizes if b > 1])
    decode_h = (single / t["decode_tok_s_batch1"] + batched / t["decode_tok_s"]) / 3600
    return BenchmarkWork(engines, decoding, single + batched, engines * start_h + decode_h,
                         start_h + decode_h / decoding)


def _stages(cfg: RunConfig, r: dict[str, float], t: dict[str, float], nodes: int, w: Workload, start_h: float,
            ex: Extraction, tr: Training, bench: BenchmarkWork | None) -> list[Stage]:
    """Each stage's row: nodes, tokens, bytes written (bf16, fp8) and kept, busy node-hours, wall-clock hours."""
    pq = r["prepare.bytes_per_token"]
    prep_h = _prepare_hours(r, w)
    prep_tokens = w.samples * (w.prompt if cfg.regenerate.enabled else w.per_sample)
    stages = [Stage("prepare", 1, prep_tokens, "prompt" if cfg.regenerate.enabled else "sample", prep_tokens * pq,
                    prep_tokens * pq, prep_tokens * pq, prep_h, prep_h)]
    # a sharded stage's orchestration (the run's wall, whatever the nodes): measured per shard on the rehearsal
    orch_h = cfg.data.num_shards * r["orchestration.shard_s"] / 3600
    if cfg.regenerate.enabled:
        regen_nodes = nodes if REGENERATE_FANS_OUT else 1
        gen = w.samples * w.answer
        busy = regen_nodes * (start_h + orch_h) + gen / t["decode_tok_s"] / 3600
        wall = start_h + orch_h + gen / (regen_nodes * t["decode_tok_s"]) / 3600
        stored = 2 * w.tokens * pq  # the shard artifacts, and the stage's artifact that copies them
        stages.append(Stage("regenerate", regen_nodes, gen, "generated", stored, stored, stored, busy, wall))
    stages.append(Stage("vocab", 1, w.tokens, "counted", 0.0, 0.0, 0.0, 0.0, 0.0))
    stages.append(Stage("extract", nodes, w.tokens, "prefilled", w.tokens * ex.bpt["bf16"], w.tokens * ex.bpt["fp8"],
                        w.tokens * ex.bpt[ex.dtype], nodes * (start_h + orch_h) + ex.hours,
                        start_h + orch_h + ex.hours / nodes))
    stages.append(Stage("train", tr.tnodes, tr.tokens, "trained", tr.written, tr.written, tr.kept,
                        tr.tnodes * tr.hours, tr.hours))
    if bench is not None:
        stages.append(Stage("benchmark", 1, bench.tokens, "generated", 0.0, 0.0, 0.0, bench.hours, bench.hours))
    return stages


def _totals(stages: list[Stage], r: dict[str, float], nodes: int, node_price: float, tr: Training,
            ex: Extraction) -> dict[str, float]:
    wall = sum(s.wall_hours for s in stages)
    kept_bytes = sum(s.kept for s in stages)
    totals = {"bytes_bf16": sum(s.bytes_bf16 for s in stages), "bytes_fp8": sum(s.bytes_fp8 for s in stages),
              "kept": kept_bytes, "node_hours": sum(s.node_hours for s in stages), "wall_hours": wall,
              "cost_held": nodes * wall * node_price,
              "cost_per_stage": sum(s.nodes * s.wall_hours for s in stages) * node_price,
              "cost_busy": sum(s.node_hours for s in stages) * node_price,
              "storage_month": kept_bytes / 1e9 * r["storage.gb_month_price"],
              "train_read_bytes": tr.tokens * ex.bpt[ex.dtype], "train_compute_hours": tr.compute_h,
              "train_read_hours": sum(tr.read_h.values())}
    totals["cost"] = min(totals["cost_held"], totals["cost_per_stage"])
    return totals


def _lengths_source(lengths: Lengths) -> str:
    assumed = "assumed (configs/rates.yaml regenerate.prompt_tokens, regenerate.answer_fill)"
    if lengths.prompt is None and lengths.answer is None:
        return assumed + (f"; {lengths.source}" if lengths.source else "")
    if lengths.answer is None:
        return f"prompt from the run's {lengths.source}; answer assumed (regenerate.answer_fill)"
    return f"from the run's {lengths.source}"


def _workload_notes(cfg: RunConfig, shape: Shape, lengths: Lengths, w: Workload, tr: Training,
                    bench: "BenchmarkWork | None", gpus: int,
                    price: float, stages: list[Stage]) -> list[str]:
    """What the plan rests on: the workload and its lengths, each head's training, the target's rates."""
    heads, costs = tr.heads, tr.costs
    notes = [
        f"Workload: {w.samples:,} samples x {w.per_sample:,.0f} tokens ({w.prompt:,.0f} prompt + {w.answer:,.0f} answer"
        f"{'' if cfg.regenerate.enabled else ' from the data'}) = {_count(w.tokens)} tokens; lengths: "
        f"{_lengths_source(lengths)}. "
        f"Training reads {_count(tr.tokens)} tokens = {tr.tokens / w.tokens:.2f} epochs ({tr.steps:,} steps x "
        f"{cfg.train.batch_tokens:,} tokens x {tr.ranks} ranks"
        + (f"; {len(heads)} heads, each priced at its FLOPs per token over the EAGLE-3 draft below (Shape.head_cost: "
           + ", ".join(f"{h.label} {c:.2f}" for h, c in zip(heads, costs)) + ")" if len(heads) > 1 else "") + ").",
    ]
    notes += length_notes(cfg, lengths)
    if len(heads) > 1:  # each head's own train task (its steps, layers, FLOPs per token, reads) and engines
        ks = cfg.benchmark.num_speculative_tokens if bench is not None else []
        engine_h = bench.engine_h if bench is not None else 0.0
        notes.append("Per head (one train task each, one after another; then one benchmark engine per k in "
                     f"{ks}): " + "; ".join(
            f"{h.label} ({h.kind}, {h.num_layers or cfg.train.num_layers} layer(s), "
            f"{_count(shape.head_params(h, cfg.train))} parameters) {st:,} steps x {c:.2f}: {hh:,.2f} h "
            f"({'compute' if hc >= hr else 'read'}-bound), ${tr.tnodes * hh * gpus * price:,.0f}"
            + (f", + {len(ks)} engine(s) {len(ks) * engine_h:,.2f} h, ${len(ks) * engine_h * gpus * price:,.0f}"
               if ks else "")
            for h, st, c, hc, hr, hh in zip(heads, tr.head_steps, costs, tr.head_compute, tr.head_read, tr.head_h))
            + ".")
    target = shape.target
    if target.known_as and not Path(cfg.target.model).exists():
        notes.append(f"Target: {cfg.target.model} (not on this machine) is a local copy of {target.known_as} "
                     "(configs/rates.yaml local_copies): its shape and rates are used.")
    elif target.known_as:
        notes.append(f"Target: {cfg.target.model} has the shape of {target.known_as} ({', '.join(SHAPE_KEYS)}): "
                     f"its rates in configs/rates.yaml are used.")
    if cfg.regenerate.enabled:
        regen_nodes = next(s.nodes for s in stages if s.stage == "regenerate")
        notes.append(
            f"Regeneration: {_count(target.rates['decode_tok_s'].value)} output tok/s per node "
            f"({target.rates['decode_tok_s'].kind}), dealt over {regen_nodes} node(s) like extraction's shards.")
    return notes


def _prepare_hours(r: dict[str, float], w: Workload) -> float:
    """prepare's hours: one process's rate; on several workers, the parent's own part (reading the sources,
    writing the spill and the shards: serial) plus the encoding shared by the workers at their efficiency."""
    n = w.prepare_workers
    if n == 1:
        return w.samples / r["prepare.samples_per_s"] / 3600
    shared = _worker_s_per_sample(r) / (n * r["prepare.worker_efficiency"])
    return w.samples * (r["prepare.parent_s_per_sample"] + shared) / 3600


def _worker_s_per_sample(r: dict[str, float]) -> float:
    """An encoding worker's seconds per sample: what one process spends on a sample less the parent's own part,
    which stays in the parent when workers encode."""
    one = 1 / r["prepare.samples_per_s"]
    if r["prepare.parent_s_per_sample"] >= one:
        raise PlanError(f"prepare.parent_s_per_sample ({r['prepare.parent_s_per_sample']:g} s) is not below one "
                        f"process's time per sample (1 / prepare.samples_per_s = {one:g} s): the parent's part is a "
                        "share of that time; set the two from one measurement (benchmarks/bench_data_scale.py)")
    return one - r["prepare.parent_s_per_sample"]


def _stage_notes(cfg: RunConfig, r: dict[str, float], t: dict[str, float], shape: Shape, w: Workload,
                 ex: Extraction, tr: Training, start_h: float, bench: BenchmarkWork | None) -> list[str]:
    """How prepare, extraction, training and the engine starts are priced, and what binds each."""
    dtype, bpt = ex.dtype, ex.bpt
    other = "fp8" if dtype == "bf16" else "bf16"
    bound = "store" if ex.store_rate[dtype] < ex.compute_rate else "compute"
    engines = bench.engines if bench is not None else 0
    decoding = bench.decoding if bench is not None else 0
    workers = (f"data.workers {cfg.data.workers}" if cfg.data.workers else
               f"data.workers' default on node.cpus {r['node.cpus']:g}: one per core, at most {AUTO_MAX_WORKERS}, "
               f"one per {AUTO_CONVERSATIONS_PER_WORKER:,} samples encoded")
    return [
        f"Prepare: {w.samples:,} samples at {r['prepare.samples_per_s']:g} samples/s in one process"
        + (f"; on {w.prepare_workers} encoding workers ({workers}) the parent's own "
           f"{r['prepare.parent_s_per_sample'] * 1e3:g} ms per sample (prepare.parent_s_per_sample) plus a "
           f"worker's {_worker_s_per_sample(r) * 1e3:.2f} ms (one process's less the parent's) / ({w.prepare_workers} "
           f"x {r['prepare.worker_efficiency']:g} (prepare.worker_efficiency))"
           if w.prepare_workers > 1 else f" ({workers})")
        + f" = {_prepare_hours(r, w):,.2f} h ({w.samples / r['prepare.samples_per_s'] / 3600:,.2f} h in one process).",
        f"Orchestration: {cfg.data.num_shards:,} shards x {r['orchestration.shard_s']:g} s "
        f"(orchestration.shard_s: Prefect task runs, child runs, the store's manifests) = "
        f"{cfg.data.num_shards * r['orchestration.shard_s'] / 60:,.1f} min of wall per sharded stage"
        + (" (regeneration and extraction)" if cfg.regenerate.enabled else "") + ".",
        f"Extraction: {shape.n_layers} layers x hidden {shape.hidden:,} = {bpt['bf16']:,} bytes/token bf16, "
        f"{bpt['fp8']:,} fp8; compute {_count(ex.compute_rate)} tok/s per node (2 x {_count(t['active_params'])} "
        f"active params, MFU {ex.mfu:g}), store {_count(ex.store_rate[dtype])} tok/s ({dtype}): "
        f"{_count(ex.rate[dtype])} tok/s, {bound}-bound. With {other}: {_count(ex.rate[other])} tok/s, "
        f"{w.tokens / ex.rate[other] / 3600:,.1f} node-hours.",
        f"Training: the draft has {_count(shape.trainable)} trainable parameters, {shape.train_flops / 1e9:.2f} GFLOP "
        f"per token (tasks.train.model.flops_per_token, {cfg.train.ttt_steps} TTT steps): {_count(tr.per_gpu)} tok/s "
        f"per GPU at MFU {tr.mfu:g}, {_count(tr.node_rate)} tok/s per node = {tr.compute_h:,.2f} h of compute. It "
        f"reads {_bytes(tr.tokens * bpt[dtype])} ({dtype}; {_bytes(tr.data_bytes)} per epoch): "
        f"{_bytes(tr.from_store * bpt[dtype])} from the store at {_count(tr.read_rate['store'])} tok/s "
        f"({tr.read_h['store']:,.2f} h), {_bytes(tr.from_cache * bpt[dtype])} from the node cache at "
        f"{_count(tr.read_rate['node cache'])} tok/s ({tr.read_h['node cache']:,.2f} h; "
        + (f"it holds {tr.hit:.0%} of an epoch, NODE_PART_CACHE in tasks/cost/plan.py" if NODE_PART_CACHE
           else "no node cache: NODE_PART_CACHE is off") + f"): **{tr.binding}-bound**, {tr.hours:,.2f} h.",
        f"Engine starts: {start_h * 60:,.1f} min each ({r['engine.start_fixed_s']:g} s, engine.start_fixed_s, + "
        f"{t['weights_gb']:,.0f} GB of weights / {cfg.extract.tensor_parallel_size} GPU(s) x "
        f"{r['engine.start_s_per_gb']:g} s per GB, engine.start_s_per_gb)"
        + (f"; the benchmark starts {engines} (the baseline, {engines - 1 - int(engines > decoding)} with a draft: "
           f"k in {cfg.benchmark.num_speculative_tokens}"
           + (", and the offline replay's" if engines > decoding else "") + ")" if bench is not None else "")
        + ".",
    ]


def _cost_notes(stages: list[Stage], totals: dict[str, float], nodes: int, tr: Training, dtype: str,
                gb_month: float, dominant: str) -> list[str]:
    """Where the stages run, what the run costs held or rented per stage, what it keeps on the store."""
    fanned = [s.stage for s in stages if s.nodes > 1]
    wall = totals["wall_hours"]
    top = next(s for s in stages if s.stage == dominant)
    return [
        (f"Nodes: {', '.join(fanned)} dealt over {nodes} nodes (each node starts its own engine); "
         f"{', '.join(s.stage for s in stages if s.nodes == 1 and s.wall_hours > 0)} on one node." if fanned
         else "Nodes: every stage on one node."),
        f"Cost: {nodes} node(s) held for the {wall:,.1f} h wall-clock: **${totals['cost_held']:,.0f}**."
        + (f" Renting per stage instead ({nodes} nodes for {' and '.join(fanned)}, one node for the rest: "
           f"hand the other nodes back after extraction, draftline does not): **${totals['cost_per_stage']:,.0f}**, "
           f"${totals['cost_held'] - totals['cost_per_stage']:,.0f} less."
           if totals["cost_per_stage"] < totals["cost_held"] - 0.5 else ""),
        f"Store: {_bytes(totals['bytes_bf16'] if dtype == 'bf16' else totals['bytes_fp8'])} written, "
        f"{_bytes(totals['kept'])} kept (train: {_bytes(tr.written)} of checkpoints written, {_bytes(tr.kept)} kept "
        f"with keep_checkpoints {tr.keep if tr.keep else 'unset: all'}) = **${totals['storage_month']:,.0f} per "
        f"month** at ${gb_month:g} per GB-month.",
        f"Dominant stage: **{dominant}**, {top.wall_hours:,.1f} of {wall:,.1f} wall-clock hours "
        f"({top.wall_hours / wall:.0%}).",
    ]


def _listed_rates(cfg: RunConfig, rates: dict[str, Any], shape: Shape, lengths: Lengths, w: Workload,
                  ex: Extraction, tr: Training) -> list[Rate]:
    """Every rate the plan used, with its kind and source; the run's own lengths in place of the assumed ones."""
    used = ["node.gpus", "node.cpus", "node.matmul_tflops", "node.gpu_hour_price", "node.store_write_gb_s",
            "node.store_read_gb_s", "node.cache_read_gb_s", "node.cache_tb", ex.rate_name,
            "regenerate.answer_fill", "regenerate.prompt_tokens", "prepare.samples_per_s", "prepare.worker_efficiency",
            "prepare.parent_s_per_sample",
            "prepare.bytes_per_token", tr.rate_name, "train.multi_gpu_efficiency", "storage.gb_month_price",
            "engine.start_fixed_s", "engine.start_s_per_gb", "orchestration.shard_s"]
    listed = [rates["rates"][k] for k in used] + list(shape.target.rates.values()) + [
        head_cost_rate(h, c, cfg.train, tr.rate_name) for h, c in zip(tr.heads, tr.costs)
        if h.kind != "eagle3" or c != 1.0]
    if lengths.prompt is not None:
        listed = [Rate(x.name, w.prompt, x.unit, "the run's stats", lengths.source)
                  if x.name == "regenerate.prompt_tokens" else x for x in listed]
    if lengths.answer is not None:
        listed = [Rate("regenerate.answer_tokens", w.answer, "tokens per sample, mean answer", "the run's stats",
                       lengths.source) if x.name == "regenerate.answer_fill" else x for x in listed]
    return listed


def _levers(cfg: RunConfig, rates: dict[str, Any], base: Plan, *, nodes: int, lengths: Lengths,
            shape: Shape) -> list[dict[str, Any]]:
    """The same plan with one thing changed at a time: what each lever is worth."""
    options: list[tuple[str, RunConfig, int]] = []
    if not rates.get("max_nodes") or nodes * 2 <= rates["max_nodes"]:
        options.append((f"--nodes {nodes * 2}", cfg, nodes * 2))
    if cfg.extract.storage_dtype == "bf16":
        options.append(("--set extract.storage_dtype=fp8", _override(cfg, "extract", storage_dtype="fp8"), nodes))
    half = cfg.data.max_samples // 2
    options.append((f"--set data.max_samples={half}", _override(cfg, "data", max_samples=half), nodes))
    if cfg.regenerate.enabled:
        mt = cfg.regenerate.max_tokens // 2
        options.append((f"--set regenerate.max_tokens={mt}", _override(cfg, "regenerate", max_tokens=mt), nodes))
    out = []
    for name, c, n in options:
        p = make_plan(c, rates, nodes=n, lengths=lengths, shape=shape, levers=False)
        d = {s.stage: s.wall_hours for s in p.stages}
        out.append({"lever": name, "wall_hours": p.totals["wall_hours"], "cost_held": p.totals["cost_held"],
                    "cost_per_stage": p.totals["cost_per_stage"], "kept": p.totals["kept"],
                    "dominant_hours": d.get(base.dominant, 0.0)})
    return out


# --------------------------------------------------------------------------- output

def _count(x: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def _bytes(x: float) -> str:
    if x <= 0:
        return "-"
    for unit, div in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= div:
            return f"{x / div:.3g} {unit}"
    return f"{x:.0f} B"


def render(plan: Plan, description: str = "") -> str:
    """Markdown: the stage table, what it rests on, the levers, and every rate with its source."""
    n, node_price = plan.nodes, plan.price * plan.gpus
    lines = [f"Plan for {plan.config} on {plan.machine}"
             + (f" ({description})" if description else "")
             + f": {n} node(s) of {plan.gpus} GPUs at ${plan.price:.2f} per GPU-hour (${node_price:.2f} per "
             "node-hour).", "",
             "| stage | nodes | tokens | written, bf16 | written, fp8 | kept | busy node-hours | wall-clock hours | "
             f"cost, {n} node(s) held | cost, rented per stage |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in plan.stages:
        lines.append(f"| {s.stage} | {s.nodes} | {_count(s.tokens)} {s.what} | {_bytes(s.bytes_bf16)} | "
                     f"{_bytes(s.bytes_fp8)} | {_bytes(s.kept)} | {s.node_hours:,.2f} | {s.wall_hours:,.2f} | "
                     f"${n * s.wall_hours * node_price:,.0f} | ${s.nodes * s.wall_hours * node_price:,.0f} |")
    tt = plan.totals
    lines.append(f"| **total** | | | {_bytes(tt['bytes_bf16'])} | {_bytes(tt['bytes_fp8'])} | {_bytes(tt['kept'])} | "
                 f"{tt['node_hours']:,.2f} | {tt['wall_hours']:,.2f} | **${tt['cost_held']:,.0f}** | "
                 f"**${tt['cost_per_stage']:,.0f}** |")
    lines += [""] + [f"- {note}" for note in plan.notes]
    if plan.levers:
        lines += ["", f"| lever, one at a time | wall-clock hours | of it {plan.dominant} | cost, held | "
                      "cost, rented per stage | kept |", "|---|---:|---:|---:|---:|---:|"]
        dom = next(s.wall_hours for s in plan.stages if s.stage == plan.dominant)
        rows = [{"lever": "this plan", "wall_hours": tt["wall_hours"], "dominant_hours": dom,
                 "cost_held": tt["cost_held"], "cost_per_stage": tt["cost_per_stage"], "kept": tt["kept"]}]
        for lv in rows + plan.levers:
            lines.append(f"| {lv['lever']} | {lv['wall_hours']:,.1f} | {lv['dominant_hours']:,.1f} | "
                         f"${lv['cost_held']:,.0f} | ${lv['cost_per_stage']:,.0f} | {_bytes(lv['kept'])} |")
    lines += ["", "| rate | value | unit | kind | source |", "|---|---:|---|---|---|"]
    for rate in plan.rates:
        value = _count(rate.value) if rate.value >= 1e6 else f"{rate.value:,.6g}"
        lines.append(f"| {rate.name} | {value} | {rate.unit} | {rate.kind} | {rate.source} |")
    return "\n".join(lines) + "\n"
