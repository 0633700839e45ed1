"""Building a custom template from a spec: a build VM with the packages in, customised, snapshotted.

The build VM has no network. Packages are fetched on the host:

* apt: the host's apt resolves the packages against the *guest's* dpkg status file (a private
  ``Dir::State::status``) and downloads only what the guest lacks (kept in a cache beside the images). For
  a spec built on ``base`` they are installed on the host into a copy of the image's root filesystem
  (:mod:`capsa.node.templates.rootfs`: natively, minutes faster than under TCG) and the build VM cold-boots
  from that copy; on another template, the build VM restores it and installs them with ``dpkg -i``.
  Host and guest are the same Debian suite (bookworm).
* pip: the host's pip downloads wheels for the guest's Python (3.11, manylinux x86_64, binary only) plus
  pip itself; the guest runs pip from its wheel with ``--no-index``.

Then files are written, commands run (with the spec's env), the disk is synced and the VM snapshotted into
the template store. The build VM is destroyed whatever happens.

A spec with ``network: true`` makes a template with a NIC (MAC :data:`NET_TEMPLATE_MAC`), which is what
sessions with an egress policy restore from: its build VM is a cold boot of the image on a throwaway
network (a namespace with the sandbox firewall and no broker, so nothing leaves it either) with the guest's
trust store prepared as for ``base-net``. Processes a command leaves running (``setsid … &``) are in the
snapshot, running, in every sandbox restored from it (``templates/browser.yaml``: Chromium).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from capsa.common.errors import CapsaError
from capsa.node.egress.trust_store import TrustStore
from capsa.node.guestlink.identity import bind_identity
from capsa.node.net.sandbox_net import SandboxNet
from capsa.node.runtime.base import RamMode, Sandbox, VMSpec
from capsa.node.storage.filecopy import copy_file
from capsa.node.templates.rootfs import download_debs, guest_dpkg_status, install_debs
from capsa.node.templates.store import BASE, NET_TEMPLATE_MAC, Template, TemplateStore, check_template_name

__all__ = ["BuildNetwork", "FileSpec", "TemplateBuildError", "TemplateSpec", "build_template", "load_spec",
           "parse_spec", "remove_stale_work", "spec_record"]

Progress = Callable[[str], None]
BuildNetwork = Callable[[], AbstractAsyncContextManager[SandboxNet]]
"""A throwaway network for the build VM of a ``network: true`` spec
(:meth:`capsa.node.egress.node_egress.NodeEgress.throwaway_network`)."""

_PKG_RE = r"^[a-z0-9][a-z0-9+.-]{0,127}(=[A-Za-z0-9.+:~-]{1,64})?$"
_PIP_RE = r"^[A-Za-z0-9][A-Za-z0-9._\[\],-]{0,127}(\s*(==|>=|<=|~=|!=|<|>)\s*[A-Za-z0-9.*+!-]{1,64})?$"
_GUEST_WORK = "/var/tmp/capsa-template-build"
_COMMAND_TIMEOUT = 1800.0


class TemplateBuildError(CapsaError):
    code = "template_build_failed"
    status = 500


class FileSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: Annotated[str, Field(pattern=r"^/[^\x00]{0,4095}$")]
    content: str | None = None
    source: str | None = None
    """A host file, relative to the spec file."""
    mode: Annotated[str, Field(pattern=r"^[0-7]{3,4}$")] = "0644"

    @model_validator(mode="after")
    def _one_source(self) -> FileSpec:
        if (self.content is None) == (self.source is None):
            raise ValueError("give exactly one of content or source")
        return self


class TemplateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")]
    base: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")] = BASE
    memory_mib: Annotated[int, Field(ge=64, le=65536)] | None = None
    vcpus: Annotated[int, Field(ge=1, le=64)] | None = None
    apt: list[Annotated[str, Field(pattern=_PKG_RE)]] = Field(default_factory=list, max_length=500)
    pip: list[Annotated[str, Field(pattern=_PIP_RE)]] = Field(default_factory=list, max_length=500)
    files: list[FileSpec] = Field(default_factory=list, max_length=1000)
    commands: list[Annotated[str, Field(min_length=1, max_length=65536)]] = Field(default_factory=list,
                                                                                   max_length=500)
    env: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")],
              Annotated[str, Field(max_length=4096)]] = Field(default_factory=dict, max_length=256)
    network: bool = False
    """Snapshot it with a NIC, so sessions with an egress policy can use it (a cold-booted build VM)."""
    ram: Literal["shared", "private"] = "shared"
    """How its sandboxes hold their RAM. ``shared``: a file on the storage pool, so pausing or branching
    one is a reflink; ``private``: anonymous memory copied on write from the template (no write-back to
    the pool while it runs, a snapshot writes the whole RAM). Busy guests such as browsers want private."""

    @model_validator(mode="after")
    def _not_base(self) -> TemplateSpec:
        if self.name == BASE:
            raise ValueError("'base' is the node's own template and cannot be built from a spec")
        if self.network and self.base != BASE:
            raise ValueError("a template with network: true is built on the image itself (base: base)")
        return self


def load_spec(path: Path) -> tuple[TemplateSpec, dict[str, bytes]]:
    """Parse a YAML spec and read the host files it names; returns the spec and those files' bytes."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CapsaError(f"cannot read template spec {path}: {exc}", code="bad_request", status=400) from None
    return parse_spec(text, path)


