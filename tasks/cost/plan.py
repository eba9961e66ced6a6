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

`make_plan` is a plain function (config and rates in, numbers out); `render` prints the markdown that
docs/kimi-k2.5.md shows verbatim (tests/unit/cost/test_plan.py keeps them equal).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from tasks.core.config import CHECKOUT, RunConfig
from tasks.core.errors import DraftlineError

RATES_FILE = CHECKOUT / "configs" / "rates.yaml"
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two fp32 moments (tasks/train/checkpoints.py Checkpointer.write)
DEFAULT_MACHINE = "b300-node"
KINDS = ("measured", "cited", "assumption")
TARGET_RATES = ("decode_tok_s", "decode_tok_s_batch1")  # per target and machine
# per target: its active parameters, and the bytes of its weights (an engine start reads them: engine.start_s_per_gb)
TARGET_SIZES = ("active_params", "weights_gb")

# What the code does, as switches so a plan can show what each is worth (tests flip them): regeneration shards
# are dealt over the nodes like extraction's (flows/nodes.py run_nodes); False prices regeneration on one node.
REGENERATE_FANS_OUT = True
# Training reads its parts through the node-local part cache (tasks/store/part_cache.py), so epochs after the first
# read from the node's NVMe what the cache holds; False prices every epoch downloading every part again.
NODE_PART_CACHE = True


class PlanError(DraftlineError, ValueError):
    """A plan that cannot be made; the message says what to add or fix."""


@dataclass
class Rate:
    name: str
    value: float
    unit: str
    kind: str  # measured | cited | assumption | command line | the run's stats
    source: str


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


# --------------------------------------------------------------------------- rates

def _rate(name: str, raw: Any) -> Rate:
    if not isinstance(raw, dict) or not {"value", "unit", "kind", "source"} <= set(raw):
        raise PlanError(f"rate {name}: give value, unit, kind ({', '.join(KINDS)}) and source")
    if raw["kind"] not in KINDS:
        raise PlanError(f"rate {name}: kind must be one of {', '.join(KINDS)}, got {raw['kind']!r}")
    return Rate(name, float(raw["value"]), str(raw["unit"]), raw["kind"], " ".join(str(raw["source"]).split()))


def _section_rates(data: dict[str, Any], where: str) -> dict[str, Rate]:
    return {f"{sec}.{name}": _rate(f"{where}{sec}.{name}", raw)
            for sec, items in data.items() for name, raw in (items or {}).items()}


def read_rates_file(path: Path = RATES_FILE) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise PlanError(f"cannot read the rates file {path}: {exc}") from None
    if not data.get("machines"):
        raise PlanError(f"{path}: add `machines:` (at least {DEFAULT_MACHINE}: with its node rates)")
    return data


def machine_for(config_name: str | None, path: Path = RATES_FILE) -> str:
    """The machine a preset names in the rates file (`presets:`), else the B300 node."""
    for name, entry in read_rates_file(path)["machines"].items():
        if config_name and config_name in (entry.get("presets") or []):
            return name
    return DEFAULT_MACHINE


def all_rates(path: Path = RATES_FILE) -> list[Rate]:
    """Every rate the file holds, on every machine and for every target (for checking their sources)."""
    data = read_rates_file(path)
    out = list(_section_rates({k: v for k, v in data.items() if k not in ("machines", "targets")}, "").values())
    for m, entry in data["machines"].items():
        out += _section_rates({k: v for k, v in entry.items() if k not in ("description", "presets", "max_nodes")},
                              f"{m}: ").values()
    for model, entry in (data.get("targets") or {}).items():
        out += [_rate(f"{model}.{k}", v) for k, v in entry.items() if k not in ("config", "machines", "local_copies")]
        for m, items in (entry.get("machines") or {}).items():
            out += [_rate(f"{model} on {m}: target.{k}", v) for k, v in items.items()]
    return out


