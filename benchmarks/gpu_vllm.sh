#!/usr/bin/env bash
# vLLM 0.26.0 on the lent GPU, through draftline's own code (issue 35, item 4). Run from the repo root on the
# device machine: `bash benchmarks/gpu_vllm.sh STEP...`, steps in this order over consecutive device calls:
#
#   chunk DIR    copy the carried chunk files of DIR into /tmp/acc (the machine keeps /tmp while warm; it goes
#                back ~30 s after a call, so the chunk calls follow each other at once)
#   install      join /tmp/acc/part.*, pip-install the wheels into /tmp/site (no deps, no index); the tiny
#                Kimi-layout repository built on the CPU machine to /tmp/gv/kimi/repo
#   extract      (a)+(f) benchmarks/bench_gpu.py: an 8B-shaped random-init target, its bare prefill with the
#                extraction hooks, extract_shard through the transformers backend and through vLLM (its
#                asynchronous hidden-states connector) on the same shard; engine start seconds
#   pipeline     (c)+(f) `draftline run benchmarks/gpu_vllm_demo.yaml`: the CPU demo's config on the GPU
#                (regeneration with CUDA graphs, extraction through vLLM, training on the GPU, the benchmark in
#                vLLM with CUDA graphs)
#   eager        (b) regeneration alone with engines.regenerate.enforce_eager (its own store), beside the
#                pipeline's CUDA-graph regeneration of the same prompts
#   serve        (d) `draftline export` of the pipeline's draft, `vllm serve` started with the printed line, one
#                chat request, the spec-decode counters from /metrics; the draft comes back in files under 16 MB
#                (gpu_vllm.py split-draft: all but the target's embedding) so the CPU machine measures the same
#                draft on the same prompts: `python3 benchmarks/gpu_vllm.py join-draft OUT CPU_DRAFT DIR`, then
#                `draftline run configs/demo.yaml --set 'benchmark.drafts=[{name: gpu, model: DIR}]'`
#   dspark       the pipeline's DSpark draft (the store's train artifact of head kind dspark) in vLLM at k=3 through
#                draftline's benchmark stage (gpu_vllm.py dspark): acceptance per eval into /tmp/gv/dspark.json;
#                the engines the pipeline's benchmark committed (baseline, the head at k=3) are reused
#   reference    (issue 46, item 1) one block head (GV_KIND dflash or dspark, block 8) trained by draftline and by
#                speculators' own `speculators train` on the pipeline's stored states (/tmp/gv/store), the same
#                GV_REF_STEPS (400) steps of 2,048 tokens each, then both in vLLM at k 7 (block 8 less the anchor):
#                benchmarks/bench_equal_budget.py --by-steps; results.json and table.md into $OUT
#   kimi         (e) a tiny random-init Kimi-K2.5-layout target (MLA, experts, the VLM wrapper) served by the
#                stand-in hub, fetched with `draftline weights`, its states extracted through vLLM
#   errors       the engines' own error lines into $OUT/engine-errors.log (their logs do not outlive the machine)
#   report       benchmarks/gpu_vllm.py report: every figure into $OUT/gpu_vllm.json and .md
#
# On the CPU machine, first: `bash benchmarks/gpu_vllm.sh carry` downloads the wheels of
# benchmarks/gpu_vllm_wheels.txt (GV_WHEELS, default ../gpu-wheels), cuts them into 60 MiB chunks, one per
# git-ignored folder .gpuc1 ... .gpucN, with the tiny Kimi-layout repository (built here) in the same stream. Then one device call per folder, back to back, each carrying its folder
# (carry=[".gpuc<i>"]): `bash benchmarks/gpu_vllm.sh chunk .gpuc<i>`, the last one `... chunk .gpucN install extract`.
# With little device time: GV_LIST=benchmarks/gpu_vllm_core.txt GV_WHEELS=<another folder> carries vLLM alone
# (6 chunks), enough for `extract` only.
# Results land in $OUT (at most 8 files come back): gpu_vllm.json, gpu_vllm.md and the steps' logs.
set -u
OUT=${OUT:-/tmp/gpu-vllm-out}
mkdir -p "$OUT" /tmp/gv
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
export PREFECT_HOME=/tmp/gv/prefect PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=180 \
  PREFECT_SERVER_ANALYTICS_ENABLED=false DRAFTLINE_HOME=/tmp/gv/home
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
draftline() { python3 -m cli.app "$@"; }