def parse_spec(text: str, path: Path) -> tuple[TemplateSpec, dict[str, bytes]]:
    """:func:`load_spec` of a spec's text (``path``: where it is, for its host files and messages)."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CapsaError(f"cannot read template spec {path}: {exc}", code="bad_request", status=400) from None
    try:
        spec = TemplateSpec.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise CapsaError(f"invalid template spec {path}: {where}: {err['msg']}", code="bad_request",
                         status=400) from None
    sources: dict[str, bytes] = {}
    for f in spec.files:
        if f.source is not None:
            src = (path.parent / f.source).resolve()
            try:
                sources[f.source] = src.read_bytes()
            except OSError as exc:
                raise CapsaError(f"template spec {path}: cannot read {f.source}: {exc.strerror}",
                                 code="bad_request", status=400) from None
    return spec, sources


def spec_record(spec: TemplateSpec, sources: dict[str, bytes]) -> dict[str, Any]:
    """The spec as stored in the template record: host files by their hash, not their content."""
    import hashlib

    body = spec.model_dump(mode="json")
    if body["ram"] == "shared":
        del body["ram"]  # the default is left out, so records (and cache keys) made before it stay valid
    for f in body["files"]:
        if f["source"] is not None:
            f["source_sha256"] = hashlib.sha256(sources[f["source"]]).hexdigest()
        if f["content"] is not None and len(f["content"]) > 4096:
            f["content_sha256"] = hashlib.sha256(f["content"].encode()).hexdigest()
            f["content"] = None
    return body


# -- host-side package downloads ---------------------------------------------------------------------


def _run(argv: list[str], what: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-800:]
        raise TemplateBuildError(f"{what} failed: {tail}")
    return proc.stdout


def download_wheels(requirements: list[str], dest: Path) -> list[Path]:
    """Wheels for the guest's CPython 3.11 on x86_64 (binary only), and pip itself to install them."""
    dest.mkdir(parents=True)
    platform = ["--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64",
                "--platform", "linux_x86_64", "--platform", "any"]
    base = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
            "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
            "--abi", "abi3", "--abi", "none", *platform, "-d", str(dest)]
    _run([*base, "pip"], "pip download of pip")
    _run([*base, "--", *requirements], "pip download of " + " ".join(requirements))
    return sorted(dest.glob("*.whl"))


# -- the build ---------------------------------------------------------------------------------------


async def _exec(sb: Sandbox, cmd: str, what: str, env: dict[str, str] | None = None) -> str:
    res = await sb.guest.exec(["sh", "-c", cmd], env=env, timeout=_COMMAND_TIMEOUT)
    if res.exit_code != 0 or res.timed_out:
        tail = (res.stderr or res.stdout)[-800:].decode(errors="replace")
        reason = "timed out" if res.timed_out else f"exited {res.exit_code}"
        raise TemplateBuildError(f"{what} {reason}: {tail}")
    return res.stdout.decode(errors="replace")


async def _upload(sb: Sandbox, files: list[Path], guest_dir: str) -> list[str]:
    await sb.guest.mkdir(guest_dir, parents=True)
    out = []
    for f in files:
        target = f"{guest_dir}/{f.name}"
        await sb.guest.write_file(target, await asyncio.to_thread(f.read_bytes), mode=0o644)
        out.append(target)
    return out