def load_rates(path: Path = RATES_FILE, overrides: list[str] | None = None,
               machine: str = DEFAULT_MACHINE) -> dict[str, Any]:
    """The rates of one machine as {"rates": {"node.gpus": Rate, ...}, "targets": {model: {...}}, "machine":
    name, "description": ..., "overrides": {...}}; `overrides` are `section.name=value` (target rates:
    `target.decode_tok_s=...`, applied to the config's target on this machine)."""
    data = read_rates_file(path)
    machines = data.pop("machines")
    targets = data.pop("targets", {}) or {}
    if machine not in machines:
        raise PlanError(f"--machine {machine!r} is not in {Path(path).name}; one of: {', '.join(machines)}")
    entry = dict(machines[machine])
    description = " ".join(str(entry.pop("description", machine)).split())
    entry.pop("presets", None)
    max_nodes = entry.pop("max_nodes", None)
    rates = _section_rates(data, "")
    rates.update(_section_rates(entry, ""))
    out = {"rates": rates, "targets": targets, "overrides": {}, "machine": machine, "description": description,
           "max_nodes": int(max_nodes) if max_nodes else None}
    target_names = [f"target.{n}" for n in (*TARGET_SIZES, *TARGET_RATES)]
    for item in overrides or []:
        key, _, value = item.partition("=")
        if key not in rates and key not in target_names:
            raise PlanError(f"--rate {key!r} is not a rate; one of: {', '.join(sorted(rates) + target_names)}")
        try:
            number = float(value)
        except ValueError:
            raise PlanError(f"--rate {item!r}: expected NAME=NUMBER, e.g. --rate node.gpu_hour_price=4.5") from None
        if key in rates:
            rates[key] = Rate(key, number, rates[key].unit, "command line", f"--rate {item}")
        else:
            out["overrides"][key.removeprefix("target.")] = number
    return out


@dataclass
class Target:
    hf_config: Any
    folder: str  # a folder holding its config.json (for speculators' layer config)
    rates: dict[str, Rate]
    experts: bool
    known_as: str = ""  # the rates file's target whose shape a local target.model has


SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")


def _same_shape(hf: Any, targets: dict[str, Any]) -> str:
    """The rates file's target with the decoder shape of `hf` (the same weights under another path, e.g. a
    workstation's /models/kimi-k2.5), or ""."""
    from transformers import AutoConfig

    from tasks.engine.target import text_config

    mine = [getattr(text_config(hf), k, None) for k in SHAPE_KEYS]
    for model, entry in targets.items():
        conf = dict(entry["config"])
        known = text_config(AutoConfig.for_model(conf.pop("model_type"), **conf))
        if [getattr(known, k, None) for k in SHAPE_KEYS] == mine:
            return model
    return ""


def _target_rate(model: str, entry: dict, name: str, overrides: dict[str, float], where: str) -> Rate:
    if name in overrides:
        return Rate(f"target.{name}", overrides[name], entry.get(name, {}).get("unit", ""), "command line",
                    f"--rate target.{name}={overrides[name]:g}")
    if name not in entry:
        raise PlanError(f"configs/rates.yaml: targets: {model}: {where}add {name} (value, unit, kind, source), "
                        f"or pass --rate target.{name}=...")
    return _rate(f"target.{name}", entry[name])


def load_target(cfg: RunConfig, rates: dict[str, Any], tmp: Path) -> Target:
    """The target's config from the rates file's `targets` entry (no weights needed), else from target.model;
    its rates on the plan's machine from the entry's `machines:`."""
    from transformers import AutoConfig

    from tasks.engine.target import TargetError, load_hf_config, max_model_len_problem, text_config

    model = cfg.target.model
    entry = rates["targets"].get(model)
    known_as = ""
    if entry is None and not Path(model).exists():  # a preset's copy on its own machine, planned elsewhere
        known_as = next((name for name, e in rates["targets"].items() if model in (e.get("local_copies") or [])), "")
        entry = rates["targets"].get(known_as)
    # a rates entry's config is a stand-in: its context length is only known when it states one
    stated = entry is None or "max_position_embeddings" in entry.get("config", {})
    if entry is not None:
        conf = dict(entry["config"])
        hf = AutoConfig.for_model(conf.pop("model_type"), **conf)
    else:
        try:
            hf = load_hf_config(cfg.target)
        except (TargetError, OSError, ValueError) as exc:
            raise PlanError(f"target.model {model!r}: cannot read its config ({str(exc).splitlines()[0][:160]}); "
                            f"add it under `targets:` in {RATES_FILE.relative_to(CHECKOUT)} (its config.json fields, "
                            f"active_params, and per machine {', '.join(TARGET_RATES)})") from None
        known_as = _same_shape(hf, rates["targets"])
        entry = rates["targets"][known_as] if known_as else {}
    hf.save_pretrained(tmp)
    tc = text_config(hf)
    too_long = max_model_len_problem(cfg.target, tc) if stated else None
    if too_long:
        raise PlanError(too_long)
    machine = rates.get("machine", DEFAULT_MACHINE)
    on_machine = (entry.get("machines") or {}).get(machine, {})
    out = {"active_params": _target_rate(known_as or model, entry, "active_params", rates["overrides"], "")}
    out.update({n: _target_rate(known_as or model, on_machine, n, rates["overrides"], f"machines: {machine}: ")
                for n in TARGET_RATES})
    local = Path(model).expanduser()
    if "weights_gb" in entry or "weights_gb" in rates["overrides"]:
        out["weights_gb"] = _target_rate(known_as or model, entry, "weights_gb", rates["overrides"], "")
    elif local.is_dir():  # the folder itself says how many bytes an engine start reads
        size = sum(f.stat().st_size for f in local.glob("*.safetensors"))
        out["weights_gb"] = Rate("target.weights_gb", size / 1e9, "GB of weights (*.safetensors)", "measured",
                                 f"the sizes of the *.safetensors files in {local}")
    return Target(hf, str(tmp), out,
                  experts=bool(getattr(tc, "n_routed_experts", None) or getattr(tc, "num_local_experts", None)),
                  known_as=known_as)


