#!/usr/bin/env bash
# Turn a freshly rented NVL8 node (B300, H200, ...) into a worker of a draftline work pool.
#
#   export PREFECT_API_URL=https://prefect.example.com/api   # your Prefect server (or Cloud workspace + PREFECT_API_KEY)
#   export DRAFTLINE_STORE_URI=s3://BUCKET/PREFIX            # the store every node and your laptop share
#   export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...   # keys for it (AWS_ENDPOINT_URL for non-AWS S3)
#   export DRAFTLINE_REPO=https://github.com/ORG/draftline.git DRAFTLINE_RELEASE=v0.1.0
#   curl -fsSL .../infra/node-bootstrap.sh | sudo -E bash    # or: sudo -E infra/node-bootstrap.sh
#
# What it does, in order (each step says what is missing and stops):
#   1. checks its inputs and the node (the Python the lock is resolved for: 3.12 for requirements/gpu.lock;
#      git, GPUs via nvidia-smi; docker with --docker);
#   2. installs the pinned release: DRAFTLINE_RELEASE of DRAFTLINE_REPO into
#      $DRAFTLINE_PREFIX/releases/RELEASE with its own virtualenv holding exactly the lock
#      (requirements/gpu.lock, `pip install --no-deps`: nothing is resolved on the node);
#   3. writes the worker's environment ($DRAFTLINE_PREFIX/worker-RELEASE.env, mode 600): Prefect API,
#      store URI and keys, caches on the node's disk ($DRAFTLINE_CACHE); then fetches FlashInfer's
#      precompiled kernels (cubins) into $DRAFTLINE_CACHE/flashinfer/cubins once, so that the first engine
#      start needs no internet (they are not on PyPI for the locked FlashInfer: docs/STACK.md);
#   4. with --weights CONFIG: `draftline weights CONFIG` puts the config's target weights into the node's
#      cache (once per node, resumable) before any worker can start an engine;
#   5. runs `draftline doctor` (versions, NVIDIA driver, GPUs, disk, store and keys, Prefect API) and
#      stops on a failure;
#   6. creates the work pool if it does not exist yet, and starts
#      `prefect worker start --pool POOL --name draftline@HOST --limit N`
#      as a systemd service (restarted on failure and on reboot), or in the foreground (--foreground),
#      or in the background with a pid file when there is no systemd.
#
# Options:
#   --pool NAME    the work pool to join (default draftline-b300; draftline-b300-docker with --docker)
#   --check        only steps 1 and 5 (nothing is installed, fetched or started)
#   --docker       a docker worker (pool draftline-b300-docker): flows run in the worker image
#                  (DRAFTLINE_IMAGE, see infra/Dockerfile); the host only needs prefect + prefect-docker
#   --foreground   run the worker in this shell (exec) instead of as a service
#   --background   run the worker in the background with a pid file even where systemd runs
#   --no-install   skip step 2 (the release and its virtualenv are already there)
#   --install-only only step 2, from DRAFTLINE_SOURCE_DIR (infra/Dockerfile builds the image with it)
#   --lock FILE    the lock to install, relative to the checkout (default requirements/gpu.lock)
#   --weights CONFIG  step 4: fetch CONFIG's target weights (a config path inside the release, e.g.
#                  configs/kimi-k2.5-b300.yaml; HF_TOKEN from the environment for gated models)
#   -h, --help     this text
#
# Required environment:
#   PREFECT_API_URL        the Prefect API the pool lives on
#   DRAFTLINE_STORE_URI    s3://BUCKET/PREFIX (a file:// store only makes sense for a single machine)
#   AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for an s3:// store
#   DRAFTLINE_RELEASE      the release to run, e.g. v0.1.0 (must match the deployment's pin)
#   DRAFTLINE_REPO         git URL of draftline (unless DRAFTLINE_SOURCE_DIR is given)
# Optional:
#   PREFECT_API_KEY        for Prefect Cloud
#   HF_TOKEN               for --weights of a gated hub model (kept in the worker's environment, mode 600)
#   AWS_ENDPOINT_URL       S3 endpoint of non-AWS stores (SeaweedFS, MinIO, Ceph, R2, ...); AWS_DEFAULT_REGION
#   DRAFTLINE_POOL         work pool, as --pool (default draftline-b300; draftline-b300-docker with --docker)
#   DRAFTLINE_LOCK         the lock to install, as --lock (requirements/cpu.lock on a CPU machine)
#   DRAFTLINE_WORKER_LIMIT flow runs this node runs at once (default 1: one run owns the 8 GPUs)
#   DRAFTLINE_PREFIX       install folder (default /opt/draftline)
#   DRAFTLINE_CACHE        model / Hugging Face / vLLM caches, on the node's NVMe (default /var/cache/draftline)
#   DRAFTLINE_EXPECT_GPUS  GPUs the node must show (default 8; 0 skips the GPU check)
#   DRAFTLINE_USER         the unprivileged user the worker runs as when this script runs as root, under systemd or
#                          not (default draftline, created as a system user; it owns DRAFTLINE_CACHE and joins the GPU
#                          groups, and the docker group for a docker worker only)
#   DRAFTLINE_WORKER_AS_ROOT=1  outside systemd, keep the worker as root (only where root is itself unprivileged:
#                          a rootless container, a CI sandbox); never on a node that holds real keys
#   DRAFTLINE_IMAGE        --docker: the worker image (default draftline-worker:VERSION)
#   DRAFTLINE_CREDENTIALS_BLOCK  --docker: AwsCredentials block saved from AWS_* (default draftline-store)
#   DRAFTLINE_SOURCE_DIR   use this checkout instead of cloning (development, tests)
#   DRAFTLINE_VENV         use this virtualenv instead of creating one (development, tests)
#   PYTHON                 the Python to build the virtualenv with (default: the version the lock was
#                          resolved for, python3.12 for requirements/gpu.lock; else python3.11 or python3)
set -euo pipefail

