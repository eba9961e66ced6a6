"""`draftline plan CONFIG`: the tokens, store bytes, node-hours and money a run will take, before it starts.

Everything comes from two places: the config (samples, lengths, layer ids, regeneration tokens, steps, batch
sizes) and the rates in configs/rates.yaml, each of which names its source (a run in benchmarks/RESULTS.md,
or an assumption). Training FLOPs per token are `tasks.train_model.flops_per_token` of the draft this config
would train (speculators' Eagle3DraftModel, built on the meta device: no memory, no weights); extraction
FLOPs are 2 x the target's active parameters per token, the MFU convention of benchmarks/RESULTS.md.

`make_plan` is a plain function (config and rates in, numbers out); `render` prints the markdown that
docs/kimi-k2.5.md shows verbatim (tests/test_plan.py keeps them equal).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import typer
import yaml

from flows.console import ROOT, SetOpt, fail
from tasks.config import ConfigError, RunConfig, load_config

RATES_FILE = ROOT / "configs" / "rates.yaml"
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two fp32 moments (tasks/train_loop.py Trainer.save_checkpoint)


class PlanError(ValueError):
    """A plan that cannot be made; the message says what to add or fix."""


@dataclass
class Rate:
    name: str
    value: float
    unit: str
    kind: str  # measured | assumption | command line
    source: str


@dataclass
class Stage:
    stage: str
    tokens: float
    what: str  # what the tokens are
    bytes_bf16: float
    bytes_fp8: float
    node_hours: float
    wall_hours: float


@dataclass
class Plan:
    config: str
    nodes: int
    gpus: int
    price: float
    stages: list[Stage]
    notes: list[str]
    rates: list[Rate]
    totals: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------- rates

def _rate(name: str, raw: Any) -> Rate:
    if not isinstance(raw, dict) or not {"value", "unit", "kind", "source"} <= set(raw):
        raise PlanError(f"rate {name}: give value, unit, kind (measured or assumption) and source")
    if raw["kind"] not in ("measured", "assumption"):
        raise PlanError(f"rate {name}: kind must be measured or assumption, got {raw['kind']!r}")
    return Rate(name, float(raw["value"]), str(raw["unit"]), raw["kind"], " ".join(str(raw["source"]).split()))


def load_rates(path: Path = RATES_FILE, overrides: list[str] | None = None) -> dict[str, Any]:
    """The rates file as {"rates": {"node.gpus": Rate, ...}, "targets": {model: {...}}}; `overrides` are
    `section.name=value` (target rates: `target.decode_tok_s=...`, applied to the config's target)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise PlanError(f"cannot read the rates file {path}: {exc}") from None
    targets = data.pop("targets", {}) or {}
    rates = {f"{sec}.{name}": _rate(f"{sec}.{name}", raw) for sec, items in data.items() for name, raw in items.items()}
    out = {"rates": rates, "targets": targets, "overrides": {}}
    for item in overrides or []:
        key, _, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            raise PlanError(f"--rate {item!r}: expected NAME=NUMBER, e.g. --rate node.gpu_hour_price=4.5") from None
        if key in rates:
            rates[key] = Rate(key, number, rates[key].unit, "command line", f"--rate {item}")
        elif key.startswith("target."):
            out["overrides"][key.removeprefix("target.")] = number
        else:
            raise PlanError(f"--rate {key!r} is not a rate; one of: {', '.join(sorted(rates))}, "
                            "target.active_params, target.engine_start_minutes, target.decode_tok_s")
    return out


@dataclass
class Target:
    hf_config: Any
    folder: str  # a folder holding its config.json (for speculators' layer config)
    rates: dict[str, Rate]
    experts: bool


def _target_rate(model: str, entry: dict, name: str, overrides: dict[str, float]) -> Rate:
    if name in overrides:
        return Rate(f"target.{name}", overrides[name], entry.get(name, {}).get("unit", ""), "command line",
                    f"--rate target.{name}={overrides[name]:g}")
    if name not in entry:
        raise PlanError(f"configs/rates.yaml: targets: {model}: add {name} (value, unit, kind, source)")
    return _rate(f"target.{name}", entry[name])


def load_target(cfg: RunConfig, rates: dict[str, Any], tmp: Path) -> Target:
    """The target's config from the rates file's `targets` entry (no weights needed), else from target.model."""
    from transformers import AutoConfig

    from tasks.target import TargetError, load_hf_config, text_config

    model = cfg.target.model
    entry = rates["targets"].get(model)
    if entry is not None:
        conf = dict(entry["config"])
        hf = AutoConfig.for_model(conf.pop("model_type"), **conf)
    else:
        try:
            hf = load_hf_config(cfg.target)
        except (TargetError, OSError, ValueError) as exc:
            raise PlanError(f"target.model {model!r}: cannot read its config ({str(exc).splitlines()[0][:160]}); "
                            f"add it under `targets:` in {RATES_FILE.relative_to(ROOT)} (its config.json fields "
                            "and active_params, engine_start_minutes, decode_tok_s)") from None
        entry = {}
    hf.save_pretrained(tmp)
    tc = text_config(hf)
    names = ("active_params", "engine_start_minutes", "decode_tok_s")
    return Target(hf, str(tmp), {n: _target_rate(model, entry, n, rates["overrides"]) for n in names},
                  experts=bool(getattr(tc, "n_routed_experts", None) or getattr(tc, "num_local_experts", None)))


# --------------------------------------------------------------------------- the draft's size

def draft_model(cfg: RunConfig, target: Target, layer_ids: list[int]):
    """The Eagle3DraftModel this config trains, on the meta device (shapes only), built from the same
    layer config as tasks.train_model.build_draft_model."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from tasks.target import text_config
    from tasks.train_model import draft_layer_config

    layer_cfg = draft_layer_config(cfg.train, cfg.target.model_copy(update={"trust_remote_code": False}),
                                   target.folder, target.hf_config)
    vocab = min(cfg.vocab.draft_vocab_size, int(text_config(target.hf_config).vocab_size))
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_cfg, draft_vocab_size=vocab, norm_before_residual=True,
        norm_before_fc=True, norm_output=True, eagle_aux_hidden_state_layer_ids=list(layer_ids[:-1]),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=cfg.train.ttt_steps)],
            verifier=VerifierConfig(name_or_path=target.folder,
                                    architectures=list(target.hf_config.architectures or []))))
    with torch.device("meta"):
        return Eagle3DraftModel(config)


def trainable_params(model: Any) -> int:
    """What build_draft_model leaves trainable: all but the verifier's embeddings, heads and norm."""
    frozen = {id(p) for m in (model.embed_tokens, model.lm_head, model.verifier_lm_head, model.verifier_norm)
              for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in frozen)


def hidden_bytes_per_token(layers: int, hidden: int, dtype: str) -> int:
    """Stored bytes per token of an extract part (docs/ARTIFACTS.md): the hidden states of `layers` layers
    (bf16; or fp8 e4m3 plus one f32 scale per token and layer) + int32 token id + loss-mask byte.
    Measured on SmolLM2 (4 x 576): 4,613 bf16, 2,325 fp8 (benchmarks/RESULTS.md)."""
    states = layers * hidden * 2 if dtype == "bf16" else layers * hidden + layers * 4
    return states + 5


# --------------------------------------------------------------------------- the plan

def make_plan(cfg: RunConfig, rates: dict[str, Any], *, nodes: int = 1, config_name: str = "") -> Plan:
    from tasks.target import configured_layer_ids, text_config
    from tasks.train_model import flops_per_token

    if nodes < 1:
        raise PlanError(f"--nodes must be 1 or more, got {nodes}")
    if not cfg.data.max_samples:
        raise PlanError("data.max_samples is not set: a plan needs the number of samples (set it, or "
                        "--set data.max_samples=N)")
    r = {k: v.value for k, v in rates["rates"].items()}
    with tempfile.TemporaryDirectory() as tmp:
        target = load_target(cfg, rates, Path(tmp))
        tc = text_config(target.hf_config)
        layer_ids = configured_layer_ids(cfg, int(tc.num_hidden_layers))
        draft = draft_model(cfg, target, layer_ids)
        train_flops = flops_per_token(draft, cfg.train.ttt_steps)
        trainable = trainable_params(draft)
    t = {k: v.value for k, v in target.rates.items()}
    gpus, price = int(r["node.gpus"]), r["node.gpu_hour_price"]
    peak = r["node.matmul_tflops"] * 1e12
    hidden, n_layers = int(tc.hidden_size), len(layer_ids)
    samples = cfg.data.max_samples

    # tokens per sample: the prompt plus the answer (the target's, or the data's), within max_length
    prompt = r["regenerate.prompt_tokens"]
    room = cfg.regenerate.max_tokens if cfg.regenerate.enabled else max(cfg.data.max_length - prompt, 0)
    answer = r["regenerate.answer_fill"] * room
    per_sample = min(cfg.data.max_length, prompt + answer)
    answer = per_sample - prompt
    tokens = samples * per_sample
    start_h = t["engine_start_minutes"] / 60
    stages: list[Stage] = []

    def add(stage: str, n_tokens: float, what: str, b16: float, b8: float, hours: float, wall: float) -> None:
        stages.append(Stage(stage, n_tokens, what, b16, b8, hours, wall))

    pq = r["prepare.bytes_per_token"]
    prep_h = samples / r["prepare.samples_per_s"] / 3600
    prep_tokens = samples * (prompt if cfg.regenerate.enabled else per_sample)
    add("prepare", prep_tokens, "prompt" if cfg.regenerate.enabled else "sample", prep_tokens * pq,
        prep_tokens * pq, prep_h, prep_h)
    if cfg.regenerate.enabled:
        gen = samples * answer
        hours = start_h + gen / t["decode_tok_s"] / 3600  # one node: regeneration is not dealt out (yet)
        add("regenerate", gen, "generated", tokens * pq, tokens * pq, hours, hours)
    add("vocab", tokens, "counted", 0.0, 0.0, 0.0, 0.0)

    bpt = {d: hidden_bytes_per_token(n_layers, hidden, d) for d in ("bf16", "fp8")}
    extract_rate_name = "extract.mfu_moe" if target.experts else "extract.mfu_dense"
    mfu = r[extract_rate_name]
    compute_rate = gpus * peak * mfu / (2 * t["active_params"])
    store_rate = {d: r["node.store_write_gb_s"] * 1e9 / bpt[d] for d in bpt}
    rate = {d: min(compute_rate, store_rate[d]) for d in bpt}
    dtype = cfg.extract.storage_dtype
    ext_h = tokens / rate[dtype] / 3600
    add("extract", tokens, "prefilled", tokens * bpt["bf16"], tokens * bpt["fp8"], nodes * start_h + ext_h,
        start_h + ext_h / nodes)

    ranks = cfg.train.gpus or gpus
    heads = cfg.train.heads
    steps = sum(h.max_steps or cfg.train.max_steps for h in heads)  # one train task per head, one after another
    train_tokens = steps * cfg.train.batch_tokens * ranks
    # auto is flex_attention on a GPU where it compiles (tasks.train_model.resolve_attn_impl)
    train_rate_name = ("train.mfu_flex_attention" if cfg.train.attn_impl in ("auto", "flex_attention")
                       else "train.mfu_sdpa")
    mfu_t = r[train_rate_name]
    per_gpu = peak * mfu_t / train_flops
    node_rate = per_gpu * ranks * (r["train.multi_gpu_efficiency"] if ranks > 1 else 1.0)
    ckpt = (steps // cfg.train.checkpoint_every) * trainable * CHECKPOINT_BYTES_PER_PARAM
    train_h = train_tokens / node_rate / 3600
    add("train", train_tokens, "trained", ckpt, ckpt, train_h, train_h)

    if cfg.benchmark.enabled:
        engines = len(cfg.benchmark.num_speculative_tokens) + 1
        per_bs = sum(e.num_prompts for e in cfg.benchmark.evals) * cfg.benchmark.max_tokens * engines
        single = per_bs if 1 in cfg.benchmark.batch_sizes else 0
        batched = per_bs * len([b for b in cfg.benchmark.batch_sizes if b > 1])
        bench_h = engines * start_h + (single / r["benchmark.decode_tok_s_batch1"]
                                       + batched / t["decode_tok_s"]) / 3600
        add("benchmark", single + batched, "generated", 0.0, 0.0, bench_h, bench_h)

    node_hours = sum(s.node_hours for s in stages)
    totals = {"bytes_bf16": sum(s.bytes_bf16 for s in stages), "bytes_fp8": sum(s.bytes_fp8 for s in stages),
              "node_hours": node_hours, "wall_hours": sum(s.wall_hours for s in stages),
              "cost": node_hours * gpus * price}
    other = "fp8" if dtype == "bf16" else "bf16"
    bound = "store" if store_rate[dtype] < compute_rate else "compute"
    notes = [
        f"Workload: {samples:,} samples x {per_sample:,.0f} tokens ({prompt:,.0f} prompt + {answer:,.0f} answer"
        f"{'' if cfg.regenerate.enabled else ' from the data'}) = {_count(tokens)} tokens; training reads "
        f"{_count(train_tokens)} tokens = {train_tokens / tokens:.2f} epochs ({steps:,} steps x "
        f"{cfg.train.batch_tokens:,} tokens x {ranks} ranks"
        + (f"; {len(heads)} heads, each priced as the EAGLE-3 draft below" if len(heads) > 1 else "") + ").",
        f"Extraction: {n_layers} layers x hidden {hidden:,} = {bpt['bf16']:,} bytes/token bf16, {bpt['fp8']:,} fp8; "
        f"compute {_count(compute_rate)} tok/s per node (2 x {_count(t['active_params'])} active params, MFU "
        f"{mfu:g}), store {_count(store_rate[dtype])} tok/s ({dtype}): {_count(rate[dtype])} tok/s, "
        f"{bound}-bound. With {other}: {_count(rate[other])} tok/s, "
        f"{tokens / rate[other] / 3600:,.1f} node-hours.",
        f"Training: the draft has {_count(trainable)} trainable parameters, {train_flops / 1e9:.2f} GFLOP per token "
        f"(tasks.train_model.flops_per_token, {cfg.train.ttt_steps} TTT steps): {_count(per_gpu)} tok/s per GPU at MFU "
        f"{mfu_t:g}, {_count(node_rate)} tok/s per node; one node (torchrun over its GPUs).",
        f"Nodes: regeneration and extraction are dealt over {nodes} node(s) (extract.nodes: {nodes}; each node "
        "starts its own engines); training and the benchmark run on one node.",
    ]
    used = ["node.gpus", "node.matmul_tflops", "node.gpu_hour_price", "node.store_write_gb_s",
            extract_rate_name, "regenerate.answer_fill", "regenerate.prompt_tokens", "prepare.samples_per_s",
            "prepare.bytes_per_token", train_rate_name, "train.multi_gpu_efficiency",
            "benchmark.decode_tok_s_batch1"]
    listed = [rates["rates"][k] for k in used] + list(target.rates.values())
    return Plan(config_name, nodes, gpus, price, stages, notes, listed, totals)


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


def render(plan: Plan) -> str:
    """Markdown: the stage table, what it rests on, and every rate with its source."""
    n = plan.nodes
    lines = [f"Plan for {plan.config}: {n} node(s) of {plan.gpus} GPUs at ${plan.price:.2f} per GPU-hour "
             f"(${plan.price * plan.gpus:.2f} per node-hour).", "",
             f"| stage | tokens | store, bf16 | store, fp8 | node-hours | wall-clock hours on {n} node(s) | cost |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for s in plan.stages:
        cost = s.node_hours * plan.gpus * plan.price
        lines.append(f"| {s.stage} | {_count(s.tokens)} {s.what} | {_bytes(s.bytes_bf16)} | {_bytes(s.bytes_fp8)} | "
                     f"{s.node_hours:,.2f} | {s.wall_hours:,.2f} | ${cost:,.0f} |")
    tt = plan.totals
    lines.append(f"| **total** | | {_bytes(tt['bytes_bf16'])} | {_bytes(tt['bytes_fp8'])} | {tt['node_hours']:,.2f} | "
                 f"{tt['wall_hours']:,.2f} | **${tt['cost']:,.0f}** |")
    lines += [""] + [f"- {note}" for note in plan.notes]
    lines += ["", "| rate | value | unit | kind | source |", "|---|---:|---|---|---|"]
    for rate in plan.rates:
        value = _count(rate.value) if rate.value >= 1e6 else f"{rate.value:,.6g}"
        lines.append(f"| {rate.name} | {value} | {rate.unit} | {rate.kind} | {rate.source} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the command

def plan(config: Path = typer.Argument(..., help="YAML config, e.g. configs/kimi-k2.5-b300.yaml."),
         nodes: Optional[int] = typer.Option(None, "--nodes", "-n", help="Nodes the extraction is dealt over "
                                             "(default: the config's extract.nodes); as --set extract.nodes=N."),
         gpu_hour_price: Optional[float] = typer.Option(None, "--gpu-hour-price",
                                                        help="USD per GPU-hour (default: configs/rates.yaml)."),
         overrides: list[str] = SetOpt,
         rate: list[str] = typer.Option([], "--rate", help="Override a rate: --rate node.matmul_tflops=2000 "
                                                           "(repeatable; target.decode_tok_s=... for the target)."),
         as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON object.")):
    """Time, store bytes and cost of a run, per stage, from the config and configs/rates.yaml."""
    try:
        cfg = load_config(config, overrides)
        rates = load_rates(RATES_FILE, list(rate))
        if gpu_hour_price is not None:
            if gpu_hour_price <= 0:
                raise PlanError(f"--gpu-hour-price must be positive, got {gpu_hour_price:g}")
            rates["rates"]["node.gpu_hour_price"] = Rate("node.gpu_hour_price", gpu_hour_price, "USD per GPU-hour",
                                                         "command line", f"--gpu-hour-price {gpu_hour_price:g}")
        result = make_plan(cfg, rates, nodes=cfg.extract.nodes if nodes is None else nodes,
                           config_name=str(config))
    except (ConfigError, PlanError) as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print(render(result), end="")