async def build_template(store: TemplateStore, spec: TemplateSpec, sources: dict[str, bytes],
                         progress: Progress | None = None, *, network: BuildNetwork | None = None,
                         trust: TrustStore | None = None, package_cache: Path | None = None) -> Template:
    """Build ``spec`` into a template (replacing one of the same name and size once it is complete);
    ``network`` is required by a spec with ``network: true``; ``package_cache``: where downloaded .deb
    files are kept (default: beside the template cache, else nowhere)."""
    say = progress or (lambda _m: None)
    check_template_name(spec.name)
    if spec.network and network is None:
        raise TemplateBuildError(f"template {spec.name} has network: true and this build has no egress "
                                 "service for its throwaway network")
    if spec.network or (spec.apt and spec.base == BASE):
        # A cold boot, from a copy of the image's root filesystem with the packages installed on the host.
        memory_mib = spec.memory_mib or store.base_memory_mib
        vcpus = spec.vcpus or store.base_vcpus
        nic = "with a NIC " if spec.network else ""
        async with _prepared_rootfs(store, spec, say, _package_cache(store, package_cache)) as rootfs, \
                _build_network(network if spec.network else None) as net:
            say(f"cold-booting a build VM {nic}({memory_mib} MiB, {vcpus} vCPU)")
            vm_spec = VMSpec(image=store.image, memory_mib=memory_mib, vcpus=vcpus, rootfs=rootfs,
                             network=None if net is None else dataclasses.replace(net, mac=NET_TEMPLATE_MAC),
                             labels={"template-build": spec.name}, private_ram=True)
            sandbox = await store.runtime.boot(vm_spec)
            if net is not None:
                try:
                    # The image's own CA bundle, kept so that a session's CA install is a file write.
                    await _exec(sandbox, shlex_join((trust or TrustStore()).prepare_script()), "trust store")
                except BaseException:
                    with contextlib.suppress(Exception):
                        await store.runtime.destroy(sandbox)
                    raise
            return await _customise(store, sandbox, spec, sources, say, apt_done=True, restore_spec=vm_spec)
    base = await store.resolve(spec.base, spec.memory_mib, spec.vcpus)
    if spec.base != BASE and (spec.memory_mib, spec.vcpus) != (None, None) and \
            (base.memory_mib, base.vcpus) != (spec.memory_mib or base.memory_mib, spec.vcpus or base.vcpus):
        raise CapsaError("a template built on a custom base keeps the base's size", code="template_mismatch",
                         status=409)
    say(f"restoring {base.name} ({base.memory_mib} MiB, {base.vcpus} vCPU) into a build VM")
    m = base.snapshot.manifest
    vm_spec = VMSpec(image=store.image, memory_mib=m.memory_mib, vcpus=m.vcpus,
                     labels={"template-build": spec.name})
    sandbox = await store.runtime.restore(base.snapshot, vm_spec, ram_mode=RamMode.CLONE)
    return await _customise(store, sandbox, spec, sources, say, restore_spec=vm_spec,
                            package_cache=_package_cache(store, package_cache))


@contextlib.asynccontextmanager
async def _build_network(network: BuildNetwork | None) -> AsyncIterator[SandboxNet | None]:
    """The throwaway network of a ``network: true`` build, or none."""
    if network is None:
        yield None
        return
    async with network() as net:
        yield net


def _package_cache(store: TemplateStore, given: Path | None) -> Path | None:
    if given is None and store.cache is not None:
        return store.cache.root.parent / "template-debs"
    return given


@contextlib.asynccontextmanager
async def _prepared_rootfs(store: TemplateStore, spec: TemplateSpec, say: Progress,
                           package_cache: Path | None) -> AsyncIterator[Path | None]:
    """A copy of the image's root filesystem with ``spec.apt`` installed (None without packages: boot the
    image's own), in a work directory of the template store, removed afterwards (the VM's disk is a copy)."""
    if not spec.apt:
        yield None
        return
    work = store.root / f".build-rootfs-{secrets.token_hex(6)}"
    work.mkdir(mode=0o700)
    try:
        rootfs = work / "rootfs.ext4"
        started = time.monotonic()
        await asyncio.to_thread(copy_file, store.image.rootfs, rootfs, cow=True, mode=0o600)
        status = await asyncio.to_thread(guest_dpkg_status, rootfs)
        say(f"apt: resolving and downloading {len(spec.apt)} package(s) on the host")
        with tempfile.TemporaryDirectory(prefix="capsa-tpl-") as tmp:
            archives = package_cache or Path(tmp) / "archives"
            debs = await asyncio.to_thread(download_debs, spec.apt, status, Path(tmp), archives)
            if debs:
                say(f"apt: installing {len(debs)} .deb file(s) into the root filesystem on the host")
                await asyncio.to_thread(install_debs, rootfs, debs, Path(tmp))
        say(f"apt: done in {time.monotonic() - started:.1f} s")
        yield rootfs
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)


