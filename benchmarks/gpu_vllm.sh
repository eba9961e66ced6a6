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
#   shard        issue 47: extraction through vLLM on a production-sized shard with its store on a DISK folder,
#                beside the bare prefill and dd of the same bytes into the same folder (bench_gpu.py --only shard:
#                benchmarks/gpu_shard.py). GV_STORE (default /var/tmp/gv-shard; tmpfs is refused), GV_SHARD_PROMPTS
#                x 2,048 tokens (default 512: 34.4 GB of bf16 states, 256 parts of GV_PART_TOKENS=4096 tokens,
#                ~40 s of extraction after a ~150 s engine start), GV_SHARD_S (default 570). The step command:
#                  bash benchmarks/gpu_vllm.sh shard
#                (after `... chunk .gpucN install` from either list); shard.json, shard.md and shard.log land in $OUT.
#                A CPU smoke run of the same step (vLLM's CPU build, a tiny target; .venv's python3 first in PATH):
#                  PATH=$PWD/.venv/bin:$PATH GV_STORE=/var/tmp/gv-smoke GV_SHARD_PROMPTS=32 GV_PART_TOKENS=128 \
#                  GV_SHARD_ARGS="--shard-shape tiny --seq 128 --prompts 8" bash benchmarks/gpu_vllm.sh shard
#   pipeline     (c)+(f) `draftline run benchmarks/gpu_vllm_demo.yaml`: the CPU demo's config on the GPU
#                (regeneration with CUDA graphs, extraction through vLLM, training on the GPU, the benchmark in
#                vLLM with CUDA graphs). With the anchors' evals (five in all) it outgrew one call on an H200 (2026-12-06:
#                killed at its 540 s limit in the benchmark stage): run `bash benchmarks/gpu_vllm.sh pipeline` again in
#                the next call; it resumes from the store (the committed stages and engines are not run again)
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
#   report       benchmarks/gpu_vllm.py report: every figure into $OUT/gpu_vllm.json and .md
#   errors       every engine's log (kept: DRAFTLINE_KEEP_ENGINE_LOGS=1, not only the engines that died) scanned for
#                error and warning lines: counts per log and the lines into $OUT/engine-log-scan.txt; exits 3 when
#                an error line is found (run it after `report`)
#
# On the CPU machine, first: `bash benchmarks/gpu_vllm.sh carry` (from a checkout with its .venv: it builds the
# tiny Kimi-layout repository with it, and stops if it cannot) downloads the wheels of benchmarks/gpu_vllm_wheels.txt
# (GV_WHEELS, default ../gpu-wheels), cuts them with that repository into 60 MiB chunks, one per git-ignored folder
# .gpuc1 ... .gpucN, and prints N ("carry ready: N chunk calls"; N is also in .gpuc-count). Then one device call per
# folder, back to back, each carrying its folder (carry=[".gpuc<i>"]): `bash benchmarks/gpu_vllm.sh chunk .gpuc<i>`,
# the last one `... chunk .gpucN install extract`.
# With little device time: GV_LIST=benchmarks/gpu_vllm_core.txt GV_WHEELS=<another folder> carries vLLM and
# speculators alone (fewer chunks: carry prints how many), enough for `extract` and `shard` only.
# Every step that fails stops the script with a non-zero exit, naming the step and its log.
# Results land in $OUT (at most 8 files come back): gpu_vllm.json, gpu_vllm.md and the steps' logs.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu-vllm-out}
mkdir -p "$OUT" /tmp/gv
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
export PREFECT_HOME=/tmp/gv/prefect PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=180 \
  PREFECT_SERVER_ANALYTICS_ENABLED=false DRAFTLINE_HOME=${GV_HOME:-/tmp/gv/home}
export DRAFTLINE_KEEP_ENGINE_LOGS=1  # every engine's log is kept in $DRAFTLINE_HOME/engine-logs for `errors`
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
draftline() { python3 -m cli.app "$@"; }
where() {  # NAME FOLDER: the filesystem that takes the folder's bytes (tmpfs is RAM); a folder not made yet: its parent's
  local d=$2; while [ ! -e "$d" ]; do d=$(dirname "$d"); done
  echo "where: $1 = $2 on $(df -PT "$d" | awk 'NR==2 {print $2" ("$1", mounted at "$7", "int($5/1048576)" GiB free)"}')"
}
GV_STORE=${GV_STORE:-/var/tmp/gv-shard}
case " $* " in *" carry "*) ;; *)
  where "temp folder (TMPDIR)" "${TMPDIR:-/tmp}"; where "engines' hidden-state files" "${DRAFTLINE_ENGINE_TMP:-/dev/shm}"
  where "pipeline store (gpu_vllm_demo.yaml)" /tmp/gv/store; where "bench_gpu.py stores (extract)" /tmp/bench-gpu
  where "shard store (GV_STORE)" "$GV_STORE" ;;
esac