CHECK_ONLY=0 DOCKER=0 FOREGROUND=0 BACKGROUND=0 INSTALL=1 INSTALL_ONLY=0
POOL_ARG="" LOCK="${DRAFTLINE_LOCK:-requirements/gpu.lock}" WEIGHTS=""
usage() { sed -n '2,/^set -euo pipefail/p' "$0" | sed -n '/^#/p' | sed 's/^# \{0,1\}//'; }
while (( $# )); do
  case "$1" in
    --check) CHECK_ONLY=1 ;;
    --docker) DOCKER=1 ;;
    --foreground) FOREGROUND=1 ;;
    --background) BACKGROUND=1 ;;
    --no-install) INSTALL=0 ;;
    --install-only) INSTALL_ONLY=1 ;;
    --pool|--lock|--weights)
      [[ $# -ge 2 && -n "$2" && "$2" != -* ]] \
        || { echo "node-bootstrap: $1 needs a value (--pool draftline-b300, --lock requirements/cpu.lock, --weights configs/kimi-k2.5-b300.yaml)" >&2; exit 2; }
      case "$1" in --pool) POOL_ARG="$2" ;; --lock) LOCK="$2" ;; *) WEIGHTS="$2" ;; esac
      shift ;;
    --pool=*) POOL_ARG="${1#--pool=}" ;;
    --lock=*) LOCK="${1#--lock=}" ;;
    --weights=*) WEIGHTS="${1#--weights=}" ;;
    -h|--help) usage; exit 0 ;;
    *) echo "node-bootstrap: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if (( FOREGROUND && BACKGROUND )); then echo "node-bootstrap: --foreground and --background exclude each other" >&2; exit 2; fi

say() { echo "node-bootstrap: $*"; }
die() { echo "node-bootstrap: error: $*" >&2; exit 2; }

