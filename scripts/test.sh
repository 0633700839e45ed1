#!/usr/bin/env bash
# The one test command: lint, type check, import contracts, then unit + integration + security tests.
#
#   scripts/test.sh                    # everything, in stages (below)
#   scripts/test.sh -k image -x        # extra arguments: one pytest run over the suites with them
#
# Stages, each timed, in two lanes that overlap (both cores work: a TCG guest keeps one busy):
#   - lane 1: ruff, mypy --strict, the import contracts, then the tests that boot no VM (QEMU refuses to
#     boot there, so a VM test without the `vm` marker fails);
#   - lane 2: the templates (`capsa template warm`, in the background at low priority: base and
#     base-net first, then the shipped ones), the tests marked `vm` as soon as base and base-net are
#     cached, then those marked `shipped_templates` once browser and desktop are. VM tests run one at a time;
#   - beside them, the container image (scripts/build_image.py, at low priority): reused when its inputs are
#     unchanged, else built; the container test waits for it.
# Every stage runs even if an earlier one fails; the exit status is non-zero if any did. At the end: each
# stage's time and span, the 30 slowest tests and every skip. A record of the run (stage times, junit XML,
# the template and no-VM logs) is kept under $CAPSA_CACHE_DIR/ci/runs/ (default /var/cache/capsa).
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
# .ci/run's install ran before this script: it is recorded as starting that long before it.
[ -n "${CAPSA_CI_INSTALL_SECONDS:-}" ] && printf 'install\tok\t%s\t%s\n' "$CAPSA_CI_INSTALL_SECONDS" \
    "-$CAPSA_CI_INSTALL_SECONDS" > "$STAGES"

