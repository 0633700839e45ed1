#!/usr/bin/env bash
# The one test command: lint, type check, import contracts, then unit + integration + security tests.
#
#   scripts/test.sh                    # everything
#   scripts/test.sh -k image -x        # extra arguments go to pytest
#
# Installs the dev dependencies into the venv if they are missing and makes sure the guest image is
# built (cached under /var/cache/capsa or $CAPSA_CACHE_DIR). Integration tests boot real microVMs
# and need root. Every stage runs even if an earlier one fails; the exit status is non-zero if any
# stage failed.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CAPSA_VENV:-$REPO/.venv}"
cd "$REPO"

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
    step "Creating $VENV"
    python3 -m venv "$VENV" || exit 1
fi
if ! "$VENV/bin/python" -c 'import capsa, pytest, pytest_asyncio, pytest_timeout, hypothesis, mypy, mcp, deepagents, e2b, agents, playwright, python_multipart, httptools' 2>/dev/null \
    || [ ! -x "$VENV/bin/ruff" ] || [ ! -x "$VENV/bin/lint-imports" ]; then
    step "Installing dev dependencies"
    "$VENV/bin/python" -m pip install -q -e "$REPO[dev]" || exit 1
fi

step "Guest image"
"$VENV/bin/capsa" image build || exit 1

failed=()
run() {
    local name="$1"; shift
    step "$name"
    local start=$SECONDS
    if "$@"; then
        echo "$name: ok ($((SECONDS - start)) s)"
    else
        echo "$name: FAILED ($((SECONDS - start)) s)"
        failed+=("$name")
    fi
}

lint_paths=(src tests)
[ -d bench ] && lint_paths+=(bench)
run "ruff" "$VENV/bin/ruff" check "${lint_paths[@]}"
run "mypy --strict" "$VENV/bin/mypy" --strict
run "import contracts" "$VENV/bin/lint-imports"
# git keeps no empty directories, so a suite without tests yet is simply absent from a clone.
suites=()
for d in tests/unit tests/integration tests/security; do
    [ -d "$d" ] && suites+=("$d")
done
run "pytest" "$VENV/bin/pytest" "${suites[@]}" "$@"

echo
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED stages: ${failed[*]}"
    exit 1
fi
echo "all stages passed"
