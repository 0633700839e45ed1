"""Pull an image from its registry into a local OCI layout with skopeo.

The reference is first resolved to one manifest (``skopeo inspect --raw``; from an image index, the
linux/amd64 entry), whose size (config and layers, compressed) is checked against the limit before anything
else is fetched; then that manifest is copied *by digest* (``skopeo copy docker://NAME@DIGEST oci:DIR:TAG``),
so what was measured is what arrives: skopeo checks every blob against the digests the manifest names.

Credentials go to skopeo in a 0600 auth file in a private directory beside the layout, never on its
command line, and skopeo runs with that directory as its home and temporary directory, so it reads no
credentials of the host's user and leaves no partial blob behind. Failures are :class:`CapsaError` with
a stable code (``image_not_found`` 404, ``registry_auth_failed`` 403, ``registry_unreachable`` 502,
``image_pull_failed`` 502, ``image_pull_timeout`` 504, ``image_too_large`` 413,
``image_platform_unsupported`` 400); their messages carry skopeo's reason with any credential taken
out. Blocking: an async caller runs it in a worker thread.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsa.common.errors import CapsaError
from capsa.node.templates.oci.reference import ImageReference

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_TIMEOUT", "PulledImage", "RegistryCredentials", "pull_image"]

DEFAULT_TIMEOUT = 1800.0  # seconds, for the whole pull
DEFAULT_MAX_BYTES = 8 << 30  # compressed config and layers of the one manifest pulled
MAX_MANIFEST_BYTES = 4 << 20  # the distribution registry's own bound on a manifest
PLATFORM = {"os": "linux", "architecture": "amd64"}
_DIGEST = re.compile(r"sha256:[a-f0-9]{64}")

_INDEX_TYPES = {"application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json"}
_PASSED_ENV = ("PATH", "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
_NOT_FOUND = ("manifest unknown", "name unknown", "not found")
_AUTH = ("unauthorized", "authentication required", "denied")
_UNREACHABLE = ("connection refused", "no such host", "i/o timeout", "network is unreachable",
                "no route to host", "connection reset", "server gave http response to https client",
                "tls:", "x509:", "pinging container registry")


@dataclass(frozen=True)
class RegistryCredentials:
    """A registry user name and password (or token); the password is never shown by ``repr``."""

    username: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class PulledImage:
    """An image in the OCI layout ``layout`` under ``tag``: ``digest`` is the registry's manifest digest (the
    one ``NAME@DIGEST`` pulls again), ``layout_digest`` the manifest's digest in the layout (skopeo converts
    a Docker schema 2 manifest to OCI, which changes it), ``size`` the compressed bytes of config and
    layers."""

    reference: ImageReference
    layout: Path
    tag: str
    digest: str
    layout_digest: str
    size: int


class _Skopeo:
    """skopeo runs in a private temporary directory holding the auth file; ``redact`` takes any credential out
    of a text before it goes into an error."""

    def __init__(self, work: Path, registry: str, credentials: RegistryCredentials | None, insecure: bool,
                 deadline: float) -> None:
        self.work = work
        self.insecure = insecure
        self.deadline = deadline
        self.authfile = work / "auth.json"
        auths: dict[str, Any] = {}
        self._secrets: list[str] = []
        if credentials is not None:
            token = base64.b64encode(f"{credentials.username}:{credentials.password}".encode()).decode()
            auths[registry] = {"auth": token}
            self._secrets = [s for s in (token, credentials.password) if s]
        fd = os.open(self.authfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"auths": auths}, out)
        self.env = {k: v for k, v in os.environ.items() if k in _PASSED_ENV}
        self.env.update(HOME=str(work), TMPDIR=str(work), XDG_RUNTIME_DIR=str(work),
                        XDG_CONFIG_HOME=str(work / "config"), REGISTRY_AUTH_FILE=str(self.authfile))

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def run(self, argv: list[str], what: str, reference: ImageReference) -> bytes:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _timeout(reference)
        try:
            proc = subprocess.run(["skopeo", *argv], capture_output=True, env=self.env, cwd=self.work,
                                  stdin=subprocess.DEVNULL, timeout=left, check=False)
        except subprocess.TimeoutExpired:
            raise _timeout(reference) from None
        except FileNotFoundError:
            raise CapsaError("skopeo is not installed on this node (scripts/install.sh installs it)",
                             code="image_pull_failed", status=502) from None
        if proc.returncode != 0:
            raise _classify(reference, what, self.redact(_reason(proc.stderr)), bool(self._secrets))
        return proc.stdout


def _timeout(reference: ImageReference) -> CapsaError:
    return CapsaError(f"pulling {reference} took longer than its time limit", code="image_pull_timeout",
                      status=504)


def _reason(stderr: bytes) -> str:
    """skopeo's reason from its log line (``msg="..."``), or its last line of output."""
    text = stderr.decode(errors="replace").strip()
    found = re.findall(r'msg="((?:[^"\\]|\\.)*)"', text)
    if found:
        return str(found[-1]).replace('\\"', '"').replace("\\\\", "\\")[-600:]
    return (text.splitlines() or ["no output"])[-1][-600:]


