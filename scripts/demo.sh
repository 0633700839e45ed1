#!/usr/bin/env bash
# The README's main job, end to end: start `capsa serve` (control plane + local node, embedded SQLite),
# create a tenant API key, run examples/quickstart.py through the SDK (create a session, run Python in
# its microVM, write and read a file, close it), then check that nothing of the session is left on the
# node (no QEMU process, no VM directory) once the server has stopped.
#
#   scripts/demo.sh [--state-dir DIR] [--port N]
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CAPSA_VENV:-$REPO/.venv}"
STATE="${CAPSA_DEMO_STATE:-/var/lib/capsa-demo}"
PORT=8799
while [ $# -gt 0 ]; do
    case "$1" in
        --state-dir) STATE="$2"; shift ;;
        --port) PORT="$2"; shift ;;
        *) echo "demo.sh: unknown option: $1" >&2; exit 2 ;;
    esac
    shift
done

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
CAPSA="$VENV/bin/capsa"
URL="http://127.0.0.1:$PORT"
mkdir -p "$STATE"
chmod 0755 "$STATE"
LOG="$STATE/serve.log"

# The admin key: reuse the one this script made before, else make one now (capsa serve adopts
# CAPSA_BOOTSTRAP_KEY on the first start of an empty state directory).
KEYFILE="$STATE/admin.key"
if [ ! -s "$KEYFILE" ]; then
    ( umask 077; "$VENV/bin/python" -c 'from capsa.control.keys import generate_key; print(generate_key().full)' \
        > "$KEYFILE" )
fi
ADMIN="$(cat "$KEYFILE")"

step "Starting capsa serve on $URL (state in $STATE, log in $LOG)"
CAPSA_BOOTSTRAP_KEY="$ADMIN" "$CAPSA" serve --port "$PORT" --state-dir "$STATE" >"$LOG" 2>&1 &
SERVER=$!
stop_server() {
    if kill -0 "$SERVER" 2>/dev/null; then
        kill -INT "$SERVER" 2>/dev/null || true
        for _ in $(seq 1 100); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$SERVER" 2>/dev/null || true
    fi
}
trap stop_server EXIT

for _ in $(seq 1 1200); do
    if ! kill -0 "$SERVER" 2>/dev/null; then
        echo "demo.sh: capsa serve exited; its log:" >&2; cat "$LOG" >&2; exit 1
    fi
    if "$VENV/bin/python" - "$URL" <<'PY' 2>/dev/null; then break; fi
import sys, httpx
sys.exit(0 if httpx.get(sys.argv[1] + "/v1/ready", timeout=2).status_code == 200 else 1)
PY
    sleep 0.5
done
echo "ready"

step "Creating an API key for tenant 'demo'"
KEY="$("$CAPSA" keys create --tenant demo --name quickstart --api-url "$URL" --api-key "$ADMIN" --json \
       | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["key"])')"
echo "created ${KEY:0:16}…"

step "Quick start through the SDK (examples/quickstart.py)"
CAPSA_API_URL="$URL" CAPSA_API_KEY="$KEY" "$VENV/bin/python" "$REPO/examples/quickstart.py"

step "Stopping the server; checking that nothing is left on the node"
# The warm pool keeps restored sandboxes idle while the server runs; stopping it destroys them, and the
# closed session's own VM must already be gone.
stop_server
trap - EXIT
left="$(find "$STATE/vms" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)"
procs="$(pgrep -f "qemu-system.*$STATE/" | wc -l || true)"
echo "VM directories left: $left; QEMU processes left: $procs"
if [ "$left" -ne 0 ] || [ "$procs" -ne 0 ]; then
    echo "demo.sh: resources were left behind on the node" >&2; exit 1
fi
echo "main job finished"