# --------------------------------------------------------------------------- the draft's size

def draft_model(cfg: RunConfig, target: Target, layer_ids: list[int]):
    """The Eagle3DraftModel this config trains, on the meta device (shapes only), built from the same
    layer config as tasks.train.model.build_draft_model."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from tasks.engine.target import text_config
    from tasks.train.model import draft_layer_config

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


# --------------------------------------------------------------------------- the run's own lengths

@dataclass
class Lengths:
    """Mean prompt and answer tokens per sample (and the sample count) that a run's stages recorded."""
    samples: Optional[int] = None
    prompt: Optional[float] = None
    answer: Optional[float] = None  # per sample, the target's (regenerate) or the data's
    source: str = ""
    longest: Optional[int] = None  # the longest sample, and samples per context-length bucket (prepare's stats)
    buckets: Optional[dict] = None


def run_lengths(cfg: RunConfig) -> Lengths:
    """Read this config's prepare artifact and its regenerate artifact (or the regenerate shards committed so
    far) on cfg.store; what is not there stays None, and `source` says what was found."""
    from tasks.address import digests
    from tasks.store.artifacts import Store, StoreError

    from tasks.address.data import DataIdentityError

    try:
        store = Store.from_config(cfg.store)
        # the manifests' stats only: their files are not asked for their sizes (a hero's prepare has 512)
        prep = store.manifests("prepare", [digest := digests.prepare(cfg)], skip_unsafe=True)[digest]
    except DataIdentityError as exc:  # the data's content cannot be named here (offline, no record of a commit)
        return Lengths(source=f"this config's data has no address here ({str(exc)[:160]})")
    except Exception as exc:  # noqa: BLE001 - any store or credential failure: say it and plan on assumptions
        return Lengths(source=f"the store {cfg.store.uri} could not be read ({str(exc).splitlines()[0][:120]})")
    if prep is None:
        return Lengths(source=f"no prepare artifact of this config on {store.uri} yet")
    s = prep.stats
    samples = int(s.get("samples") or 0)
    if not samples:
        return Lengths(source=f"the prepare artifact {prep.digest[:12]} records no samples")
    out = Lengths(samples=samples, source=f"prepare {prep.digest[:12]} ({samples:,} samples)",
                  longest=s.get("longest"), buckets=s.get("length_buckets"))
    if not cfg.regenerate.enabled:
        out.prompt = (s["tokens"] - s["masked_tokens"]) / samples
        out.answer = s["masked_tokens"] / samples
        return out
    out.prompt = (s["tokens"] - s["masked_tokens"]) / samples  # the data's answers are replaced
    reg_digest = digests.regenerate(cfg, prep)
    try:
        reg = store.manifests("regenerate", [reg_digest], skip_unsafe=True)[reg_digest]
        # else the shards committed so far: their manifests' stats, read at once (a hero run has 512)
        arts = [reg] if reg is not None else [m for m in store.manifests(digests.REGENERATE_SHARD, [
            digests.regenerate_shard(reg_digest, i) for i in range(int(s.get("num_shards") or cfg.data.num_shards))
        ], skip_unsafe=True).values() if m is not None]
    except StoreError as exc:
        out.source += f"; regenerate shards unreadable ({str(exc).splitlines()[0][:120]})"
        return out
    regen = [a.stats for a in arts if a.stats.get("samples")]
    if regen:
        n = sum(int(r["samples"]) for r in regen)
        tokens = sum(int(r["tokens"]) for r in regen)
        gen = sum(int(r.get("generated_tokens", 0)) for r in regen)
        out.answer = gen / n
        out.prompt = (tokens - gen) / n
        if all(r.get("longest") for r in regen):  # the regenerated answers' lengths replace the data's
            from tasks.formats.acceptance import merge_counts

            out.longest = max(int(r["longest"]) for r in regen)
            out.buckets = merge_counts(*(r.get("length_buckets") for r in regen))
        what = "regenerate" if reg is not None else f"{len(regen)} regenerate shard(s)"
        out.source += f", {what} ({n:,} samples)"
    else:
        out.source += "; nothing regenerated yet"
    return out


