#!/usr/bin/env bash
# vLLM 0.26.0 on the lent GPU, through draftline's own code (issue 35, item 4). Run from the repo root on the
# device machine: `bash benchmarks/gpu_vllm.sh STEP...`, steps in this order over consecutive device calls:
#
#   chunk DIR    copy the carried chunk files of DIR into /tmp/acc (the machine keeps /tmp while warm; it goes
#                back ~30 s after a call, so the chunk calls follow each other at once)
#   install      join /tmp/acc/part.*, pip-install the wheels into /tmp/site (no deps, no index), unpack the
#                carried CPU draft into /tmp/gv/cpu-draft
#   extract      (a)+(f) benchmarks/bench_gpu.py: an 8B-shaped random-init target, its bare prefill with the
#                extraction hooks, extract_shard through the transformers backend and through vLLM (its
#                asynchronous hidden-states connector) on the same shard; engine start seconds
#   pipeline     (c)+(f) `draftline run benchmarks/gpu_vllm_demo.yaml`: the CPU demo's config on the GPU
#                (regeneration with CUDA graphs, extraction through vLLM, training on the GPU, the benchmark in
#                vLLM with CUDA graphs); beside its own head, the carried CPU-demo draft (benchmark.drafts; GV_CPU_DRAFT=0: not)
#   eager        (b) regeneration alone with engines.regenerate.enforce_eager (its own store), beside the
#                pipeline's CUDA-graph regeneration of the same prompts
#   serve        (d) `draftline export` of the pipeline's draft, `vllm serve` started with the printed line, one
#                chat request, the spec-decode counters from /metrics; the draft comes back as $OUT/gpu-draft.tgz
#                so the CPU machine measures the same draft on the same prompts (`draftline run configs/demo.yaml
#                --set 'benchmark.drafts=[{name: gpu, model: DIR/draft}]'`)
#   kimi         (e) a tiny random-init Kimi-K2.5-layout target (MLA, experts, the VLM wrapper) served by the
#                stand-in hub, fetched with `draftline weights`, its states extracted through vLLM
#   report       benchmarks/gpu_vllm.py report: every figure into $OUT/gpu_vllm.json and .md
#
# On the CPU machine, first: `bash benchmarks/gpu_vllm.sh carry` downloads the wheels of
# benchmarks/gpu_vllm_wheels.txt (GV_WHEELS, default ../gpu-wheels), cuts them into 60 MiB chunks, one per
# git-ignored folder .gpuc1 ... .gpucN, with the CPU demo's draft (`draftline export configs/demo.yaml`, after
# `make demo`) in the same stream. Then one device call per folder, back to back, each carrying its folder
# (carry=[".gpuc<i>"]): `bash benchmarks/gpu_vllm.sh chunk .gpuc<i>`, the last one `... chunk .gpucN install extract`.
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
draftline() { python3 -m flows.cli "$@"; }

