#!/usr/bin/env bash
# Install capsa on a fresh Debian 12 (bookworm) machine and run the main job end to end.
#
#   sudo scripts/install.sh              # system packages, venv, guest image, then the demo
#   sudo scripts/install.sh --no-demo    # everything except the demo
#   sudo scripts/install.sh --no-demo --dev   # and the test tools in the same pip pass (what CI uses)
#   sudo scripts/install.sh --no-demo --link  # and /usr/local/bin/capsa, which deploy/systemd's units run
#
# Idempotent: packages already installed are not touched, the venv is reused, and the guest image
# comes from the cache (/var/cache/capsa, or $CAPSA_CACHE_DIR) when its inputs have not changed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CAPSA_VENV:-$REPO/.venv}"
DEMO=1
DEV=0
LINK=0
EXTRAS=""

usage() {
    sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    echo "options: --no-demo   skip the final demo run"
    echo "         --dev       also install the development extras (tests, linters) in the same pass"
    echo "         --venv DIR  virtualenv to create/use (default: \$CAPSA_VENV or $REPO/.venv)"
    echo "         --link      make /usr/local/bin/capsa a link to the venv's capsa (the systemd units run it)"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --no-demo) DEMO=0 ;;
        --dev) EXTRAS="[dev]"; DEV=1 ;;
        --link) LINK=1 ;;
        --venv) [ $# -ge 2 ] || { echo "install.sh: --venv needs a directory" >&2; exit 2; }; VENV="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option: $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
die() { echo "install.sh: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (the image build uses debootstrap; VMs and networking need root)"
[ -r /etc/debian_version ] || die "this script supports Debian 12 (bookworm) only"
case "$(cat /etc/debian_version)" in
    12*|bookworm*) ;;
    *) echo "install.sh: warning: tested on Debian 12; found Debian $(cat /etc/debian_version)" >&2 ;;
esac

PACKAGES=(
    qemu-system-x86 qemu-utils debootstrap busybox-static e2fsprogs zstd lz4 cpio btrfs-progs nftables
    iproute2 procps curl util-linux debian-archive-keyring ca-certificates python3 python3-venv python3-dev gcc
    postgresql
    skopeo umoci
)
# skopeo pulls a template's OCI image from its registry into an OCI layout, and umoci unpacks the layout's
# layers into a root filesystem (src/capsa/node/templates/oci/): whiteouts, hard links, device nodes and
# paths that leave the root are the tool's job, not a tar loop of ours.
# The tests' real S3 server (OpenStack Swift with its s3api middleware, tests/support/s3_server.py), and
# what builds and runs the container image without a registry (scripts/build_image.py,
# tests/integration/test_container_fleet.py).
# runc: crun (podman's default) refuses hosts with a hybrid cgroup hierarchy, as the CI machines have.
[ "$DEV" = 1 ] && PACKAGES+=(swift-proxy swift-object swift-container swift-account
                             mmdebstrap buildah podman runc)
# systemd-analyze verifies deploy/systemd's units (tests/unit/test_deploy_systemd.py).
[ "$DEV" = 1 ] && PACKAGES+=(systemd)
# The tests' real OCI registry (Debian's package of the CNCF distribution registry, started by
# tests/support/oci_registry.py on a free loopback port, one per test module).
[ "$DEV" = 1 ] && PACKAGES+=(docker-registry)

step "System packages"
missing=()
for p in "${PACKAGES[@]}"; do
    status="$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)"
    [ "${status:0:2}" = "ii" ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    echo "all ${#PACKAGES[@]} packages already installed"
fi
# docker-registry's package enables its own service on install and starts it where services may start (the
# stock config listens on :5000 on every address): the tests start their own registries, so the package's
# is disabled and stopped, and a machine has no registry listening after this script.
if [ "$DEV" = 1 ]; then
    systemctl disable --quiet docker-registry
    if [ -d /run/systemd/system ]; then
        systemctl stop docker-registry
    elif service docker-registry status >/dev/null 2>&1; then
        service docker-registry stop
    fi
fi

step "Python environment ($VENV)"
# pip's downloads are kept beside the image cache, so a venv made anew (a changed pyproject.toml) reuses them.
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-${CAPSA_CACHE_DIR:-/var/cache/capsa}/pip}"
fresh=0
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    fresh=1
fi
# One pip pass: skipped when this venv already holds what pyproject.toml's [project] asks for (the key of
# scripts/deps_key.py: tool settings do not count), installed from this checkout (the stamp records both);
# a reused venv and a new clone only re-point the editable install.
stamp="$VENV/.capsa-install"
want="$(python3 "$REPO/scripts/deps_key.py" "$REPO/pyproject.toml") $EXTRAS"
have="$(head -n1 "$stamp" 2>/dev/null || true)"
if [ "$fresh" -eq 1 ] || [ "$have" != "$want" ]; then
    "$VENV/bin/python" -m pip install -q -e "$REPO$EXTRAS"
    printf '%s\n%s\n' "$want" "$REPO" > "$stamp"
elif [ "$(sed -n 2p "$stamp")" != "$REPO" ]; then
    "$VENV/bin/python" -m pip install -q --no-deps -e "$REPO"
    printf '%s\n%s\n' "$want" "$REPO" > "$stamp"
else
    echo "up to date (pyproject.toml's [project] unchanged, installed from $REPO)"
fi
"$VENV/bin/capsa" --version

step "Guest image (kernel, initramfs, root filesystem)"
"$VENV/bin/capsa" image build

if [ "$DEMO" -eq 1 ]; then
    step "Main job"
    # ---- MAIN JOB: capsa serve + the SDK quick start (examples/quickstart.py), see scripts/demo.sh ----
    CAPSA_VENV="$VENV" "$REPO/scripts/demo.sh"
fi

if [ "$LINK" -eq 1 ]; then
    step "Command link"
    # deploy/systemd/capsa-*.service run /usr/local/bin/capsa; a file there that is not a link is not ours.
    if [ -e /usr/local/bin/capsa ] && [ ! -L /usr/local/bin/capsa ]; then
        die "/usr/local/bin/capsa exists and is not a link: not replacing it"
    fi
    ln -sfn "$(cd "$VENV" && pwd)/bin/capsa" /usr/local/bin/capsa
    echo "/usr/local/bin/capsa -> $(readlink /usr/local/bin/capsa)"
fi

step "Done"
echo "capsa is installed in $VENV (command: $VENV/bin/capsa)"