# --------------------------------------------------------------------------- the plan

@dataclass
class Shape:
    """The target's and the draft's sizes, which no lever of the plan changes."""
    target: Target
    hidden: int
    n_layers: int
    train_flops: float
    trainable: int
    flops_fixed: float = 0.0  # of train_flops: the fc and the verifier head, once per token
    flops_per_pass: float = 0.0  # of train_flops: the decoder layers and the draft head, per pass (TTT step)

    def head_cost(self, head: Any, train: Any) -> float:
        """A head kind's training FLOPs per token over the EAGLE-3 draft's (`train_flops`): one factor per
        head, from its passes per token (tasks.train.model.passes_per_token: eagle3, eagle3.1 and eagle3-mla
        train.ttt_steps, 1.0; dflash and dspark block_size x max_anchors / batch_tokens) with the same layers.
        Computed, not measured: DSpark's Markov and confidence heads, the MLA layer's own width and attention
        scores are left out; measured rates per kind replace it once a GPU run has them."""
        from tasks.train.model import passes_per_token

        passes = passes_per_token(head, train)
        if passes == train.ttt_steps or not self.flops_per_pass:
            return 1.0
        return (self.flops_fixed + passes * self.flops_per_pass) / self.train_flops


def head_cost_rate(head: Any, cost: float, train: Any, mfu_rate: str) -> Rate:
    """A head kind's training cost over the EAGLE-3 draft's (Shape.head_cost), named as the assumption it is:
    computed from FLOPs per token at the EAGLE-3 draft's MFU, never measured per kind on a GPU."""
    from tasks.train.model import passes_per_token

    left_out = {"dspark": "; DSpark's Markov and confidence heads left out",
                "eagle3-mla": "; the MLA layer's own projections and attention scores left out",
                "eagle3.1": "; its per-layer fc norms left out"}.get(head.kind, "")
    return Rate(f"train.head_cost.{head.label}", cost, "x the EAGLE-3 draft's training FLOPs per token",
                "assumption", f"computed (Shape.head_cost): {passes_per_token(head, train):g} decoder passes per "
                f"token against EAGLE-3's {train.ttt_steps}, at the EAGLE-3 draft's MFU ({mfu_rate}); {head.kind} "
                f"not measured on a GPU{left_out}")


def make_shape(cfg: RunConfig, rates: dict[str, Any]) -> Shape:
    from tasks.engine.target import configured_layer_ids, text_config
    from tasks.train.model import flops_per_token

    with tempfile.TemporaryDirectory() as tmp:
        target = load_target(cfg, rates, Path(tmp))
        tc = text_config(target.hf_config)
        layer_ids = configured_layer_ids(cfg, int(tc.num_hidden_layers))
        draft = draft_model(cfg, target, layer_ids)
        fixed = flops_per_token(draft, 0)
        return Shape(target, int(tc.hidden_size), len(layer_ids), flops_per_token(draft, cfg.train.ttt_steps),
                     trainable_params(draft), fixed, flops_per_token(draft, 1) - fixed)


def _override(cfg: RunConfig, section: str, **values: Any) -> RunConfig:
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=values)})


