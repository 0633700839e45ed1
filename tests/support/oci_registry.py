"""A real OCI registry for the tests, and images built in the test from scratch and pushed to it.

:func:`temporary_registry` runs Debian's ``docker-registry`` (the CNCF distribution registry 2.8) on
127.0.0.1 with a free port, plain HTTP, its storage in a temporary directory, optionally behind htpasswd
basic auth (a bcrypt hash made with the standard library's ``crypt``, which Debian's libxcrypt backs). It
waits until ``GET /v2/`` answers and stops the registry (SIGTERM, then SIGKILL) and removes the directory
afterwards.

:func:`build_image` makes an OCI layout with umoci (``init``, ``new``, ``unpack``, files put in the bundle's
rootfs, ``repack``, ``config``) and :func:`push` copies it to the registry with skopeo. Nothing is pulled from
outside: the image's tools are Debian's static busybox with its applet links.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.served import free_port

__all__ = ["ImageSpec", "Registry", "build_image", "index_images", "manifest_digest", "oci_missing_reason",
           "push", "temporary_registry"]

REGISTRY_BIN = "/usr/bin/docker-registry"
BUSYBOX = "/bin/busybox"
APPLETS = ("sh", "ls", "cat", "id", "echo", "stat", "env", "pwd", "sleep", "true")
START_TIMEOUT = 30.0
REF_NAME = "org.opencontainers.image.ref.name"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"


@dataclass(frozen=True)
class Registry:
    """A running test registry: ``host`` is ``127.0.0.1:PORT`` (the first component of a reference)."""

    host: str
    username: str | None = None
    password: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def get(self, path: str) -> tuple[int, bytes]:
        """``GET`` ``path`` on the registry (with the test credentials, when it has them)."""
        request = urllib.request.Request(self.url + path)
        if self.username is not None and self.password is not None:
            token = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                return int(answer.status), bytes(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


def oci_missing_reason() -> str | None:
    """Why the registry tests cannot run here (None when they can): a tool that is not installed."""
    for tool in (REGISTRY_BIN, "skopeo", "umoci", BUSYBOX):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/install.sh installs skopeo, umoci and, with --dev, " \
                   "docker-registry)"
    return None


def _bcrypt(password: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt  # the standard library's (removed in 3.13); libxcrypt makes $2b$ hashes

        # 16 rounds (cost 4): the registry checks the hash on every request, and this is a test password.
        hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))
    if not hashed or not hashed.startswith("$2"):
        raise RuntimeError("this libc's crypt() makes no bcrypt hash")
    return hashed


def _config(root: Path, port: int, htpasswd: Path | None) -> str:
    lines = [
        "version: 0.1",
        "log:",
        "  level: warn",
        "  accesslog:",
        "    disabled: true",
        "storage:",
        "  filesystem:",
        f"    rootdirectory: {root / 'storage'}",
        "  delete:",
        "    enabled: true",
        "http:",
        f"  addr: 127.0.0.1:{port}",
    ]
    if htpasswd is not None:
        lines += ["auth:", "  htpasswd:", "    realm: capsa-test", f"    path: {htpasswd}"]
    return "\n".join(lines) + "\n"


def _wait_up(registry: Registry, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            status, _ = registry.get("/v2/")
        except OSError:
            time.sleep(0.05)
            continue
        if status == 200:
            return
        raise RuntimeError(f"GET /v2/ answered {status}")
    raise RuntimeError(f"docker-registry did not answer within {START_TIMEOUT:.0f} s: "
                       f"{log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def temporary_registry(*, username: str | None = None, password: str | None = None) -> Iterator[Registry]:
    """A registry on a free loopback port for the ``with`` block; with ``username`` and ``password`` it asks
    for them (htpasswd basic auth, bcrypt). Stopped and its directory removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="capsa-registry-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        htpasswd = None
        if username is not None and password is not None:
            htpasswd = root / "htpasswd"
            htpasswd.write_text(f"{username}:{_bcrypt(password)}\n")
        port = free_port()
        config = root / "config.yml"
        config.write_text(_config(root, port, htpasswd))
        log = root / "registry.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT)
        registry = Registry(f"127.0.0.1:{port}", username, password)
        _wait_up(registry, proc, log)
        yield registry
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class ImageSpec:
    """What :func:`build_image` puts in an image: ``files`` maps a path in the root filesystem to its bytes
    and (mode, uid, gid); ``extra`` may change the unpacked rootfs further before it is repacked (a link,
    a device node); ``layers`` are uncompressed layer tars added verbatim after it (``umoci raw add-layer``:
    members no filesystem can hold, such as ``../`` paths); the config as ``umoci config`` sets it."""

    files: Mapping[str, tuple[bytes, int, int, int]] = field(default_factory=dict)
    busybox: bool = True
    env: Mapping[str, str] = field(default_factory=dict)
    working_dir: str | None = None
    user: str | None = None
    architecture: str | None = None
    entrypoint: Sequence[str] = ()
    cmd: Sequence[str] = ()
    extra: Callable[[Path], None] | None = None
    layers: Sequence[Path] = ()