for step in "$@"; do
  case $step in
  chunk) ;;  # its argument follows
  carry)  # on the CPU machine
    W=${GV_WHEELS:-../gpu-wheels}; mkdir -p "$W"
    P=(); for n in 17 24 27 28 31 34 35; do P+=(--platform manylinux_2_${n}_x86_64); done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${P[@]}" \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$W" \
      -r "${GV_LIST:-benchmarks/gpu_vllm_wheels.txt}" || exit 1
    grep -q '^/.gpuc\*/$' .git/info/exclude 2>/dev/null || echo '/.gpuc*/' >> .git/info/exclude
    rm -rf .gpuc* /tmp/gv-chunks /tmp/gv-extra && mkdir -p /tmp/gv-chunks /tmp/gv-extra
    # the tiny Kimi-layout repository, built here (the device image's transformers may lack Kimi-K2.5's classes)
    PYTHONPATH=$PWD .venv/bin/python benchmarks/gpu_vllm.py kimi --root /tmp/gv-extra/kimi --build-only >/dev/null 2>&1
    tar -cf - -C "$W" . -C /tmp/gv-extra . | split -b 60m - /tmp/gv-chunks/part.
    i=0; for f in /tmp/gv-chunks/part.*; do i=$((i+1)); mkdir -p .gpuc$i; mv "$f" .gpuc$i/; done
    du -sh .gpuc*; say "carry ready: $i chunk calls" ;;
  install)
    mkdir -p /tmp/gvw && cat /tmp/acc/part.* | tar -x -C /tmp/gvw || { say "chunks missing: start again"; exit 2; }
    [ -d /tmp/gvw/kimi ] && rm -rf /tmp/gv/kimi && mv /tmp/gvw/kimi /tmp/gv/
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      /tmp/gvw/*.whl >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
    python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'gpu', torch.cuda.get_device_name())" 2>&1 | tail -1
    say "installed" ;;
  extract)
    timeout "${GV_EXTRACT_S:-480}" python3 benchmarks/bench_gpu.py --out /tmp/gv/extract --only matmul,extract --skip-small \
      --extract-backends "${GV_BACKENDS:-transformers,vllm}" --stage-prompts-8b "${GV_PROMPTS:-48}" >"$OUT/extract.log" 2>&1
    say "extract rc=$?"; grep -E "tok/s|started|failed|Error" "$OUT/extract.log" | tail -12
    cp /tmp/gv/extract/bench_gpu.json "$OUT/" 2>/dev/null ;;
  pipeline)
    timeout "${GV_PIPELINE_S:-540}" python3 -m cli.app run benchmarks/gpu_vllm_demo.yaml --json ${GV_PIPELINE_SET:-} \
      >/tmp/gv/pipeline.json 2>"$OUT/pipeline.log"
    say "pipeline rc=$?"; grep -E "ran in|Finished in state|Error|error" "$OUT/pipeline.log" | tail -14
    cp /tmp/gv/pipeline.json "$OUT/" 2>/dev/null ;;
  eager)
    timeout 200 python3 -m cli.app run benchmarks/gpu_vllm_demo.yaml --until regenerate --json \
      --set store.uri=file:///tmp/gv/store-eager --set engines.regenerate.enforce_eager=true \
      >/tmp/gv/eager.json 2>"$OUT/eager.log"
    say "eager regeneration rc=$?" ;;
  serve)
    python3 benchmarks/gpu_vllm.py serve --config benchmarks/gpu_vllm_demo.yaml --dest /tmp/gv/my-draft \
      --out /tmp/gv/serve.json >"$OUT/serve.log" 2>&1
    say "serve rc=$?"; tail -5 "$OUT/serve.log"
    python3 benchmarks/gpu_vllm.py split-draft /tmp/gv/my-draft/draft "$OUT" ;;
  dspark)
    timeout "${GV_DSPARK_S:-420}" python3 benchmarks/gpu_vllm.py dspark --config benchmarks/gpu_vllm_demo.yaml \
      --out /tmp/gv/dspark.json --k "${GV_DSPARK_K:-3}" >"$OUT/dspark.log" 2>&1
    say "dspark rc=$?"; grep -E "DSpark k=|reused|Error" "$OUT/dspark.log" | tail -8; cp /tmp/gv/dspark.json "$OUT/" 2>/dev/null ;;
  reference)
    K=${GV_KIND:-dflash}
    timeout "${GV_REF_S:-580}" python3 benchmarks/bench_equal_budget.py --config benchmarks/gpu_vllm_demo.yaml \
      --device cuda --by-steps --work /tmp/gv --name "$K-reference" --steps "${GV_REF_STEPS:-400}" \
      --set "train.heads=[{kind: $K, block_size: 8}]" --ks 7 --mtbench 8 --heldout 8 --batch 8 \
      >"$OUT/$K-reference.log" 2>&1
    say "reference $K rc=$?"; grep -E "^ours|^theirs|AL |Error" "$OUT/$K-reference.log" | tail -10
    cp /tmp/gv/"$K-reference"/results.json "$OUT/$K-reference.json" 2>/dev/null
    cp /tmp/gv/"$K-reference"/table.md "$OUT/$K-reference.md" 2>/dev/null ;;
  kimi)
    REPO=(); [ -d /tmp/gv/kimi/repo ] && REPO=(--repo /tmp/gv/kimi/repo)
    timeout 300 python3 benchmarks/gpu_vllm.py kimi --root /tmp/gv/kimi "${REPO[@]}" --out /tmp/gv/kimi.json \
      >"$OUT/kimi.log" 2>&1
    say "kimi rc=$?"; tail -5 "$OUT/kimi.log" ;;
  errors)  # the engines' own error lines (their logs stay on the device machine, which goes back after the call)
    grep -hE "(Error|Exception)\b" /tmp/gv/home/engine-logs/*.log /tmp/gv/kimi/home/engine-logs/*.log 2>/dev/null \
      | grep -v '^\s*File ' | tail -80 >"$OUT/engine-errors.log"; tail -5 "$OUT/engine-errors.log" ;;
  report)
    python3 benchmarks/gpu_vllm.py report --dir /tmp/gv --out "$OUT/gpu_vllm.json" | tee "$OUT/gpu_vllm.md" | tail -40 ;;
  *)
    if [ "${prev:-}" = chunk ]; then mkdir -p /tmp/acc && cp "$step"/part.* /tmp/acc/ && say "chunk $(ls "$step")";
    else echo "unknown step $step"; exit 2; fi ;;
  esac
  prev=$step
done