async def _customise(store: TemplateStore, sandbox: Sandbox, spec: TemplateSpec, sources: dict[str, bytes],
                     say: Progress, *, apt_done: bool = False, package_cache: Path | None = None,
                     restore_spec: VMSpec | None = None) -> Template:
    """Install, write and run what the spec says in the build VM, then store it (destroyed either way);
    ``restore_spec``: how to restore the build VM, to move its private RAM into a file when stored."""
    try:
        await bind_identity(sandbox.guest, hostname=f"build-{spec.name}")
        with tempfile.TemporaryDirectory(prefix="capsa-tpl-") as tmp:
            work = Path(tmp)
            if spec.apt and not apt_done:
                say(f"apt: resolving and downloading {len(spec.apt)} package(s) on the host")
                status = await sandbox.guest.read_file("/var/lib/dpkg/status")
                debs = await asyncio.to_thread(download_debs, spec.apt, status, work,
                                               package_cache or work / "archives")
                if debs:
                    say(f"apt: installing {len(debs)} .deb file(s) in the build VM")
                    await _upload(sandbox, debs, f"{_GUEST_WORK}/debs")
                    await _exec(sandbox, f"dpkg -i {_GUEST_WORK}/debs/*.deb", "dpkg -i",
                                env={"DEBIAN_FRONTEND": "noninteractive"})
            if spec.pip:
                say(f"pip: downloading {len(spec.pip)} requirement(s) on the host")
                wheels = await asyncio.to_thread(download_wheels, spec.pip, work / "pip")
                pip_wheel = next((w for w in wheels if w.name.startswith("pip-")), None)
                if pip_wheel is None:
                    raise TemplateBuildError("pip download did not produce a pip wheel")
                say(f"pip: installing {len(wheels) - 1} wheel(s) in the build VM")
                await _upload(sandbox, wheels, f"{_GUEST_WORK}/wheels")
                reqs = " ".join(_shell_quote(r) for r in spec.pip)
                await _exec(sandbox, f"python3 {_GUEST_WORK}/wheels/{pip_wheel.name}/pip install --no-index "
                                     f"--find-links {_GUEST_WORK}/wheels --break-system-packages "
                                     f"--root-user-action=ignore --disable-pip-version-check {reqs}",
                            "pip install")
        await _exec(sandbox, f"rm -rf {_GUEST_WORK}", "cleanup")
        for f in spec.files:
            data = f.content.encode() if f.content is not None else sources[f.source or ""]
            say(f"file {f.path}")
            parent = f.path.rsplit("/", 1)[0] or "/"
            await sandbox.guest.mkdir(parent, parents=True)
            await sandbox.guest.write_file(f.path, data, mode=int(f.mode, 8))
        for i, cmd in enumerate(spec.commands, 1):
            say(f"command {i}/{len(spec.commands)}: {_short(cmd)}")
            await _exec(sandbox, cmd, f"command {i}", env=dict(spec.env))
    except BaseException:
        with contextlib.suppress(Exception):
            await store.runtime.destroy(sandbox)
        raise
    return await store.store(spec.name, sandbox, spec=spec_record(spec, sources), progress=say,
                             restore_spec=restore_spec)


def _short(cmd: str, limit: int = 60) -> str:
    line = cmd.strip().splitlines()[0] if cmd.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def shlex_join(argv: list[str]) -> str:
    return " ".join(_shell_quote(a) for a in argv)


def _shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def remove_stale_work(root: Path, older_than: float = 3600.0) -> None:
    """Drop half-built template directories a crashed build left behind (not a build still running)."""
    now = time.time()
    for p in root.glob(".build-*"):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > older_than:
                shutil.rmtree(p, ignore_errors=True)