def make_plan(cfg: RunConfig, rates: dict[str, Any], *, nodes: int = 1, config_name: str = "",
              lengths: Lengths | None = None, shape: Shape | None = None, levers: bool = True) -> Plan:
    if nodes < 1:
        raise PlanError(f"--nodes must be 1 or more, got {nodes}")
    if rates.get("max_nodes") and nodes > rates["max_nodes"]:
        raise PlanError(f"--nodes {nodes}: the machine {rates['machine']} is {rates['max_nodes']} node(s); plan the "
                        f"rest of the run on the pool with --machine {DEFAULT_MACHINE}")
    if not cfg.data.max_samples:
        raise PlanError("data.max_samples is not set: a plan needs the number of samples (set it, or "
                        "--set data.max_samples=N)")
    shape = shape or make_shape(cfg, rates)
    # a head this target cannot train is refused as `draftline run` refuses it (the train stage's own check);
    # tasks.train.model imports torch, which a plan made on a laptop needs only here
    from tasks.engine.target import text_config
    from tasks.train.model import head_target_problem

    text = text_config(shape.target.hf_config)
    problems = [p for p in (head_target_problem(h, text, cfg.target.model) for h in cfg.train.heads) if p]
    if problems:
        raise PlanError("\n".join(problems))
    lengths = lengths or Lengths()
    r = {k: v.value for k, v in rates["rates"].items()}
    target = shape.target
    t = {k: v.value for k, v in target.rates.items()}
    gpus, price = int(r["node.gpus"]), r["node.gpu_hour_price"]
    peak = r["node.matmul_tflops"] * 1e12
    hidden, n_layers = shape.hidden, shape.n_layers
    samples = min(cfg.data.max_samples, lengths.samples or cfg.data.max_samples)

    # tokens per sample: the prompt plus the answer (the target's, or the data's), within max_length
    prompt = lengths.prompt if lengths.prompt is not None else r["regenerate.prompt_tokens"]
    room = cfg.regenerate.max_tokens if cfg.regenerate.enabled else max(cfg.data.max_length - prompt, 0)
    answer = (min(lengths.answer, room) if lengths.answer is not None else r["regenerate.answer_fill"] * room)
    per_sample = min(cfg.data.max_length, prompt + answer)
    answer = per_sample - prompt
    tokens = samples * per_sample
    if "weights_gb" not in t:
        raise PlanError(f"configs/rates.yaml: targets: {target.known_as or cfg.target.model}: add weights_gb (value, "
                        "unit, kind, source), or pass --rate target.weights_gb=...: an engine start is priced by the "
                        "bytes it loads")
    # one vLLM engine start: a fixed part (compile, CUDA graphs, KV cache) plus the bytes each GPU of the engine
    # loads (its 1 / tensor_parallel_size share of the weights) at engine.start_s_per_gb
    tp = cfg.extract.tensor_parallel_size
    start_h = (r["engine.start_fixed_s"] + t["weights_gb"] / tp * r["engine.start_s_per_gb"]) / 3600
    stages: list[Stage] = []

    def add(stage: str, n: int, n_tokens: float, what: str, b16: float, b8: float, kept: float, hours: float,
            wall: float) -> None:
        stages.append(Stage(stage, n, n_tokens, what, b16, b8, kept, hours, wall))

    pq = r["prepare.bytes_per_token"]
    prep_h = samples / r["prepare.samples_per_s"] / 3600
    prep_tokens = samples * (prompt if cfg.regenerate.enabled else per_sample)
    add("prepare", 1, prep_tokens, "prompt" if cfg.regenerate.enabled else "sample", prep_tokens * pq,
        prep_tokens * pq, prep_tokens * pq, prep_h, prep_h)
    regen_nodes = nodes if REGENERATE_FANS_OUT else 1
    if cfg.regenerate.enabled:
        gen = samples * answer
        busy = regen_nodes * start_h + gen / t["decode_tok_s"] / 3600
        wall = start_h + gen / (regen_nodes * t["decode_tok_s"]) / 3600
        stored = 2 * tokens * pq  # the shard artifacts, and the stage's artifact that copies them
        add("regenerate", regen_nodes, gen, "generated", stored, stored, stored, busy, wall)
    add("vocab", 1, tokens, "counted", 0.0, 0.0, 0.0, 0.0, 0.0)

    bpt = {d: hidden_bytes_per_token(n_layers, hidden, d) for d in ("bf16", "fp8")}
    extract_rate_name = "extract.mfu_moe" if target.experts else "extract.mfu_dense"
    mfu = r[extract_rate_name]
    compute_rate = gpus * peak * mfu / (2 * t["active_params"])
    store_rate = {d: r["node.store_write_gb_s"] * 1e9 / bpt[d] for d in bpt}
    rate = {d: min(compute_rate, store_rate[d]) for d in bpt}
    dtype = cfg.extract.storage_dtype
    ext_h = tokens / rate[dtype] / 3600
    add("extract", nodes, tokens, "prefilled", tokens * bpt["bf16"], tokens * bpt["fp8"], tokens * bpt[dtype],
        nodes * start_h + ext_h, start_h + ext_h / nodes)

    # training: train.nodes nodes (torch's elastic launcher over each one's GPUs, one rendezvous; batch_tokens
    # per rank), as fast as the slower of their compute and their reads (each node reads its ranks' share)
    tnodes = int(getattr(cfg.train, "nodes", 1) or 1)
    ranks = (cfg.train.gpus or gpus) * tnodes
    heads = cfg.train.heads
    head_steps = [h.max_steps or cfg.train.max_steps for h in heads]  # one train task per head, one after another
    steps = sum(head_steps)
    train_tokens = steps * cfg.train.batch_tokens * ranks
    # auto is flex_attention on a GPU where it compiles (tasks.train.model.resolve_attn_impl)
    train_rate_name = ("train.mfu_flex_attention" if cfg.train.attn_impl in ("auto", "flex_attention")
                       else "train.mfu_sdpa")
    mfu_t = r[train_rate_name]
    per_gpu = peak * mfu_t / shape.train_flops
    node_rate = per_gpu * ranks * (r["train.multi_gpu_efficiency"] if ranks > 1 else 1.0)  # all nodes together
    costs = [shape.head_cost(h, cfg.train) for h in heads]  # each head's FLOPs per token over the EAGLE-3 draft's
    head_compute = [s * f * cfg.train.batch_tokens * ranks / node_rate / 3600 for s, f in zip(head_steps, costs)]
    compute_h = sum(head_compute)
    data_bytes = tokens * bpt[dtype]
    cache_bytes = r["node.cache_tb"] * 1e12
    hit = min(1.0, cache_bytes / data_bytes) if NODE_PART_CACHE and data_bytes else 0.0
    first = min(train_tokens, tokens)  # the first epoch comes from the store
    from_cache = (train_tokens - first) * hit
    from_store = train_tokens - from_cache
    read_rate = {"store": r["node.store_read_gb_s"] * 1e9 / bpt[dtype],
                 "node cache": r["node.cache_read_gb_s"] * 1e9 / bpt[dtype]}
    read_h = {"store": from_store / read_rate["store"] / tnodes / 3600,
              "node cache": from_cache / read_rate["node cache"] / tnodes / 3600}
    # the heads train one after another, each as fast as the slower of its compute and its reads (its steps' share)
    head_read = [sum(read_h.values()) * st / steps for st in head_steps]
    head_h = [max(c, rd) for c, rd in zip(head_compute, head_read)]
    train_h = sum(head_h)
    binding = "compute" if compute_h >= sum(read_h.values()) else max(read_h, key=read_h.get) + " read"
    ckpt_size = shape.trainable * CHECKPOINT_BYTES_PER_PARAM
    keep = int(getattr(cfg.train, "keep_checkpoints", 0) or 0) or None  # read defensively: older configs lack it
    written = sum(s // cfg.train.checkpoint_every for s in head_steps) * ckpt_size
    kept = sum(min(s // cfg.train.checkpoint_every, keep or s) for s in head_steps) * ckpt_size
    add("train", tnodes, train_tokens, "trained", written, written, kept, tnodes * train_h, train_h)

    if cfg.benchmark.enabled:
        # the engines tasks/benchmark/stage.py starts: the baseline, one per head (and benchmark.drafts) and k, and
        # the offline replay's hidden-state engine
        decoding = 1 + (len(heads) + len(cfg.benchmark.drafts)) * len(cfg.benchmark.num_speculative_tokens)
        engines = decoding + int(cfg.benchmark.offline_replay and cfg.benchmark.temperature == 0)
        per_bs = sum(e.num_prompts for e in cfg.benchmark.evals) * cfg.benchmark.max_tokens * decoding
        single = per_bs if 1 in cfg.benchmark.batch_sizes else 0
        batched = per_bs * len([b for b in cfg.benchmark.batch_sizes if b > 1])
        bench_h = engines * start_h + (single / t["decode_tok_s_batch1"] + batched / t["decode_tok_s"]) / 3600
        add("benchmark", 1, single + batched, "generated", 0.0, 0.0, 0.0, bench_h, bench_h)

    node_price = gpus * price
    wall = sum(s.wall_hours for s in stages)
    gb_month = r["storage.gb_month_price"]
    kept_bytes = sum(s.kept for s in stages)
    totals = {"bytes_bf16": sum(s.bytes_bf16 for s in stages), "bytes_fp8": sum(s.bytes_fp8 for s in stages),
              "kept": kept_bytes, "node_hours": sum(s.node_hours for s in stages), "wall_hours": wall,
              "cost_held": nodes * wall * node_price,
              "cost_per_stage": sum(s.nodes * s.wall_hours for s in stages) * node_price,
              "cost_busy": sum(s.node_hours for s in stages) * node_price,
              "storage_month": kept_bytes / 1e9 * gb_month,
              "train_read_bytes": train_tokens * bpt[dtype], "train_compute_hours": compute_h,
              "train_read_hours": sum(read_h.values())}
    totals["cost"] = min(totals["cost_held"], totals["cost_per_stage"])
    top = max(stages, key=lambda s: s.wall_hours)
    dominant = top.stage

    other = "fp8" if dtype == "bf16" else "bf16"
    bound = "store" if store_rate[dtype] < compute_rate else "compute"
    assumed = "assumed (configs/rates.yaml regenerate.prompt_tokens, regenerate.answer_fill)"
    if lengths.prompt is None and lengths.answer is None:
        len_src = assumed + (f"; {lengths.source}" if lengths.source else "")
    elif lengths.answer is None:
        len_src = f"prompt from the run's {lengths.source}; answer assumed (regenerate.answer_fill)"
    else:
        len_src = f"from the run's {lengths.source}"
    fanned = [s.stage for s in stages if s.nodes > 1]
    notes = [
        f"Workload: {samples:,} samples x {per_sample:,.0f} tokens ({prompt:,.0f} prompt + {answer:,.0f} answer"
        f"{'' if cfg.regenerate.enabled else ' from the data'}) = {_count(tokens)} tokens; lengths: {len_src}. "
        f"Training reads {_count(train_tokens)} tokens = {train_tokens / tokens:.2f} epochs ({steps:,} steps x "
        f"{cfg.train.batch_tokens:,} tokens x {ranks} ranks"
        + (f"; {len(heads)} heads, each priced at its FLOPs per token over the EAGLE-3 draft below (Shape.head_cost: "
           + ", ".join(f"{h.label} {c:.2f}" for h, c in zip(heads, costs)) + ")" if len(heads) > 1 else "") + ").",
    ]
    notes += length_notes(cfg, lengths)
    if len(heads) > 1:  # each head's own train task: its steps, its FLOPs per token, its reads
        notes.append("Training per head (one train task each, one after another): " + "; ".join(
            f"{h.label} ({h.kind}) {st:,} steps x {c:.2f}: {hh:,.2f} h ({'compute' if hc >= hr else 'read'}-bound), "
            f"${tnodes * hh * gpus * price:,.0f}"
            for h, st, c, hc, hr, hh in zip(heads, head_steps, costs, head_compute, head_read, head_h)) + ".")
    if target.known_as and not Path(cfg.target.model).exists():
        notes.append(f"Target: {cfg.target.model} (not on this machine) is a local copy of {target.known_as} "
                     "(configs/rates.yaml local_copies): its shape and rates are used.")
    elif target.known_as:
        notes.append(f"Target: {cfg.target.model} has the shape of {target.known_as} ({', '.join(SHAPE_KEYS)}): "
                     f"its rates in configs/rates.yaml are used.")
    if cfg.regenerate.enabled:
        notes.append(
            f"Regeneration: {_count(t['decode_tok_s'])} output tok/s per node ({target.rates['decode_tok_s'].kind}), "
            f"dealt over {regen_nodes} node(s) like extraction's shards.")
    notes += [
        f"Extraction: {n_layers} layers x hidden {hidden:,} = {bpt['bf16']:,} bytes/token bf16, {bpt['fp8']:,} fp8; "
        f"compute {_count(compute_rate)} tok/s per node (2 x {_count(t['active_params'])} active params, MFU "
        f"{mfu:g}), store {_count(store_rate[dtype])} tok/s ({dtype}): {_count(rate[dtype])} tok/s, "
        f"{bound}-bound. With {other}: {_count(rate[other])} tok/s, "
        f"{tokens / rate[other] / 3600:,.1f} node-hours.",
        f"Training: the draft has {_count(shape.trainable)} trainable parameters, {shape.train_flops / 1e9:.2f} GFLOP "
        f"per token (tasks.train.model.flops_per_token, {cfg.train.ttt_steps} TTT steps): {_count(per_gpu)} tok/s "
        f"per GPU at MFU {mfu_t:g}, {_count(node_rate)} tok/s per node = {compute_h:,.2f} h of compute. It reads "
        f"{_bytes(totals['train_read_bytes'])} ({dtype}; {_bytes(data_bytes)} per epoch): "
        f"{_bytes(from_store * bpt[dtype])} from the store at {_count(read_rate['store'])} tok/s "
        f"({read_h['store']:,.2f} h), {_bytes(from_cache * bpt[dtype])} from the node cache at "
        f"{_count(read_rate['node cache'])} tok/s ({read_h['node cache']:,.2f} h; "
        + (f"it holds {hit:.0%} of an epoch, NODE_PART_CACHE in tasks/cost/plan.py" if NODE_PART_CACHE
           else "no node cache: NODE_PART_CACHE is off") + f"): **{binding}-bound**, {train_h:,.2f} h.",
        f"Engine starts: {start_h * 60:,.1f} min each ({r['engine.start_fixed_s']:g} s, engine.start_fixed_s, + "
        f"{t['weights_gb']:,.0f} GB of weights / {tp} GPU(s) x {r['engine.start_s_per_gb']:g} s per GB, "
        f"engine.start_s_per_gb)"
        + (f"; the benchmark starts {engines} (the baseline, {engines - 1 - int(engines > decoding)} with a draft: "
           f"k in {cfg.benchmark.num_speculative_tokens}"
           + (", and the offline replay's" if engines > decoding else "") + ")" if cfg.benchmark.enabled else "")
        + ".",
        (f"Nodes: {', '.join(fanned)} dealt over {nodes} nodes (each node starts its own engine); "
         f"{', '.join(s.stage for s in stages if s.nodes == 1 and s.wall_hours > 0)} on one node." if fanned
         else "Nodes: every stage on one node."),
        f"Cost: {nodes} node(s) held for the {wall:,.1f} h wall-clock: **${totals['cost_held']:,.0f}**."
        + (f" Renting per stage instead ({nodes} nodes for {' and '.join(fanned)}, one node for the rest: "
           f"hand the other nodes back after extraction, draftline does not): **${totals['cost_per_stage']:,.0f}**, "
           f"${totals['cost_held'] - totals['cost_per_stage']:,.0f} less."
           if totals["cost_per_stage"] < totals["cost_held"] - 0.5 else ""),
        f"Store: {_bytes(totals['bytes_bf16'] if dtype == 'bf16' else totals['bytes_fp8'])} written, "
        f"{_bytes(kept_bytes)} kept (train: {_bytes(written)} of checkpoints written, {_bytes(kept)} kept with "
        f"keep_checkpoints {keep if keep else 'unset: all'}) = **${totals['storage_month']:,.0f} per month** at "
        f"${gb_month:g} per GB-month.",
        f"Dominant stage: **{dominant}**, {top.wall_hours:,.1f} of {wall:,.1f} wall-clock hours "
        f"({top.wall_hours / wall:.0%}).",
    ]
    used = ["node.gpus", "node.matmul_tflops", "node.gpu_hour_price", "node.store_write_gb_s",
            "node.store_read_gb_s", "node.cache_read_gb_s", "node.cache_tb", extract_rate_name,
            "regenerate.answer_fill", "regenerate.prompt_tokens", "prepare.samples_per_s",
            "prepare.bytes_per_token", train_rate_name, "train.multi_gpu_efficiency", "storage.gb_month_price",
            "engine.start_fixed_s", "engine.start_s_per_gb"]
    listed = [rates["rates"][k] for k in used] + list(target.rates.values()) + [
        head_cost_rate(h, c, cfg.train, train_rate_name) for h, c in zip(heads, costs) if h.kind != "eagle3"]
    if lengths.prompt is not None:
        listed = [Rate(x.name, prompt, x.unit, "the run's stats", lengths.source)
                  if x.name == "regenerate.prompt_tokens" else x for x in listed]
    if lengths.answer is not None:
        listed = [Rate("regenerate.answer_tokens", answer, "tokens per sample, mean answer", "the run's stats",
                       lengths.source) if x.name == "regenerate.answer_fill" else x for x in listed]
    plan = Plan(config_name, rates.get("machine", DEFAULT_MACHINE), nodes, gpus, price, stages, notes, listed,
                totals, dominant)
    if levers:
        plan.levers = _levers(cfg, rates, plan, nodes=nodes, lengths=lengths, shape=shape)
    return plan


def length_notes(cfg: RunConfig, lengths: Lengths) -> list[str]:
    """A note when the target will serve contexts (target.max_model_len) longer than any training sample: the
    run's longest prepared sample with --from-store, else data.max_length. A sample reaches the served context
    at max_model_len - 1 tokens, the most the config check allows (extraction sends max_length + 1)."""
    from tasks.benchmark.results import LENGTH_FIX, length_gap

    train = {"longest": lengths.longest, "length_buckets": lengths.buckets, "max_length": cfg.data.max_length}
    gap = length_gap(train, cfg.target.max_model_len - 1, "Lengths: contexts served up to target.max_model_len")
    return [f"{gap}: a draft's acceptance falls at lengths it never trained on; {LENGTH_FIX}."] if gap else []


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