def _classify(reference: ImageReference, what: str, reason: str, logged_in: bool) -> CapsaError:
    low = reason.lower()
    if any(s in low for s in _UNREACHABLE):
        hint = (" (a registry without TLS needs --insecure-registry)"
                if "http response to https client" in low else "")
        return CapsaError(f"cannot reach the registry {reference.registry}{hint}: {reason}",
                          code="registry_unreachable", status=502)
    if any(s in low for s in _AUTH):
        refused = "refused the credentials" if logged_in else "asks for credentials"
        return CapsaError(f"the registry {reference.registry} {refused} for {reference.name}: {reason}",
                          code="registry_auth_failed", status=403)
    if any(s in low for s in _NOT_FOUND):
        return CapsaError(f"no image {reference} in its registry: {reason}", code="image_not_found",
                          status=404)
    return CapsaError(f"{what} {reference} failed: {reason}", code="image_pull_failed", status=502)


def _manifest(skopeo: _Skopeo, reference: ImageReference, target: str,
              expected: str | None) -> tuple[str, dict[str, Any]]:
    """The digest and document of the manifest ``target`` names (checked against ``expected``)."""
    argv = ["inspect", "--raw", f"--authfile={skopeo.authfile}"]
    if skopeo.insecure:
        argv.append("--tls-verify=false")
    raw = skopeo.run([*argv, f"docker://{target}"], "reading the manifest of", reference)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CapsaError(f"the manifest of {reference} is larger than {MAX_MANIFEST_BYTES} bytes",
                         code="image_pull_failed", status=502)
    digest = f"sha256:{hashlib.sha256(raw).hexdigest()}"
    if expected is not None and digest != expected:
        raise CapsaError(f"the registry answered {target} with a manifest of digest {digest}",
                         code="image_pull_failed", status=502)
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise CapsaError(f"the registry answered {reference} with a manifest that is not a JSON object",
                         code="image_pull_failed", status=502)
    return digest, doc


def _platform_entry(reference: ImageReference, index: dict[str, Any]) -> str:
    for entry in index.get("manifests") or []:
        platform = entry.get("platform") if isinstance(entry, dict) else None
        if isinstance(platform, dict) and all(platform.get(k) == v for k, v in PLATFORM.items()):
            digest = entry.get("digest")
            if isinstance(digest, str) and _DIGEST.fullmatch(digest):
                return digest
    raise CapsaError(f"{reference} has no linux/amd64 image", code="image_platform_unsupported", status=400)


def _size(reference: ImageReference, manifest: dict[str, Any]) -> int:
    try:
        sizes = [manifest["config"]["size"], *(layer["size"] for layer in manifest["layers"])]
    except (KeyError, TypeError):
        raise CapsaError(f"the manifest of {reference} names no config or layers", code="image_pull_failed",
                         status=502) from None
    if not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise CapsaError(f"the manifest of {reference} gives a blob a bad size", code="image_pull_failed",
                         status=502)
    return sum(sizes)


def pull_image(reference: ImageReference, layout: Path, *, tag: str = "image",
               credentials: RegistryCredentials | None = None, insecure: bool = False,
               timeout: float = DEFAULT_TIMEOUT, max_bytes: int = DEFAULT_MAX_BYTES) -> PulledImage:
    """Pull ``reference`` into a new OCI layout at ``layout`` (which must not exist) as ``tag``.

    ``insecure`` allows a registry without TLS or with an unverified certificate; ``credentials`` log in to
    the reference's registry; ``timeout`` bounds the whole pull; an image whose config and layers are larger
    than ``max_bytes`` is refused before its layers are fetched. On any failure the layout is removed. The
    layout's parent holds skopeo's private work directory (with the auth file) while it runs."""
    if layout.exists() or layout.is_symlink():
        raise CapsaError(f"{layout} exists already", code="image_pull_failed", status=500)
    if not layout.parent.is_dir():
        raise CapsaError(f"no directory {layout.parent} to pull into", code="image_pull_failed", status=500)
    if ":" in str(layout):
        raise CapsaError(f"an OCI layout path has no ':' ({layout})", code="image_pull_failed", status=500)
    deadline = time.monotonic() + timeout
    # Beside the layout (the node's storage, not a tmpfs), removed whatever happens.
    work = Path(tempfile.mkdtemp(prefix=".pull-", dir=layout.parent))
    try:
        skopeo = _Skopeo(work, reference.registry, credentials, insecure, deadline)
        target = f"{reference.name}@{reference.digest}" if reference.digest else str(reference)
        digest, manifest = _manifest(skopeo, reference, target, reference.digest)
        if manifest.get("mediaType") in _INDEX_TYPES or "manifests" in manifest:
            entry = _platform_entry(reference, manifest)
            digest, manifest = _manifest(skopeo, reference, f"{reference.name}@{entry}", entry)
        size = _size(reference, manifest)
        if size > max_bytes:
            raise CapsaError(f"{reference} is {size} bytes compressed, over the limit of {max_bytes}",
                             code="image_too_large", status=413)
        digest_file = work / "digest"
        argv = ["copy", "--quiet", f"--src-authfile={skopeo.authfile}", f"--digestfile={digest_file}"]
        if insecure:
            argv.append("--src-tls-verify=false")
        skopeo.run([*argv, f"docker://{reference.name}@{digest}", f"oci:{layout}:{tag}"], "pulling",
                   reference)
        layout_digest = digest_file.read_text().strip()
        return PulledImage(reference.pinned(digest), layout, tag, digest, layout_digest, size)
    except BaseException:
        shutil.rmtree(layout, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