def _umoci(*argv: str) -> None:
    subprocess.run(["umoci", *argv], check=True, capture_output=True, timeout=120)


def build_image(layout: Path, tag: str, spec: ImageSpec) -> None:
    """Build the image ``spec`` describes as ``layout:tag`` with umoci (an OCI layout made when missing):
    one layer from the bundle's rootfs, then ``spec.layers``, then the config."""
    if not (layout / "index.json").exists():
        _umoci("init", "--layout", str(layout))
    _umoci("new", "--image", f"{layout}:{tag}")
    bundle = Path(tempfile.mkdtemp(prefix="capsa-bundle-"))
    try:
        shutil.rmtree(bundle)
        _umoci("unpack", "--image", f"{layout}:{tag}", str(bundle))
        rootfs = bundle / "rootfs"
        if spec.busybox:
            (rootfs / "bin").mkdir(mode=0o755, exist_ok=True)
            shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
            for applet in APPLETS:
                (rootfs / "bin" / applet).symlink_to("busybox")
        for path, (data, mode, uid, gid) in spec.files.items():
            target = rootfs / path.lstrip("/")
            target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            target.write_bytes(data)
            os.chown(target, uid, gid)
            os.chmod(target, mode)
        if spec.extra is not None:
            spec.extra(rootfs)
        _umoci("repack", "--image", f"{layout}:{tag}", str(bundle))
    finally:
        shutil.rmtree(bundle, ignore_errors=True)
    for layer in spec.layers:
        _umoci("raw", "add-layer", "--image", f"{layout}:{tag}", str(layer))
    config = [f"--config.env={k}={v}" for k, v in spec.env.items()]
    if spec.working_dir is not None:
        config.append(f"--config.workingdir={spec.working_dir}")
    if spec.user is not None:
        config.append(f"--config.user={spec.user}")
    if spec.architecture is not None:
        config.append(f"--architecture={spec.architecture}")
    config += [f"--config.entrypoint={a}" for a in spec.entrypoint]
    config += [f"--config.cmd={a}" for a in spec.cmd]
    if config:
        _umoci("config", "--image", f"{layout}:{tag}", *config)


def _index(layout: Path) -> dict[str, Any]:
    index: dict[str, Any] = json.loads((layout / "index.json").read_text())
    return index


def _descriptor(layout: Path, tag: str) -> dict[str, Any]:
    for entry in _index(layout)["manifests"]:
        if entry.get("annotations", {}).get(REF_NAME) == tag:
            found: dict[str, Any] = entry
            return found
    raise KeyError(f"no {tag!r} in {layout}")


def manifest_digest(layout: Path, tag: str) -> str:
    """The digest of the manifest ``layout:tag`` names."""
    return str(_descriptor(layout, tag)["digest"])


def index_images(layout: Path, tag: str, tags: Sequence[str]) -> None:
    """Tag in ``layout``, as ``tag``, an image index of the images tagged ``tags``, each entry with the
    platform its config gives (no tool here writes an index of images it did not pull)."""
    manifests = []
    for member in tags:
        entry = {k: v for k, v in _descriptor(layout, member).items() if k != "annotations"}
        blob = layout / "blobs" / "sha256"
        manifest = json.loads((blob / entry["digest"].removeprefix("sha256:")).read_text())
        config = json.loads((blob / manifest["config"]["digest"].removeprefix("sha256:")).read_text())
        entry["platform"] = {"os": config["os"], "architecture": config["architecture"]}
        manifests.append(entry)
    data = json.dumps({"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": manifests}).encode()
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    index = _index(layout)
    index["manifests"].append({"mediaType": INDEX_TYPE, "digest": f"sha256:{digest}", "size": len(data),
                               "annotations": {REF_NAME: tag}})
    (layout / "index.json").write_text(json.dumps(index))


def push(layout: Path, tag: str, registry: Registry, name: str) -> str:
    """Copy ``layout:tag`` to ``registry`` as ``name:tag`` with skopeo (every image of an index); the
    manifest digest it pushed."""
    with tempfile.TemporaryDirectory(prefix="capsa-push-") as tmp:
        digest_file = Path(tmp) / "digest"
        argv = ["skopeo", "copy", "--quiet", "--all", "--dest-tls-verify=false",
                f"--digestfile={digest_file}"]
        if registry.username is not None and registry.password is not None:
            argv.append(f"--dest-creds={registry.username}:{registry.password}")  # test credentials only
        argv += [f"oci:{layout}:{tag}", f"docker://{registry.host}/{name}:{tag}"]
        subprocess.run(argv, check=True, capture_output=True, timeout=120)
        return digest_file.read_text().strip()