for step in "$@"; do
  case $step in
  chunk) ;;  # its argument follows
  carry)  # on the CPU machine
    W=${GV_WHEELS:-../gpu-wheels}; mkdir -p "$W"
    P=(); for n in 17 24 27 28 31 34 35; do P+=(--platform manylinux_2_${n}_x86_64); done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${P[@]}" \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$W" \
      -r benchmarks/gpu_vllm_wheels.txt || exit 1
    grep -q '^/.gpuc\*/$' .git/info/exclude 2>/dev/null || echo '/.gpuc*/' >> .git/info/exclude
    rm -rf .gpuc* /tmp/gv-chunks /tmp/gv-draft && mkdir -p /tmp/gv-chunks /tmp/gv-draft
    # the CPU demo's draft (76 MB with its copy of the target's embedding) travels in the same stream
    env -u DRAFTLINE_HOME -u PREFECT_HOME PYTHONPATH=$PWD .venv/bin/draftline export configs/demo.yaml \
      /tmp/gv-draft/cpu-draft >/dev/null || echo "no CPU demo draft (run make demo first): carrying the wheels only"
    tar -cf - -C "$W" . -C /tmp/gv-draft . | split -b 60m - /tmp/gv-chunks/part.
    i=0; for f in /tmp/gv-chunks/part.*; do i=$((i+1)); mkdir -p .gpuc$i; mv "$f" .gpuc$i/; done
    du -sh .gpuc*; say "carry ready: $i chunk calls" ;;
  install)
    mkdir -p /tmp/gvw && cat /tmp/acc/part.* | tar -x -C /tmp/gvw || { say "chunks missing: start again"; exit 2; }
    [ -d /tmp/gvw/cpu-draft ] && rm -rf /tmp/gv/cpu-draft && mv /tmp/gvw/cpu-draft /tmp/gv/
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      /tmp/gvw/*.whl >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
    python3 -c "import vllm, torch, prefect, speculators; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'prefect', prefect.__version__, 'gpu', torch.cuda.get_device_name())" 2>&1 | tail -1
    say "installed" ;;
  extract)
    python3 benchmarks/bench_gpu.py --out /tmp/gv/extract --only matmul,extract --skip-small \
      --extract-backends transformers,vllm --stage-prompts-8b "${GV_PROMPTS:-48}" >"$OUT/extract.log" 2>&1
    say "extract rc=$?"; grep -E "tok/s|started|failed|Error" "$OUT/extract.log" | tail -12
    cp /tmp/gv/extract/bench_gpu.json /tmp/gv/bench_gpu.json 2>/dev/null ;;
  pipeline)
    SET=(); [ "${GV_CPU_DRAFT:-1}" = 1 ] && [ -d /tmp/gv/cpu-draft/draft ] && \
      SET=(--set "benchmark.drafts=[{name: cpu-demo, model: /tmp/gv/cpu-draft/draft}]")
    timeout "${GV_PIPELINE_S:-400}" python3 -m flows.cli run benchmarks/gpu_vllm_demo.yaml "${SET[@]}" --json \
      >/tmp/gv/pipeline.json 2>"$OUT/pipeline.log"
    say "pipeline rc=$?"; grep -E "ran in|Finished in state|Error|error" "$OUT/pipeline.log" | tail -14 ;;
  eager)
    timeout 200 python3 -m flows.cli run benchmarks/gpu_vllm_demo.yaml --until regenerate --json \
      --set store.uri=file:///tmp/gv/store-eager --set engines.regenerate.enforce_eager=true \
      >/tmp/gv/eager.json 2>"$OUT/eager.log"
    say "eager regeneration rc=$?" ;;
  serve)
    python3 benchmarks/gpu_vllm.py serve --config benchmarks/gpu_vllm_demo.yaml --dest /tmp/gv/my-draft \
      --out /tmp/gv/serve.json >"$OUT/serve.log" 2>&1
    say "serve rc=$?"; tail -5 "$OUT/serve.log"
    tar -czf "$OUT/gpu-draft.tgz" -C /tmp/gv my-draft 2>/dev/null; ls -la "$OUT/gpu-draft.tgz" ;;
  kimi)
    timeout 300 python3 benchmarks/gpu_vllm.py kimi --root /tmp/gv/kimi --out /tmp/gv/kimi.json >"$OUT/kimi.log" 2>&1
    say "kimi rc=$?"; tail -5 "$OUT/kimi.log" ;;
  report)
    python3 benchmarks/gpu_vllm.py report --dir /tmp/gv --out "$OUT/gpu_vllm.json" | tee "$OUT/gpu_vllm.md" | tail -40 ;;
  *)
    if [ "${prev:-}" = chunk ]; then mkdir -p /tmp/acc && cp "$step"/part.* /tmp/acc/ && say "chunk $(ls "$step")";
    else echo "unknown step $step"; exit 2; fi ;;
  esac
  prev=$step
done
