"""Build capsa's container image ``localhost/capsa:<key>`` (also tagged ``localhost/capsa:dev``) without
pulling anything from a container registry, or reuse it when its inputs have not changed.

    sudo python3 scripts/build_image.py [--venv DIR] [--json] [--force]

One image, entry point ``capsa``, two roles: ``capsa control ...`` (as uid 10001, the image's USER) and
``capsa node ...`` (run as root and privileged by whoever starts it). Its only layer is a root filesystem made
here from:

1. Debian bookworm packages from the configured mirror (mmdebstrap, variant ``apt``): Python, QEMU and what
   the node shells out to (PACKAGES below);
2. capsa's wheel built from this tree, and its dependencies from PyPI, installed offline into the venv
   /opt/capsa (``capsa`` on PATH is its entry point);
3. the guest image (kernel, initramfs, root filesystem: ``capsa image build``) as a sparse bundle in
   /usr/share/capsa/images, which a node unpacks into its image cache on first start (capsa.images.bundle).
   The shipped template specs are in the wheel; the templates themselves are built by the first node that
   needs one and shared through the fleet's store.

Reproducible: every time in the root filesystem is clamped to SOURCE_DATE_EPOCH (default below), files are
sorted, machine-id and the build host's resolv.conf and hostname are not kept, .pyc files are hash-checked,
and the image is committed with that time. The root filesystem tarball is cached outside the clone as
``<cache>/oci/<key>/rootfs.tar`` (with a manifest of what it holds), keyed by its inputs: the package list,
suite and mirror, the wheel's hash, the guest image's digest, this script's hash and the epoch. A run with
unchanged inputs only looks the image up (or imports the cached tarball into an empty podman store).

Standard library only; capsa itself (the wheel, the guest image) comes from this tree through the venv's
Python. Needs root, mmdebstrap, buildah and podman (scripts/install.sh --dev).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORMAT = 1
"""Bump when the image is put together differently in a way the other inputs do not show."""
DEFAULT_EPOCH = 1704067200  # 2024-01-01T00:00:00Z
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = (
    # the control plane and the node's Python
    "python3", "python3-venv", "ca-certificates",
    # the node: VMs, disks, the storage pool, sandbox networks, template builds, the guest image bundle
    "qemu-system-x86", "qemu-utils", "btrfs-progs", "e2fsprogs", "nftables", "iproute2", "util-linux",
    "mount", "procps", "kmod", "zstd", "lz4", "cpio", "tar",
)
EXTRAS = "e2b"
"""The wheel's extras installed in the image: the E2B dialect's multipart uploads."""
CONTROL_UID = 10001
IMAGE_BUNDLE_DIR = "/usr/share/capsa/images"
REPOSITORY = "localhost/capsa"
KEEP = 3
"""Root filesystem tarballs (and their images) kept: the newest KEEP by use."""


def say(msg: str) -> None:
    print(f"build_image: {msg}", file=sys.stderr, flush=True)


class Step:
    """Prints a step when it starts and its time when it ends."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seconds = 0.0

    def __enter__(self) -> Step:
        self._t0 = time.monotonic()
        say(f"{self.name} ...")
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = round(time.monotonic() - self._t0, 1)
        say(f"{self.name}: {'failed' if exc[0] else 'done'} ({self.seconds} s)")


def run(argv: list[str], *, env: dict[str, str] | None = None, capture: bool = False,
        log: Path | None = None) -> str:
    """Run ``argv``; its output goes to ``log`` (or is returned with ``capture``); fail with its tail."""
    if log is not None:
        with log.open("ab") as out:
            proc = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
        if proc.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise SystemExit(f"build_image: {argv[0]} failed (exit {proc.returncode}); {log}:\n{tail}")
        return ""
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"build_image: {shlex.join(argv)} failed (exit {done.returncode}):\n"
                         f"{done.stderr.strip()[-3000:]}")
    return done.stdout if capture else ""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def capsa_env(epoch: int) -> dict[str, str]:
    """The environment of this tree's capsa (through the venv's Python) and of the builds."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(REPO / "src") + (f":{path}" if path else ""),
            "SOURCE_DATE_EPOCH": str(epoch), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def guest_image(python: Path, env: dict[str, str]) -> dict[str, object]:
    """The guest image's manifest, built first if the cache lacks it (``capsa image build``)."""
    out = run([str(python), "-c", "from capsa.cli.main import main; main()", "image", "build", "--json",
               "--no-template"], env=env, capture=True)
    manifest: dict[str, object] = json.loads(out)
    return manifest