PREFIX="${DRAFTLINE_PREFIX:-/opt/draftline}"
CACHE="${DRAFTLINE_CACHE:-/var/cache/draftline}"
FLASHINFER_CUBINS="${FLASHINFER_CUBIN_DIR:-$CACHE/flashinfer/cubins}"
LIMIT="${DRAFTLINE_WORKER_LIMIT:-1}"
EXPECT_GPUS="${DRAFTLINE_EXPECT_GPUS:-8}"
if (( DOCKER )); then POOL="${DRAFTLINE_POOL:-draftline-b300-docker}"; else POOL="${DRAFTLINE_POOL:-draftline-b300}"; fi
[[ -n "$POOL_ARG" ]] && POOL="$POOL_ARG"
RELEASE="${DRAFTLINE_RELEASE:-}"
WORKER_NAME="draftline@$(hostname)"
RUN_AS="${DRAFTLINE_USER:-draftline}"

# FlashInfer's precompiled kernels: vLLM 0.33 picks FlashInfer's MLA kernels on Blackwell, and FlashInfer
# fetches their cubins from NVIDIA at the first engine start unless they are on disk. The flashinfer-cubin
# wheel of the locked flashinfer-python is not on PyPI (flashinfer.ai's own index only; a mismatched one is
# ignored), so they are fetched here, once per node, with FlashInfer's own downloader (checksummed,
# skips what is already there). FLASHINFER_CUBINS_REPOSITORY points it at a mirror.
warm_flashinfer() {
  "$VENV/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("flashinfer") is None)' \
    2>/dev/null || return 0
  say "fetching FlashInfer's precompiled kernels into $FLASHINFER_CUBINS (once per node)"
  mkdir -p "$FLASHINFER_CUBINS"
  FLASHINFER_CUBIN_DIR="$FLASHINFER_CUBINS" FLASHINFER_WORKSPACE_BASE="$CACHE" "$VENV/bin/python" -c \
    'from flashinfer.artifacts import download_artifacts; download_artifacts()' \
    || die "could not fetch FlashInfer's kernels into $FLASHINFER_CUBINS: check this node's access to NVIDIA's artifact server (or set FLASHINFER_CUBINS_REPOSITORY to a mirror) and run this script again"
}

# ------------------------------------------------------------------ 1. inputs and the node
missing=()
if (( ! INSTALL_ONLY )); then
[[ -n "${PREFECT_API_URL:-}" ]] || missing+=("PREFECT_API_URL: the Prefect API, e.g. http://prefect.internal:4200/api")
if [[ "${PREFECT_API_URL:-}" == *api.prefect.cloud* && -z "${PREFECT_API_KEY:-}" ]]; then
  missing+=("PREFECT_API_KEY: PREFECT_API_URL is Prefect Cloud")