failed=()
# stages.tsv: name, status, seconds, and when the stage started (seconds since this script started; the
# lanes below overlap, so the report takes the wall time from the starts, not from a sum).
record() {  # record NAME STATUS SECONDS [START]: START defaults to now minus SECONDS
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-$((SECONDS - $3))}" >> "$STAGES"
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
    # Two lanes, so both cores work (a TCG guest keeps one busy; the tests that boot no VM, the other):
    #   lane 1: ruff, mypy, import contracts, then the tests that boot no VM (their output goes to a log,
    #           printed whole when they end, so the lanes never interleave);
    #   lane 2: the templates, built in the background at low priority (`capsa template warm`): the
    #           node's own first (base, base-net: what most VM tests restore), then the shipped ones
    #           (browser, desktop); the VM tests start as soon as the templates they use are cached, those
    #           of the shipped templates (marker `shipped_templates`) once those are.
    # With a warm cache the VM tests start at once; the VM tests themselves run one at a time.
    # Priorities: the VM tests are the longest path, so they run at normal priority and everything beside
    # them (the template builds, lane 1's tests) at `nice 10` and the lowest best-effort I/O class; the
    # template builds share the second core with lane 1 rather than wait for it (the shipped VM tests wait
    # for them).
    low() { nice -n 10 ionice -c 2 -n 7 "$@"; }
    warm() {  # warm LOG NAME... : build what the cache lacks, at low CPU and I/O priority
        local log="$1"; shift
        local status=0
        low capsa template warm "$@" > "$log" 2>&1 || status=$?
        echo "$SECONDS" > "$RECORD/templates.end"
        return "$status"
    }
    tpl_start=$SECONDS
    step "templates (background: capsa template warm base base-net, then --all; log $RECORD/templates.log)"
    warm "$RECORD/templates.log" base base-net &
    tpl_pid=$!
    lane1_pid=""
    # The container image (scripts/build_image.py), in the background at low priority: reused when its
    # inputs are unchanged (seconds), else built from Debian packages and this tree (the root filesystem
    # is cached under $CACHE/oci); the container test waits for it on the build's lock.
    image_start=$SECONDS
    step "container image (background: scripts/build_image.py; log $RECORD/image.log)"
    ( status=0; low python3 "$REPO/scripts/build_image.py" --venv "$VENV" > "$RECORD/image.log" 2>&1 \
          || status=$?; echo "$status $SECONDS" > "$RECORD/image.end" ) &
    image_pid=$!
    # Interrupted or failing early: stop the background work as Ctrl-C would (the build removes its VMs,
    # pool and mounts; pytest tears down its fixtures): the lane's own shell is ended so it starts nothing
    # more, and what it runs gets SIGINT.
    tree() {  # tree PID: PID's descendants, deepest first
        local child
        for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do tree "$child"; echo "$child"; done
    }
    stop_background() {
        local pid kids
        for pid in $tpl_pid $lane1_pid $image_pid; do
            kids="$(tree "$pid")"
            kill -TERM "$pid" 2>/dev/null
            [ -n "$kids" ] && kill -INT $kids 2>/dev/null
        done
        wait 2>/dev/null
    }
    trap stop_background EXIT

    # Lane 1, in the background; its output goes to a log printed whole when it ends (lanes never interleave).
    lint_paths=(src tests)
    [ -d bench ] && lint_paths+=(bench)
    lane1() {
        run "ruff" ruff check "${lint_paths[@]}"
        run "mypy --strict" mypy --strict
        run "import contracts" lint-imports
        # No VM may boot here: a QEMU that refuses -kernel/-incoming is first on PATH (tests/support/novm).
        run "pytest: no VM" low env PATH="$REPO/tests/support/novm:$PATH" \
            pytest "${suites[@]}" -m "not vm" "${pytest_args[@]}" --junitxml="$RECORD/junit-novm.xml"
    }
    step "lane 1 (background): ruff, mypy, import contracts, pytest: no VM (log $RECORD/lane1.log)"
    lane1 > "$RECORD/lane1.log" 2>&1 &
    lane1_pid=$!

    templates_ready() {  # templates_ready WHAT LOG: wait for the background build; fail with its log
        local status=0 wait_start=$SECONDS
        wait "$tpl_pid" || status=$?
        record "templates: waited for ($1)" ok $((SECONDS - wait_start))
        if [ "$status" -ne 0 ]; then
            echo "capsa template warm failed; its log ($2):"
            tail -n 60 "$2"
            return 1
        fi
        grep -E '^(cached|built)' "$2" || true
    }
    vm_ok=0
    if templates_ready "base, base-net" "$RECORD/templates.log"; then
        warm "$RECORD/templates-shipped.log" --all &
        tpl_pid=$!
        run "pytest: vm" pytest "${suites[@]}" -m "vm and not shipped_templates" "${pytest_args[@]}" \
            --junitxml="$RECORD/junit-vm.xml"
        if templates_ready "browser, desktop" "$RECORD/templates-shipped.log"; then
            vm_ok=1
            run "pytest: vm (shipped templates)" pytest "${suites[@]}" -m "vm and shipped_templates" \
                "${pytest_args[@]}" --junitxml="$RECORD/junit-vm-shipped.xml"
        fi
    fi
    tpl_end="$(cat "$RECORD/templates.end" 2>/dev/null || echo "$tpl_start")"
    if [ "$vm_ok" -eq 1 ]; then
        record "templates" ok $((tpl_end - tpl_start)) "$tpl_start"
    else
        record "templates" FAILED $((tpl_end - tpl_start)) "$tpl_start"
        echo "the VM tests that need the missing templates did not run"
    fi

    wait "$image_pid"
    read -r image_status image_end < "$RECORD/image.end" || { image_status=1; image_end=$SECONDS; }
    record "container image" "$([ "$image_status" = 0 ] && echo ok || echo FAILED)" \
        $((image_end - image_start)) "$image_start"
    tail -n 3 "$RECORD/image.log"

    step "lane 1 (its log)"
    wait "$lane1_pid"
    trap - EXIT
    cat "$RECORD/lane1.log"
fi

step "Where the time went (record: $RECORD)"
python3 "$REPO/scripts/ci_report.py" "$RECORD"

echo
# Stages of lane 1 ran in a subshell: the record, not this shell's list, has every stage's status.
mapfile -t failed < <(awk -F'\t' '$2 != "ok" {print $1}' "$STAGES")
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED stages: ${failed[*]}"
    exit 1
fi
echo "all stages passed"
