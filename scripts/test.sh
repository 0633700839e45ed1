#!/usr/bin/env bash
# The one test command: lint, type check, import contracts, then unit + integration + security tests.
#
#   scripts/test.sh                    # everything, in stages (below)
#   scripts/test.sh -k image -x        # extra arguments: one pytest run over the suites with them
#
# Stages, each timed: the guest image; the shipped templates (`capsa template warm`, in the background at
# low priority); ruff, mypy --strict and the import contracts; the tests that boot no VM (while the
# templates build; QEMU refuses to boot in this stage, so a VM test without the `vm` marker fails); then,
# once the templates are ready, the tests marked `vm`. Every stage runs even if an earlier one fails; the
# exit status is non-zero if any did; the templates' time is their background build's, beside the others.
# At the end: the time of each stage, the 30 slowest tests and every
# skip. A record of the run (stage times, junit XML, the template log) is kept under
# $CAPSA_CACHE_DIR/ci/runs/ (default /var/cache/capsa).
#
# Installs the dev dependencies into the venv ($CAPSA_VENV, default ./.venv) if they are missing.
# Integration tests boot real microVMs and need root.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CAPSA_VENV:-$REPO/.venv}"
CACHE="${CAPSA_CACHE_DIR:-/var/cache/capsa}"
cd "$REPO"
export PATH="$VENV/bin:$PATH"
# mypy's cache outlives the clone (it checks file hashes, so a new checkout reuses what did not change).
export MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-$CACHE/ci/mypy-cache}"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$CACHE/pip}"

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }

RECORD="$CACHE/ci/runs/$(date -u +%Y%m%dT%H%M%SZ)-$(git rev-parse --short HEAD 2>/dev/null || echo nogit)"
mkdir -p "$RECORD" || exit 1
STAGES="$RECORD/stages.tsv"
[ -n "${CAPSA_CI_INSTALL_SECONDS:-}" ] && printf 'install\tok\t%s\n' "$CAPSA_CI_INSTALL_SECONDS" > "$STAGES"

failed=()
record() {  # record NAME STATUS SECONDS
    printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$STAGES"
    echo "$1: $2 ($3 s)"
    [ "$2" = ok ] || failed+=("$1")
}
run() {
    local name="$1"; shift
    step "$name"
    local start=$SECONDS
    if "$@"; then record "$name" ok $((SECONDS - start)); else record "$name" FAILED $((SECONDS - start)); fi
}

if [ ! -x "$VENV/bin/python" ]; then
    step "Creating $VENV"
    python3 -m venv "$VENV" || exit 1
fi
if ! "$VENV/bin/python" -c 'import capsa, pytest, pytest_asyncio, pytest_timeout, hypothesis, mypy, mcp, deepagents, e2b, agents, playwright, python_multipart, httptools' 2>/dev/null \
    || [ ! -x "$VENV/bin/ruff" ] || [ ! -x "$VENV/bin/lint-imports" ]; then
    run "dev dependencies" "$VENV/bin/python" -m pip install -q -e "$REPO[dev]"
fi

run "guest image" capsa image build
[ ${#failed[@]} -eq 0 ] || { echo "the guest image did not build: nothing else can run"; exit 1; }

# git keeps no empty directories, so a suite without tests yet is simply absent from a clone.
suites=()
for d in tests/unit tests/integration tests/security; do
    [ -d "$d" ] && suites+=("$d")
done
pytest_args=(-rs --durations=30)

if [ $# -gt 0 ]; then
    # Arguments that name tests (paths, path::test) replace the suites; others (-k, -x) apply to them all.
    for arg in "$@"; do
        [ -e "${arg%%::*}" ] && { suites=(); break; }
    done
    run "pytest" pytest "${suites[@]}" "${pytest_args[@]}" --junitxml="$RECORD/junit.xml" "$@"
else
    # The shipped templates build beside the stages that need no VM, at the lowest CPU and I/O priority.
    step "templates (background: capsa template warm, log $RECORD/templates.log)"
    (
        start=$SECONDS
        nice -n 19 ionice -c 3 capsa template warm --all > "$RECORD/templates.log" 2>&1
        status=$?
        echo $((SECONDS - start)) > "$RECORD/templates.seconds"
        exit "$status"
    ) &
    tpl_pid=$!
    # Interrupted or failing early: stop the build as Ctrl-C would (it removes its VMs, pool and mounts).
    trap 'kill -INT "$tpl_pid" 2>/dev/null; wait "$tpl_pid" 2>/dev/null' EXIT

    lint_paths=(src tests)
    [ -d bench ] && lint_paths+=(bench)
    run "ruff" ruff check "${lint_paths[@]}"
    run "mypy --strict" mypy --strict
    run "import contracts" lint-imports
    # No VM may boot here: a QEMU that refuses -kernel/-incoming is first on PATH (tests/support/novm).
    run "pytest: no VM" env PATH="$REPO/tests/support/novm:$PATH" \
        pytest "${suites[@]}" -m "not vm" "${pytest_args[@]}" --junitxml="$RECORD/junit-novm.xml"

    step "templates (waiting for the background build)"
    wait_start=$SECONDS
    tpl_status=0
    wait "$tpl_pid" || tpl_status=$?
    trap - EXIT
    built_s="$(cat "$RECORD/templates.seconds" 2>/dev/null || echo 0)"
    if [ "$tpl_status" -eq 0 ]; then
        tail -n 20 "$RECORD/templates.log"
        record "templates" ok "$built_s"
    else
        echo "capsa template warm failed; its log ($RECORD/templates.log):"
        tail -n 60 "$RECORD/templates.log"
        record "templates" FAILED "$built_s"
    fi
    record "templates: waited for" ok $((SECONDS - wait_start))
    if [[ " ${failed[*]} " == *" templates "* ]]; then
        echo "pytest: vm not run: the templates did not build"
        record "pytest: vm" FAILED 0
    else
        run "pytest: vm" pytest "${suites[@]}" -m vm "${pytest_args[@]}" --junitxml="$RECORD/junit-vm.xml"
    fi
fi

step "Where the time went (record: $RECORD)"
python3 "$REPO/scripts/ci_report.py" "$RECORD"

echo
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED stages: ${failed[*]}"
    exit 1
fi
echo "all stages passed"