fi
[[ -n "${DRAFTLINE_STORE_URI:-}" ]] || missing+=("DRAFTLINE_STORE_URI: the shared store, e.g. s3://my-bucket/draftline")
if [[ "${DRAFTLINE_STORE_URI:-}" == s3://* ]]; then
  if [[ -z "${AWS_PROFILE:-}" ]]; then
    [[ -n "${AWS_ACCESS_KEY_ID:-}" ]] || missing+=("AWS_ACCESS_KEY_ID: key of the store (or AWS_PROFILE)")
    [[ -n "${AWS_SECRET_ACCESS_KEY:-}" ]] || missing+=("AWS_SECRET_ACCESS_KEY: secret of the store (or AWS_PROFILE)")
  fi
elif [[ -n "${DRAFTLINE_STORE_URI:-}" && "${DRAFTLINE_STORE_URI}" != file://* ]]; then
  missing+=("DRAFTLINE_STORE_URI must start with s3:// (or file:// for one machine), got '${DRAFTLINE_STORE_URI}'")
fi
[[ -n "$RELEASE" ]] || missing+=("DRAFTLINE_RELEASE: the release to install, e.g. v0.1.0 (the b300 deployment's pin)")
fi
if (( INSTALL_ONLY )); then
  [[ -n "${DRAFTLINE_SOURCE_DIR:-}" ]] || missing+=("DRAFTLINE_SOURCE_DIR: --install-only installs the checkout in that folder")
  (( DOCKER || CHECK_ONLY || ! INSTALL )) && missing+=("--install-only goes with none of --docker, --check, --no-install")
fi
if [[ -n "$WEIGHTS" ]]; then
  [[ "$WEIGHTS" != /* && "$WEIGHTS" != *..* ]] || missing+=("--weights takes a config inside the release, e.g. configs/kimi-k2.5-b300.yaml, got '$WEIGHTS'")
  (( DOCKER || INSTALL_ONLY )) && missing+=("--weights goes with process workers (neither --docker nor --install-only)")
fi
[[ "$LOCK" != /* && "$LOCK" != *..* ]] || missing+=("--lock / DRAFTLINE_LOCK is a path inside the checkout, e.g. requirements/gpu.lock, got '$LOCK'")
if (( INSTALL && ! DOCKER )) && [[ -z "${DRAFTLINE_SOURCE_DIR:-}" && -z "${DRAFTLINE_REPO:-}" ]]; then
  missing+=("DRAFTLINE_REPO: git URL of draftline (or DRAFTLINE_SOURCE_DIR: an existing checkout)")
fi
[[ "$LIMIT" =~ ^[1-9][0-9]*$ ]] || missing+=("DRAFTLINE_WORKER_LIMIT must be a positive number, got '$LIMIT'")
[[ "$EXPECT_GPUS" =~ ^[0-9]+$ ]] || missing+=("DRAFTLINE_EXPECT_GPUS must be a number, got '$EXPECT_GPUS'")

# When the lock is installed here (not --docker, no DRAFTLINE_VENV): the Python it was resolved for (uv's
# header: --python-version X.Y) and its wheels' platform (--python-platform ...-manylinux_2_XX: the node's
# glibc must be at least 2.XX, or pip finds no wheel for some packages; llguidance 1.7 has none below
# manylinux_2_34). The GPU lock's are known before the release is cloned (tests/repo/test_locks.py keeps
# GPU_LOCK_PYTHON and GPU_LOCK_GLIBC equal to its header).
GPU_LOCK_PYTHON=3.12
GPU_LOCK_GLIBC=2.34
LOCK_PY="" LOCK_GLIBC=""
lock_here="${DRAFTLINE_SOURCE_DIR:-$PREFIX/releases/${RELEASE:-none}}/$LOCK"
if (( DOCKER )) || [[ -n "${DRAFTLINE_VENV:-}" ]]; then
  :
elif [[ -f "$lock_here" ]]; then
  LOCK_PY="$(sed -n 's/.*--python-version \([0-9][0-9.]*\).*/\1/p' "$lock_here" | head -1)"
  LOCK_GLIBC="$(sed -n 's/.*--python-platform [a-z0-9_]*-manylinux_\([0-9]*\)_\([0-9]*\).*/\1.\2/p' "$lock_here" | head -1)"
elif [[ "$LOCK" == requirements/gpu.lock ]]; then
  LOCK_PY="$GPU_LOCK_PYTHON" LOCK_GLIBC="$GPU_LOCK_GLIBC"
fi
have_glibc="$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}' || true)"
if [[ -n "$LOCK_GLIBC" && -n "$have_glibc" ]] && ! printf '%s\n%s\n' "$LOCK_GLIBC" "$have_glibc" | sort -V -C; then
  missing+=("glibc $LOCK_GLIBC or newer ($LOCK holds wheels for manylinux_${LOCK_GLIBC/./_}; this node has $have_glibc): Ubuntu 22.04+ or Debian 12+")
fi
PY="${PYTHON:-}"
if [[ -z "$PY" && -n "$LOCK_PY" ]]; then PY="$(command -v "python$LOCK_PY" || true)"; fi
if [[ -z "$PY" && -z "$LOCK_PY" ]]; then PY="$(command -v python3.11 || command -v python3 || true)"; fi
if [[ -z "${DRAFTLINE_VENV:-}" ]]; then
  want="${LOCK_PY:-3.11}"
  if [[ -z "$PY" ]]; then
    missing+=("python$want with venv ($LOCK is resolved for Python ${LOCK_PY:-3.11+}): apt-get install -y python$want python$want-venv, or set PYTHON")
  elif [[ -n "$LOCK_PY" ]] && ! "$PY" -c 'import sys, venv; sys.exit("%d.%d" % sys.version_info[:2] != sys.argv[1])' "$LOCK_PY" 2>/dev/null; then
    missing+=("Python $LOCK_PY with venv, the version $LOCK is resolved for (PYTHON=$PY is $("$PY" --version 2>/dev/null || echo "not runnable")): apt-get install -y python$LOCK_PY python$LOCK_PY-venv, or set PYTHON")
  elif [[ -z "$LOCK_PY" ]] && ! "$PY" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    missing+=("Python >= 3.11 with venv (found $("$PY" --version 2>/dev/null || echo "not runnable")): apt-get install -y python3.11 python3.11-venv, or set PYTHON")
  fi
elif [[ ! -x "${DRAFTLINE_VENV}/bin/python" ]]; then
  missing+=("DRAFTLINE_VENV=${DRAFTLINE_VENV} has no bin/python")
fi
if (( INSTALL )) && [[ -z "${DRAFTLINE_SOURCE_DIR:-}" ]] && (( ! DOCKER )); then
  command -v git >/dev/null || missing+=("git: apt-get install -y git")
fi
if [[ -n "${DRAFTLINE_SOURCE_DIR:-}" && ! -f "${DRAFTLINE_SOURCE_DIR}/flows/pipeline.py" ]]; then
  missing+=("DRAFTLINE_SOURCE_DIR=${DRAFTLINE_SOURCE_DIR} is not a draftline checkout (no flows/pipeline.py)")
fi
if (( EXPECT_GPUS > 0 && ! INSTALL_ONLY )); then
  if ! command -v nvidia-smi >/dev/null; then
    missing+=("nvidia-smi: install the NVIDIA driver (or DRAFTLINE_EXPECT_GPUS=0 for a CPU node)")
  else
    n="$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c . || true)"
    [[ "$n" == "$EXPECT_GPUS" ]] || missing+=("$EXPECT_GPUS GPUs (nvidia-smi shows $n): check the driver, or set DRAFTLINE_EXPECT_GPUS")
  fi
fi
if (( DOCKER )); then
  command -v docker >/dev/null || missing+=("docker: install Docker Engine and the NVIDIA Container Toolkit")
  if command -v docker >/dev/null && ! docker info >/dev/null 2>&1; then
    missing+=("a running Docker daemon you may use (docker info fails)")
  fi
  if command -v docker >/dev/null && docker info >/dev/null 2>&1 && ! docker info 2>/dev/null | grep -qi nvidia; then
    missing+=("the NVIDIA Container Toolkit (docker info lists no nvidia runtime): GPUs cannot reach containers")
  fi
fi
if (( ${#missing[@]} )); then
  echo "node-bootstrap: cannot continue, missing or wrong:" >&2
  printf '  - %s\n' "${missing[@]}" >&2
  echo "see: $0 --help" >&2
  exit 2
fi

VERSION="${RELEASE#v}"
if [[ -n "${DRAFTLINE_SOURCE_DIR:-}" ]]; then
  CODE="$(cd "$DRAFTLINE_SOURCE_DIR" && pwd)"
else
  CODE="$PREFIX/releases/$RELEASE"
fi
VENV="${DRAFTLINE_VENV:-$CODE/.venv}"
ENV_FILE="$PREFIX/worker-$RELEASE.env"

# ------------------------------------------------------------------ 2. install the pinned release
if (( INSTALL && ! CHECK_ONLY )); then
  (( INSTALL_ONLY )) || mkdir -p "$PREFIX/releases" "$CACHE"
  if [[ -z "${DRAFTLINE_SOURCE_DIR:-}" ]]; then
    if (( DOCKER )); then
      mkdir -p "$CODE"
    elif [[ ! -f "$CODE/flows/pipeline.py" ]]; then
      say "cloning $DRAFTLINE_REPO at $RELEASE into $CODE"
      git clone --quiet --depth 1 --branch "$RELEASE" "$DRAFTLINE_REPO" "$CODE" \
        || die "git clone of $DRAFTLINE_REPO at $RELEASE failed: check the URL, the tag and your access"
    fi
  fi
  if [[ -z "${DRAFTLINE_VENV:-}" ]]; then
    [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    if (( DOCKER )); then
      # The host holds no checkout; these are requirements/gpu.lock's versions (tests/repo/test_locks.py).
      say "installing the docker worker (prefect, prefect-docker) into $VENV"
      "$VENV/bin/python" -m pip install -q "prefect==3.7.7" "prefect-docker==0.7.3" "prefect-aws==0.7.11"
    else
      [[ -f "$CODE/$LOCK" ]] || die "$CODE has no $LOCK: --lock names a file of the checkout (requirements/gpu.lock, requirements/cpu.lock)"
      # Exactly the lock: every package pinned, nothing resolved here (--no-deps).
      say "installing $LOCK and draftline ${RELEASE:-(checkout)} into $VENV (a few minutes)"
      "$VENV/bin/python" -m pip install -q --no-deps -r "$CODE/$LOCK"
      "$VENV/bin/python" -m pip install -q --no-deps -e "$CODE"
    fi
  fi
fi
if (( INSTALL_ONLY )); then
  warm_flashinfer
  say "installed into $VENV (--install-only: nothing checked or started)"; exit 0
fi
if (( ! DOCKER )); then
  if [[ ! -f "$CODE/flows/pipeline.py" ]]; then
    if (( CHECK_ONLY )); then say "inputs ok; draftline is not installed at $CODE yet, so doctor is skipped"; exit 0; fi
    die "no draftline code at $CODE (drop --no-install, or set DRAFTLINE_SOURCE_DIR)"
  fi
  have="$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$CODE/pyproject.toml" | head -1)"
  [[ "$have" == "$VERSION" ]] || die "$CODE holds draftline $have, not $RELEASE: fix DRAFTLINE_RELEASE or the checkout"
fi
if [[ ! -x "$VENV/bin/prefect" ]]; then
  if (( CHECK_ONLY )); then say "inputs ok; nothing installed yet at $VENV, so doctor is skipped"; exit 0; fi
  die "no prefect in $VENV (drop --no-install, or fix DRAFTLINE_VENV)"
fi

# ------------------------------------------------------------------ 3. the worker's environment
write_env() {
  local v
  (umask 077
   {
     echo "# draftline worker environment (written by infra/node-bootstrap.sh; secrets: keep mode 600)"
     for v in PREFECT_API_URL PREFECT_API_KEY DRAFTLINE_STORE_URI AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY \
              AWS_SESSION_TOKEN AWS_PROFILE AWS_ENDPOINT_URL AWS_ENDPOINT_URL_S3 AWS_DEFAULT_REGION AWS_REGION \
              AWS_REQUEST_CHECKSUM_CALCULATION AWS_RESPONSE_CHECKSUM_VALIDATION HF_TOKEN; do
       [[ -n "${!v:-}" ]] && printf '%s=%q\n' "$v" "${!v}"
     done
     echo "DRAFTLINE_CODE_DIR=$CODE"
     echo "DRAFTLINE_HOME=$CACHE"
     echo "HF_HOME=$CACHE/huggingface"
     echo "VLLM_CACHE_ROOT=$CACHE/vllm"
     echo "FLASHINFER_CUBIN_DIR=$FLASHINFER_CUBINS"
     echo "FLASHINFER_WORKSPACE_BASE=$CACHE"
     echo "PREFECT_SERVER_ANALYTICS_ENABLED=false"
     echo "DO_NOT_TRACK=1"
     echo "VLLM_NO_USAGE_STATS=1"
     echo "TOKENIZERS_PARALLELISM=false"
   } > "$ENV_FILE")
}
if (( ! CHECK_ONLY )); then
  mkdir -p "$PREFIX" "$CACHE"
  write_env
  say "worker environment in $ENV_FILE"
fi

if (( ! CHECK_ONLY && ! DOCKER )); then warm_flashinfer; fi

# ------------------------------------------------------------------ 4. the target's weights
if [[ -n "$WEIGHTS" ]] && (( ! CHECK_ONLY )); then
  [[ -f "$CODE/$WEIGHTS" ]] || die "--weights $WEIGHTS: no such config in $CODE"
  say "draftline weights $WEIGHTS (into $CACHE: once per node, resumable; no worker runs until it is done)"
  (set -a; source "$ENV_FILE"; set +a; cd "$CODE" && "$VENV/bin/draftline" weights "$WEIGHTS") \
    || die "draftline weights $WEIGHTS failed (above): fix it (HF_TOKEN, disk, network) and run this script again; what was fetched is kept"
fi

# ------------------------------------------------------------------ 5. doctor
if (( DOCKER )); then
  say "checking the Prefect API from the host"
  "$VENV/bin/python" - <<'EOF' || die "the Prefect API at $PREFECT_API_URL does not answer: check the URL, the key and the network"
import os, sys, urllib.request
req = urllib.request.Request(os.environ["PREFECT_API_URL"].rstrip("/") + "/health")
if os.environ.get("PREFECT_API_KEY"):
    req.add_header("Authorization", "Bearer " + os.environ["PREFECT_API_KEY"])
urllib.request.urlopen(req, timeout=15)
EOF
else
  say "draftline doctor"
  gpu_flag=()
  (( EXPECT_GPUS > 0 )) && gpu_flag=(--expect-gpus "$EXPECT_GPUS")
  (cd "$CODE" && DRAFTLINE_HOME="$CACHE" "$VENV/bin/draftline" doctor "${gpu_flag[@]}") \
    || die "draftline doctor found problems (above): fix them and run this script again"
fi
if (( CHECK_ONLY )); then say "checks passed (--check: nothing installed or started)"; exit 0; fi

if (( DOCKER )); then
  # Containers get the store's keys from this prefect-aws block (the b300-docker pull step loads it),
  # so they never appear in deployments, runs or the UI.
  block="${DRAFTLINE_CREDENTIALS_BLOCK:-draftline-store}"
  if [[ -n "${AWS_ACCESS_KEY_ID:-}" ]]; then
    say "saving the store's keys as AwsCredentials block '$block'"
    "$VENV/bin/python" - "$block" <<'EOF' || die "could not save the AwsCredentials block $block"
import os, sys
from prefect_aws import AwsCredentials
from prefect_aws.client_parameters import AwsClientParameters
endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
AwsCredentials(aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
               aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
               region_name=os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION"),
               aws_client_parameters=AwsClientParameters(endpoint_url=endpoint)).save(sys.argv[1], overwrite=True)
EOF
  fi
  image="${DRAFTLINE_IMAGE:-draftline-worker:$VERSION}"
  say "pulling the worker image $image"
  docker pull -q "$image" >/dev/null 2>&1 || docker image inspect "$image" >/dev/null 2>&1 \
    || die "image $image is neither pullable nor present: build it (docker build -f infra/Dockerfile -t $image .) and push it, or set DRAFTLINE_IMAGE"
fi

# ------------------------------------------------------------------ 6. the pool and the worker
if ! "$VENV/bin/prefect" work-pool inspect "$POOL" >/dev/null 2>&1; then
  if (( DOCKER )); then template="$CODE/deployments/job-templates/docker-gpu.json"; type=docker
  else template="$CODE/deployments/job-templates/process.json"; type=process; fi
  if [[ -f "$template" ]]; then
    say "creating work pool $POOL ($type)"
    "$VENV/bin/prefect" work-pool create "$POOL" --type "$type" --base-job-template "$template" >/dev/null
  else
    die "work pool $POOL does not exist: run \`draftline deploy\` from a checkout first"
  fi
fi

# A process pool's runs go through draftline's node worker (flows/node_worker.py): Prefect's process worker,
# refusing a run whose job variables its pool's template does not allow (docs/SECURITY.md).
if (( DOCKER )); then
  worker_cmd=("$VENV/bin/prefect" worker start --pool "$POOL" --name "$WORKER_NAME" --limit "$LIMIT" --type docker)
else
  worker_cmd=("$VENV/bin/python" -m flows.node_worker --pool "$POOL" --name "$WORKER_NAME" --limit "$LIMIT")
fi

# The worker runs flow runs that anyone with the Prefect API can start: never as root. As root, this script
# hands it to the unprivileged DRAFTLINE_USER (created), in the GPU groups; in the docker group only for a
# docker worker, which starts containers (the docker group is root by another door: a process worker never
# joins it).
worker_groups() {
  local g out=()
  for g in video render; do getent group "$g" >/dev/null && out+=("$g"); done
  if (( DOCKER )) && getent group docker >/dev/null; then out+=(docker); fi
  echo "${out[*]}"
}
ensure_worker_user() {
  [[ "$RUN_AS" != root ]] || die "DRAFTLINE_USER=root: the worker runs what the Prefect API's users submit; give an unprivileged user"
  if ! id -u "$RUN_AS" >/dev/null 2>&1; then
    say "creating the unprivileged user $RUN_AS for the worker"
    useradd --system --home-dir "$CACHE" --shell /usr/sbin/nologin "$RUN_AS" \
      || die "could not create user $RUN_AS: create it (useradd --system $RUN_AS) or set DRAFTLINE_USER to one that exists"
  fi
  chown -R "$RUN_AS": "$CACHE"
}

# Outside systemd (--foreground, --background, no systemd), root drops to DRAFTLINE_USER the same way.
drop_root=()
if (( EUID == 0 )) && [[ "${DRAFTLINE_WORKER_AS_ROOT:-0}" != 1 ]] \
   && { (( FOREGROUND || BACKGROUND )) || ! command -v systemctl >/dev/null || [[ ! -d /run/systemd/system ]]; }; then
  ensure_worker_user
  groups="$(worker_groups)"
  command -v setpriv >/dev/null || die "setpriv (util-linux) is missing: it runs the worker as $RUN_AS, not root"
  drop_root=(setpriv --reuid="$RUN_AS" --regid="$(id -g "$RUN_AS")" --no-new-privs)
  if [[ -n "$groups" ]]; then drop_root+=(--groups="${groups// /,}"); else drop_root+=(--clear-groups); fi
  say "the worker runs as $RUN_AS${groups:+ (groups ${groups// /,})}, not root"
fi

if (( FOREGROUND )); then
  say "starting worker $WORKER_NAME on pool $POOL (limit $LIMIT) in the foreground"
  set -a; source "$ENV_FILE"; set +a
  cd "$CODE"
  exec "${drop_root[@]}" "${worker_cmd[@]}"
fi

if (( ! BACKGROUND )) && command -v systemctl >/dev/null && [[ -d /run/systemd/system ]]; then
  unit="draftline-worker-${POOL}.service"
  ensure_worker_user
  groups="$(worker_groups)"
  say "installing systemd unit $unit (runs as $RUN_AS${groups:+, groups $groups})"
  cat > "/etc/systemd/system/$unit" <<EOF
[Unit]
Description=draftline Prefect worker ($POOL, $RELEASE)
After=network-online.target
Wants=network-online.target

[Service]
User=$RUN_AS
Group=$RUN_AS
SupplementaryGroups=$groups
NoNewPrivileges=yes
EnvironmentFile=$ENV_FILE
WorkingDirectory=$CODE
ExecStart=${worker_cmd[*]}
Restart=always
RestartSec=10
LimitNOFILE=1048576
LimitMEMLOCK=infinity

[Install]
WantedBy=multi-user.target
EOF
  systemctl daemon-reload
  systemctl enable --now "$unit"
  systemctl restart "$unit"
  say "worker $WORKER_NAME started (systemctl status $unit; journalctl -u $unit -f)"
else
  log="$PREFIX/worker-$POOL.log"
  pidfile="$PREFIX/worker-$POOL.pid"
  if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    say "a worker is already running (pid $(cat "$pidfile")); stop it first: kill $(cat "$pidfile")"
    exit 0
  fi
  (set -a; source "$ENV_FILE"; set +a; cd "$CODE"; setsid nohup "${drop_root[@]}" "${worker_cmd[@]}" >>"$log" 2>&1 < /dev/null & echo $! > "$pidfile")
  say "worker $WORKER_NAME started in the background (pid $(cat "$pidfile"), log $log); no systemd here, so it does not survive a reboot"
fi
say "this node now takes runs from pool $POOL: draftline submit CONFIG --deployment ${POOL#draftline-}"