def build_wheel(python: Path, env: dict[str, str], out: Path) -> Path:
    """capsa's wheel from this tree (hatchling: reproducible, times from SOURCE_DATE_EPOCH)."""
    run([str(python), "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(out), str(REPO)], env=env)
    [wheel] = sorted(out.glob("capsa-*.whl"))
    return wheel


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``path``: one build at a time per cache (the CI's and a test's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def image_exists(ref: str) -> bool:
    return subprocess.run(["podman", "image", "exists", ref], check=False).returncode == 0


def customize_hooks(wheelhouse: Path, bundle: Path, config_digest: str, record: Path) -> list[str]:
    """mmdebstrap customize hooks (shell, ``$1`` the root directory), run in order after the packages are
    installed; the last ones write what the image holds to ``record`` (outside the root)."""
    q = shlex.quote
    passwd = f"capsa:x:{CONTROL_UID}:{CONTROL_UID}:capsa control plane:/var/lib/capsa:/usr/sbin/nologin"
    check = ("from capsa.images.build import ImageConfig, config_inputs; "
             "from capsa.images.cache import digest_json; "
             "print(digest_json(config_inputs(ImageConfig.from_settings())))")
    return [
        # downloaded .debs go back to the cache (not into the image)
        'rm -f "$1"/var/cache/apt/archives/*.deb "$1"/var/cache/apt/*.bin',
        'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/log/apt/* "$1"/var/log/dpkg.log',
        'rm -f "$1"/var/cache/ldconfig/aux-cache',

        # capsa and its dependencies, offline, from the wheelhouse made on the host
        f'cp -a {q(str(wheelhouse))} "$1"/tmp/wheelhouse',
        'chroot "$1" python3 -m venv /opt/capsa',
        'chroot "$1" env PIP_DISABLE_PIP_VERSION_CHECK=1 /opt/capsa/bin/pip install -q --no-index '
        f'--no-cache-dir --find-links /tmp/wheelhouse "capsa[{EXTRAS}]"',
        'rm -rf "$1"/tmp/wheelhouse "$1"/root/.cache',
        'ln -s /opt/capsa/bin/capsa "$1"/usr/local/bin/capsa',
        # the guest image a node unpacks (capsa.images.bundle); this capsa must be the one it was built for
        f'mkdir -p "$1"{IMAGE_BUNDLE_DIR} && cp {q(str(bundle))} "$1"{IMAGE_BUNDLE_DIR}/',
        f'test "$(chroot "$1" /opt/capsa/bin/python -c {q(check)})" = {config_digest} || '
        '{ echo "the image'"'"'s capsa is not the one the guest image was built for" >&2; exit 1; }',
        # the control plane's user (written out: useradd would date its shadow entry today)
        f'echo {q(passwd)} >> "$1"/etc/passwd',
        f'echo "capsa:x:{CONTROL_UID}:" >> "$1"/etc/group',
        'echo "capsa:!*:19000::::::" >> "$1"/etc/shadow',
        'echo "capsa:!::" >> "$1"/etc/gshadow',
        f'install -d -o {CONTROL_UID} -g {CONTROL_UID} -m 0755 "$1"/var/lib/capsa',
        # nothing of the build host
        'rm -f "$1"/etc/resolv.conf "$1"/etc/hostname && : > "$1"/etc/resolv.conf',
        f"chroot \"$1\" dpkg-query -W -f '${{Package}}=${{Version}}\\n' > {q(str(record / 'packages.txt'))}",
        f'chroot "$1" /opt/capsa/bin/pip freeze --all > {q(str(record / "python.txt"))}',
    ]


def build_rootfs(*, out: Path, wheel: Path, bundle: Path, config_digest: str, python: Path,
                 env: dict[str, str], cache: Path, work: Path, record: Path) -> dict[str, float]:
    """The root filesystem tarball ``out`` (mmdebstrap's reproducible tar output)."""
    times: dict[str, float] = {}
    wheelhouse = work / "wheelhouse"
    with Step("wheelhouse (capsa and its dependencies from PyPI)") as s:
        run([str(python), "-m", "pip", "wheel", "-q", "--wheel-dir", str(wheelhouse),
             f"{wheel}[{EXTRAS}]"], env=env)
    times["wheelhouse"] = s.seconds
    debs = cache / "oci" / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    argv = [
        "mmdebstrap", "--mode=root", "--format=tar", "--variant=apt", f"--include={','.join(PACKAGES)}",
        "--aptopt=Acquire::Retries \"3\"", "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-include=/usr/share/doc/*/copyright", "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        # downloaded packages are kept in the cache between builds
        "--skip=essential/unlink",
        '--setup-hook=mkdir -p "$1"/var/cache/apt/archives/',
        f"--setup-hook=sync-in {shlex.quote(str(debs))} /var/cache/apt/archives/",
        f"--customize-hook=sync-out /var/cache/apt/archives {shlex.quote(str(debs))}",
        *(f"--customize-hook={hook}" for hook in customize_hooks(wheelhouse, bundle, config_digest, record)),
        SUITE, str(out), MIRROR,
    ]
    part = out.with_name("part-" + out.name)
    argv[-2] = str(part)
    with Step("root filesystem (mmdebstrap)") as s:
        # TMPDIR: mmdebstrap assembles the tree there before packing it (beside the cache, not in /tmp); the
        # hooks' chroot commands get no PYTHONPATH of this tree.
        clean = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        run(["unshare", "--mount", "--propagation", "private", "--", *argv],
            env={**clean, "TMPDIR": str(work)}, log=work / "mmdebstrap.log")
    times["rootfs"] = s.seconds
    part.rename(out)
    return times


def fresh_rootfs(entry: Path, inputs: dict[str, object], key: str, guest: dict[str, object], wheel: Path,
                 python: Path, env: dict[str, str], cache: Path, work: Path) -> dict[str, float]:
    """Build the root filesystem into the cache entry ``entry`` (``rootfs.tar`` + ``manifest.json``)."""
    times: dict[str, float] = {}
    record = work / "record"
    record.mkdir()
    epoch = env["SOURCE_DATE_EPOCH"]
    with Step("guest image bundle") as s:
        bundle = work / f"{guest['config_digest']}.tar.zst"
        run([str(python), "-c",
             "import sys; from pathlib import Path; from capsa.images import find_image; "
             "from capsa.images.bundle import pack_image; "
             "pack_image(find_image(), Path(sys.argv[1]), int(sys.argv[2]))",
             str(bundle), epoch], env=env)
    times["bundle"] = s.seconds
    tar = work / "rootfs.tar"
    times |= build_rootfs(out=tar, wheel=wheel, bundle=bundle, config_digest=str(guest["config_digest"]),
                          python=python, env=env, cache=cache, work=work, record=record)
    manifest = {"key": key, "inputs": inputs, "rootfs_sha256": sha256_file(tar),
                "packages": (record / "packages.txt").read_text().split(),
                "python": (record / "python.txt").read_text().split(),
                "build_seconds": times}
    staged = work / "entry"
    staged.mkdir()
    tar.rename(staged / "rootfs.tar")
    (staged / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(entry, ignore_errors=True)
    entry.parent.mkdir(parents=True, exist_ok=True)
    staged.rename(entry)
    return times


def commit_image(rootfs: Path, ref: str, key: str, epoch: int) -> None:
    """One-layer image ``ref`` from ``rootfs`` (buildah from scratch, committed at ``epoch``)."""
    ctr = run(["buildah", "from", "scratch"], capture=True).strip()
    try:
        run(["buildah", "add", "--quiet", ctr, str(rootfs), "/"])
        run(["buildah", "config",
             "--entrypoint", '["capsa"]',
             "--user", f"{CONTROL_UID}:{CONTROL_UID}", "--workingdir", "/var/lib/capsa",
             "--env", "PATH=/opt/capsa/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "--env", "CAPSA_STATE_DIR=/var/lib/capsa", "--env", f"CAPSA_IMAGE_BUNDLE_DIR={IMAGE_BUNDLE_DIR}",
             "--env", "LANG=C.UTF-8",
             "--port", "8700", "--port", "8701",
             "--label", "org.opencontainers.image.title=capsa",
             "--label", f"io.capsa.image.key={key}",
             "--created-by", "scripts/build_image.py", ctr])
        run(["buildah", "commit", "--quiet", "--timestamp", str(epoch), "--rm", ctr, ref])
    except BaseException:
        subprocess.run(["buildah", "rm", ctr], capture_output=True, check=False)
        raise


def prune(oci: Path, keep: str) -> None:
    """Keep the newest KEEP root filesystems (by use) and the images built from them."""
    dirs = sorted((d for d in oci.iterdir()
                   if d.is_dir() and len(d.name) == 16 and set(d.name) <= set("0123456789abcdef")),
                  key=lambda d: d.stat().st_mtime, reverse=True)
    for old in dirs[KEEP:]:
        if old.name != keep:
            subprocess.run(["podman", "rmi", f"{REPOSITORY}:{old.name[:12]}"], capture_output=True,
                           check=False)
            shutil.rmtree(old, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path(os.environ.get("CAPSA_VENV", REPO / ".venv")),
                        help="the virtualenv whose Python builds the wheel (default: $CAPSA_VENV or .venv)")
    parser.add_argument("--tag", default="dev", help="also tag the image localhost/capsa:TAG (default: dev)")
    parser.add_argument("--force", action="store_true", help="rebuild the root filesystem even if cached")
    parser.add_argument("--json", action="store_true", help="print what was built or reused as JSON")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("build_image: run as root (mmdebstrap, buildah, podman)")
    for tool in ("mmdebstrap", "buildah", "podman", "unshare", "zstd"):
        if shutil.which(tool) is None:
            raise SystemExit(f"build_image: {tool} is not installed (scripts/install.sh --dev)")
    t0 = time.monotonic()
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", DEFAULT_EPOCH))
    cache = Path(os.environ.get("CAPSA_CACHE_DIR", "/var/cache/capsa"))
    oci = cache / "oci"
    python = args.venv / "bin" / "python"
    env = capsa_env(epoch)
    times: dict[str, float] = {}

    oci.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tmp-", dir=oci) as tmp:
        work = Path(tmp)
        with Step("guest image (capsa image build)") as s:
            guest = guest_image(python, env)
        times["guest image"] = s.seconds
        with Step("wheel") as s:
            wheel = build_wheel(python, env, work / "dist")
        times["wheel"] = s.seconds
        inputs = {
            "format": FORMAT, "suite": SUITE, "mirror": MIRROR, "packages": sorted(PACKAGES),
            "extras": EXTRAS,
            "wheel": {"name": wheel.name, "sha256": sha256_file(wheel)},
            "guest_image": {"digest": guest["digest"], "config_digest": guest["config_digest"]},
            "script": sha256_file(Path(__file__)), "source_date_epoch": epoch,
        }
        key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
        ref = f"{REPOSITORY}:{key[:12]}"
        entry = oci / key[:16]
        rootfs = entry / "rootfs.tar"
        reused = "image"
        with locked(oci / "build.lock"):
            if args.force or not image_exists(ref):
                reused = "rootfs"
                if args.force or not rootfs.exists():
                    reused = ""
                    times |= fresh_rootfs(entry, inputs, key, guest, wheel, python, env, cache, work)
                with Step(f"image {ref} (buildah from scratch, commit)") as s:
                    commit_image(rootfs, ref, key, epoch)
                times["commit"] = s.seconds
            run(["podman", "tag", ref, f"{REPOSITORY}:{args.tag}"])
            if entry.is_dir():
                os.utime(entry)  # in use: kept by prune
            prune(oci, keep=key[:16])
    inspect = json.loads(run(["podman", "image", "inspect", ref], capture=True))[0]
    result = {"image": ref, "tag": f"{REPOSITORY}:{args.tag}", "id": inspect["Id"], "key": key,
              "reused": reused or "nothing", "size_bytes": inspect["Size"],
              "rootfs": str(rootfs), "seconds": round(time.monotonic() - t0, 1), "steps": times}
    say(f"{ref} ({inspect['Size'] / 1e6:.0f} MB, id {inspect['Id'][:12]}) in {result['seconds']} s, "
        f"reused: {result['reused']}")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