for step in "$@"; do
  case $step in
  chunk) ;;  # its argument follows
  carry)  # on the CPU machine
    [ -x .venv/bin/python ] || { echo "carry: no .venv/bin/python in $PWD: run it from a checkout with the CPU" \
      "environment (make venv); it builds the Kimi-layout repository with it"; exit 1; }
    W=${GV_WHEELS:-../gpu-wheels}; mkdir -p "$W"
    P=(); for n in 17 24 27 28 31 34 35; do P+=(--platform manylinux_2_${n}_x86_64); done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${P[@]}" \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$W" \
      -r "${GV_LIST:-benchmarks/gpu_vllm_wheels.txt}" || exit 1
    EXCL=$(git rev-parse --git-path info/exclude) && mkdir -p "$(dirname "$EXCL")" || exit 1  # a worktree's too
    grep -q '^/.gpuc\*/$' "$EXCL" 2>/dev/null || echo '/.gpuc*/' >> "$EXCL"
    rm -rf .gpuc* /tmp/gv-chunks /tmp/gv-extra && mkdir -p /tmp/gv-chunks /tmp/gv-extra
    # the tiny Kimi-layout repository, built here (the device image's transformers may lack Kimi-K2.5's classes)
    PYTHONPATH=$PWD .venv/bin/python benchmarks/gpu_vllm.py kimi --root /tmp/gv-extra/kimi --build-only \
      >/tmp/gv-kimi-build.log 2>&1 || { tail -20 /tmp/gv-kimi-build.log; echo "carry: the Kimi-layout repository" \
      "did not build (log: /tmp/gv-kimi-build.log)"; exit 1; }
    [ -d /tmp/gv-extra/kimi/repo ] || { echo "carry: no /tmp/gv-extra/kimi/repo after the build"; exit 1; }
    n_whl=$(ls "$W"/*.whl 2>/dev/null | wc -l); [ "$n_whl" -gt 0 ] || { echo "carry: no wheels in $W"; exit 1; }
    tar -cf - -C "$W" . -C /tmp/gv-extra . | split -b 60m - /tmp/gv-chunks/part. || exit 1
    i=0; for f in /tmp/gv-chunks/part.*; do i=$((i+1)); mkdir -p .gpuc$i; mv "$f" .gpuc$i/; done
    echo "$i" > .gpuc-count; grep -q '^/.gpuc-count$' "$EXCL" || echo '/.gpuc-count' >> "$EXCL"
    du -sh .gpuc*/; say "carry ready: $i chunk calls ($n_whl wheels and the Kimi-layout repository):" \
      "chunk .gpuc1 ... chunk .gpuc$i install" ;;
  install)
    mkdir -p /tmp/gvw && cat /tmp/acc/part.* | tar -x -C /tmp/gvw || { say "chunks missing: start again"; exit 2; }
    [ -d /tmp/gvw/kimi ] && rm -rf /tmp/gv/kimi && mv /tmp/gvw/kimi /tmp/gv/
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      /tmp/gvw/*.whl >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
    python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'gpu', torch.cuda.get_device_name())" 2>&1 | tail -1
    rc=$?; say "installed" ;;
  extract)
    timeout "${GV_EXTRACT_S:-480}" python3 benchmarks/bench_gpu.py --out /tmp/gv/extract --only matmul,extract --skip-small \
      --extract-backends "${GV_BACKENDS:-transformers,vllm}" --stage-prompts-8b "${GV_PROMPTS:-48}" >"$OUT/extract.log" 2>&1
    rc=$?; say "extract rc=$rc"; grep -E "tok/s|started|failed|Error" "$OUT/extract.log" | tail -12
    cp /tmp/gv/extract/bench_gpu.json "$OUT/" 2>/dev/null ;;
  shard)
    timeout "${GV_SHARD_S:-570}" python3 benchmarks/bench_gpu.py --out /tmp/gv/shard --only shard --store-dir "$GV_STORE" \
      --shard-prompts "${GV_SHARD_PROMPTS:-512}" --part-tokens "${GV_PART_TOKENS:-4096}" ${GV_SHARD_ARGS:-} >"$OUT/shard.log" 2>&1
    rc=$?; say "shard rc=$rc"; grep -E "is (disk|tmpfs)|shard:|failed|Error" "$OUT/shard.log" | tail -14
    cp /tmp/gv/shard/bench_gpu.json "$OUT/shard.json" 2>/dev/null; cp /tmp/gv/shard/bench_gpu.md "$OUT/shard.md" 2>/dev/null ;;
  pipeline)
    timeout "${GV_PIPELINE_S:-540}" python3 -m cli.app run benchmarks/gpu_vllm_demo.yaml --json ${GV_PIPELINE_SET:-} \
      >/tmp/gv/pipeline.json 2>"$OUT/pipeline.log"
    rc=$?; say "pipeline rc=$rc"; grep -E "ran in|Finished in state|Error|error" "$OUT/pipeline.log" | tail -14
    cp /tmp/gv/pipeline.json "$OUT/" 2>/dev/null ;;
  eager)
    timeout 200 python3 -m cli.app run benchmarks/gpu_vllm_demo.yaml --until regenerate --json \
      --set store.uri=file:///tmp/gv/store-eager --set engines.regenerate.enforce_eager=true \
      >/tmp/gv/eager.json 2>"$OUT/eager.log"
    rc=$?; say "eager regeneration rc=$rc" ;;
  serve)
    python3 benchmarks/gpu_vllm.py serve --config benchmarks/gpu_vllm_demo.yaml --dest /tmp/gv/my-draft \
      --out /tmp/gv/serve.json >"$OUT/serve.log" 2>&1
    rc=$?; say "serve rc=$rc"; tail -5 "$OUT/serve.log"
    [ $rc -eq 0 ] && { python3 benchmarks/gpu_vllm.py split-draft /tmp/gv/my-draft/draft "$OUT"; rc=$?; } ;;
  dspark)
    timeout "${GV_DSPARK_S:-420}" python3 benchmarks/gpu_vllm.py dspark --config benchmarks/gpu_vllm_demo.yaml \
      --out /tmp/gv/dspark.json --k "${GV_DSPARK_K:-3}" >"$OUT/dspark.log" 2>&1
    rc=$?; say "dspark rc=$rc"; grep -E "DSpark k=|reused|Error" "$OUT/dspark.log" | tail -8; cp /tmp/gv/dspark.json "$OUT/" 2>/dev/null ;;
  reference)
    K=${GV_KIND:-dflash}
    timeout "${GV_REF_S:-580}" python3 benchmarks/bench_equal_budget.py --config benchmarks/gpu_vllm_demo.yaml \
      --device cuda --by-steps --work /tmp/gv --name "$K-reference" --steps "${GV_REF_STEPS:-400}" \
      --set "train.heads=[{kind: $K, block_size: 8}]" --ks 7 --mtbench 8 --heldout 8 --batch 8 \
      >"$OUT/$K-reference.log" 2>&1
    rc=$?; say "reference $K rc=$rc"; grep -E "^ours|^theirs|AL |Error" "$OUT/$K-reference.log" | tail -10
    cp /tmp/gv/"$K-reference"/results.json "$OUT/$K-reference.json" 2>/dev/null
    cp /tmp/gv/"$K-reference"/table.md "$OUT/$K-reference.md" 2>/dev/null ;;
  kimi)
    REPO=(); [ -d /tmp/gv/kimi/repo ] && REPO=(--repo /tmp/gv/kimi/repo)
    timeout 300 python3 benchmarks/gpu_vllm.py kimi --root /tmp/gv/kimi "${REPO[@]}" --out /tmp/gv/kimi.json \
      >"$OUT/kimi.log" 2>&1
    rc=$?; say "kimi rc=$rc"; tail -5 "$OUT/kimi.log" ;;
  errors)  # every engine's log (they stay on the device machine, which goes back after the call)
    logs=$(ls "$DRAFTLINE_HOME"/engine-logs/*.log /tmp/gv/kimi/home/engine-logs/*.log \
      2>/dev/null); n_err=0
    { echo "engine logs scanned: $(echo "$logs" | grep -c .)"
      for f in $logs; do
        # an error line: ERROR/CRITICAL, or a traceback's lines outside a WARNING record (vLLM logs some at WARNING)
        e=$(grep -E "\b(ERROR|CRITICAL)\b|Traceback|(Error|Exception):" "$f" | grep -cvE "\bWARN(ING)?\b")
        w=$(grep -cE "\bWARN(ING)?\b" "$f")
        echo "== $f: $e error line(s), $w warning line(s)"; n_err=$((n_err + e))
        grep -E "\b(ERROR|CRITICAL|WARN(ING)?)\b|Traceback|(Error|Exception):" "$f" | grep -v '^\s*File ' | sort | uniq -c \
          | sort -rn | head -15
      done; echo "error lines in all: $n_err"; } >"$OUT/engine-log-scan.txt"
    n_err=$(awk '/^error lines in all:/ {print $5}' "$OUT/engine-log-scan.txt")
    grep -E "^engine logs|^== |^error lines" "$OUT/engine-log-scan.txt" | tail -12
    [ -n "$logs" ] || say "no engine log found (none started on this machine since it came up?)"
    rc=0; [ "${n_err:-0}" -eq 0 ] || rc=3 ;;
  report)
    python3 benchmarks/gpu_vllm.py report --dir /tmp/gv --out "$OUT/gpu_vllm.json" | tee "$OUT/gpu_vllm.md" | tail -40
    rc=$? ;;
  *)
    if [ "${prev:-}" = chunk ]; then mkdir -p /tmp/acc && cp "$step"/part.* /tmp/acc/ && say "chunk $(ls "$step")";
      rc=$?
    else echo "unknown step $step"; exit 2; fi ;;
  esac
  if [ "${rc:-0}" -ne 0 ]; then say "step $step FAILED (rc=$rc): the steps after it did not run; logs in $OUT"; exit "$rc"; fi
  rc=0; prev=$step
done
