"""Images pulled from a real registry and unpacked (capsa.node.templates.oci), the first layer of issue 32,
against Debian's docker-registry started by the test, holding images built here from scratch with umoci
(tests/support/oci_registry.py): no VM, no pull from outside.

Proves: an image is pulled by tag and by digest with the digest skopeo pushed, its config reads back what
was set and its files unpack with their modes and owners; credentials reach skopeo only in a 0600 auth file
(never on its command line) and appear in no error; a hostile layer changes nothing outside the directory
it is unpacked into; a bad reference, a missing tag or repository, wrong or missing credentials, a registry
that is down or speaks plain HTTP, a size or time limit each give their stable code and leave no layout.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capsa.common.errors import CapsaError
from capsa.node.templates.oci.config import read_image_config
from capsa.node.templates.oci.pull import PulledImage, RegistryCredentials, pull_image
from capsa.node.templates.oci.reference import parse_reference
from capsa.node.templates.oci.unpack import unpack_image
from tests.support.oci_registry import (
    ImageSpec,
    Registry,
    build_image,
    index_images,
    manifest_digest,
    oci_missing_reason,
    push,
    temporary_registry,
)
from tests.support.served import free_port

pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(300),
]

USER, PASSWORD = "capsa-puller", "pw-9c1f7e2d-never-shown"
CREDS = RegistryCredentials(USER, PASSWORD)
SCRIPT = b"#!/bin/sh\necho \"$GREETING from $(pwd) as $(id -u)\"\n"
SPEC = ImageSpec(
    files={"/app/hello.txt": (b"hello from the image\n", 0o640, 1000, 1001),
           "/usr/local/bin/greet": (SCRIPT, 0o755, 0, 0)},
    env={"PATH": "/usr/local/bin:/bin", "GREETING": "hi there=1"},
    working_dir="/app", user="1000:1001", entrypoint=["/usr/local/bin/greet"], cmd=["--loud", "x y"])


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    """One registry behind basic auth for the module (tools missing: the tests fail, never skip)."""
    reason = oci_missing_reason()
    if reason:
        pytest.fail(f"no OCI tools for the registry tests: {reason}")
    with temporary_registry(username=USER, password=PASSWORD) as reg:
        yield reg


@pytest.fixture(scope="module")
def pushed(registry: Registry) -> Iterator[str]:
    """``team/tool:v1`` (:data:`SPEC`) built here and pushed to the registry: the digest skopeo pushed."""
    with tempfile.TemporaryDirectory(prefix="capsa-oci-build-") as tmp:
        layout = Path(tmp) / "layout"
        build_image(layout, "v1", SPEC)
        yield push(layout, "v1", registry, "team/tool")


@pytest.fixture
def work() -> Iterator[Path]:
    """A directory of root's alone (0700) for layouts and root filesystems, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="capsa-oci-"))
    yield path
    shutil.rmtree(path)


@pytest.fixture
def skopeo_calls(work: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``skopeo`` first on PATH that records each call's arguments, and the mode of each auth file it is
    given, in the file returned, then runs the real one."""
    bindir = work / "bin"
    bindir.mkdir()
    calls = work / "skopeo-calls"
    wrapper = bindir / "skopeo"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"printf 'argv:%s\\n' \"$*\" >> {calls}\n"
        "for a; do case \"$a\" in --authfile=*|--src-authfile=*)\n"
        f"  stat -c 'authfile:%a' \"${{a#*=}}\" >> {calls};; esac; done\n"
        f"exec {shutil.which('skopeo')} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return calls


def _pull(text: str, layout: Path, **kwargs: Any) -> PulledImage:
    return pull_image(parse_reference(text), layout, **kwargs)


def test_an_image_is_pulled_by_tag_and_by_digest_and_unpacked(registry: Registry, pushed: str, work: Path,
                                                              skopeo_calls: Path) -> None:
    by_tag = _pull(f"{registry.host}/team/tool:v1", work / "by-tag", credentials=CREDS, insecure=True)
    assert by_tag.digest == pushed
    assert str(by_tag.reference) == f"{registry.host}/team/tool:v1@{pushed}"
    by_digest = _pull(f"{registry.host}/team/tool@{pushed}", work / "by-digest", credentials=CREDS,
                      insecure=True)
    assert by_digest.digest == by_digest.layout_digest == pushed  # an OCI manifest is copied unchanged

    config = read_image_config(by_digest.layout, by_digest.tag)
    assert dict(config.env) == {"PATH": "/usr/local/bin:/bin", "GREETING": "hi there=1"}
    assert (config.working_dir, config.user) == ("/app", "1000:1001")
    assert (config.entrypoint, config.cmd) == (("/usr/local/bin/greet",), ("--loud", "x y"))
    assert (config.platform, config.manifest_digest, config.size) == ("linux/amd64", pushed, by_digest.size)
    assert config == read_image_config(by_tag.layout, by_tag.tag)

    rootfs = work / "rootfs"
    unpack_image(by_digest.layout, by_digest.tag, rootfs)
    hello = rootfs / "app" / "hello.txt"
    assert hello.read_bytes() == b"hello from the image\n"
    st = hello.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, 1000, 1001)
    assert os.readlink(rootfs / "bin" / "sh") == "busybox"
    # The unpacked tree is a working root filesystem: its script runs there with its own busybox.
    chroot = shutil.which("chroot")
    assert chroot is not None
    run = subprocess.run([chroot, "--userspec=1000:1001", str(rootfs), "/usr/local/bin/greet"],
                         capture_output=True, text=True, timeout=30, check=True,
                         env={"PATH": "/bin", "GREETING": "hi"}, cwd="/")
    assert run.stdout == "hi from / as 1000\n"

    calls = skopeo_calls.read_text()
    assert "argv:" in calls and PASSWORD not in calls and USER not in calls
    assert {line for line in calls.splitlines() if line.startswith("authfile:")} == {"authfile:600"}


def test_an_index_is_pulled_for_linux_amd64_and_another_platform_is_refused(registry: Registry,
                                                                            work: Path) -> None:
    layout = work / "multi-layout"
    build_image(layout, "amd", ImageSpec(env={"ARCH": "amd64"}))
    build_image(layout, "arm", ImageSpec(env={"ARCH": "arm64"}, architecture="arm64"))
    index_images(layout, "multi", ["arm", "amd"])
    index_images(layout, "arm-only", ["arm"])
    index_digest = push(layout, "multi", registry, "team/multi")
    assert index_digest != manifest_digest(layout, "amd")
    push(layout, "arm-only", registry, "team/multi")
    push(layout, "arm", registry, "team/multi")

    # From an index, the linux/amd64 image's manifest is pulled, by its own digest.
    pulled = _pull(f"{registry.host}/team/multi:multi", work / "multi", credentials=CREDS, insecure=True)
    assert pulled.digest == manifest_digest(layout, "amd")
    assert read_image_config(pulled.layout, pulled.tag).env == {"ARCH": "amd64"}
    by_digest = _pull(f"{registry.host}/team/multi@{index_digest}", work / "multi-by-digest",
                      credentials=CREDS, insecure=True)
    assert by_digest.digest == pulled.digest
    # An index without one is refused before any layer is fetched; a lone arm64 image when its config is read.
    _refused(f"{registry.host}/team/multi:arm-only", work, "image_platform_unsupported", 400,
             credentials=CREDS, insecure=True)
    arm = _pull(f"{registry.host}/team/multi:arm", work / "arm", credentials=CREDS, insecure=True)
    with pytest.raises(CapsaError) as caught:
        read_image_config(arm.layout, arm.tag)
    assert (caught.value.code, caught.value.status) == ("image_platform_unsupported", 400)
    assert "linux/arm64" in caught.value.message


def _hostile_layer(path: Path, *, etc_loop: bool) -> Path:
    """A layer tar no filesystem could produce: ``../`` and absolute member names, an absolute symlink to the
    host's /etc with a member written through it, hard links to /etc/passwd, a character device (/dev/mem's
    numbers, mode 0666) and a setuid-root script. ``etc_loop``: the symlink is ``etc`` itself, else
    ``hostetc`` beside an ``etc`` of the image's own."""
    members: list[tuple[tarfile.TarInfo, bytes | None]] = []

    def add(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", mode: int = 0o644,
            linkname: str = "", dev: tuple[int, int] = (0, 0)) -> None:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.linkname = kind, mode, linkname
        info.devmajor, info.devminor = dev
        info.size = len(data) if kind == tarfile.REGTYPE else 0
        members.append((info, data if kind == tarfile.REGTYPE else None))

    link = "etc" if etc_loop else "hostetc"
    if not etc_loop:
        add("etc", tarfile.DIRTYPE, mode=0o755)
        add("etc/passwd", data=b"root:x:0:0::/root:/bin/sh\n")
    add("../../escape", data=b"escaped\n")
    add("/abs-escape", data=b"absolute\n")
    add(link, tarfile.SYMTYPE, mode=0o777, linkname="/etc")
    add(f"{link}/capsa-owned", data=b"owned\n")
    add("passwd-link", tarfile.LNKTYPE, linkname="/etc/passwd")
    add("passwd-link2", tarfile.LNKTYPE, linkname="../../../etc/passwd")
    add("dev", tarfile.DIRTYPE, mode=0o755)
    add("dev/mem-node", tarfile.CHRTYPE, mode=0o666, dev=(1, 1))
    add("bin", tarfile.DIRTYPE, mode=0o755)
    add("bin/su-root", data=b"#!/bin/sh\nid\n", mode=0o4755)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _tree(root: Path, skip: Path | None = None) -> dict[str, tuple[object, ...]]:
    """Every entry under ``root`` (not following symlinks, ``skip`` left out): type, mode, owner, size,
    mtime, inode, link count, a symlink's target and a small file's hash."""
    found: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if skip is not None:
            dirnames[:] = [d for d in dirnames if Path(dirpath, d) != skip]
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st = path.lstat()
            target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
            digest = None
            if stat.S_ISREG(st.st_mode) and st.st_size < 1 << 20 and os.access(path, os.R_OK):
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
            found[str(path)] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, st.st_ino,
                                st.st_nlink, target, digest)
    return found


@pytest.mark.parametrize("etc_loop", [False, True], ids=["symlink-beside-etc", "etc-is-the-symlink"])
def test_a_hostile_layer_changes_nothing_outside_its_root(registry: Registry, work: Path,
                                                          etc_loop: bool) -> None:
    layout = work / "hostile-layout"
    build_image(layout, "h", ImageSpec(busybox=False, layers=[_hostile_layer(work / "layer.tar",
                                                                               etc_loop=etc_loop)]))
    name = "hostile/loop" if etc_loop else "hostile/beside"
    digest = push(layout, "h", registry, name)
    pulled = _pull(f"{registry.host}/{name}:h", work / "pulled", credentials=CREDS, insecure=True)
    assert pulled.digest == digest

    parent = work / "unpack"
    parent.mkdir(mode=0o700)
    rootfs = parent / "rootfs"
    outside = [Path("/escape"), Path("/abs-escape"), Path("/etc/capsa-owned"), parent.parent / "escape",
               parent.parent.parent / "escape"]
    assert [p for p in outside if os.path.lexists(p)] == []
    etc_before, parent_before = _tree(Path("/etc")), _tree(parent, skip=rootfs)

    if etc_loop:
        # umoci resolves every member inside the root: ``etc`` -> ``/etc`` resolves to ``etc`` itself, so
        # ``etc/capsa-owned`` is a symlink loop and umoci refuses the layer; nothing is left of the rootfs.
        with pytest.raises(CapsaError) as caught:
            unpack_image(pulled.layout, pulled.tag, rootfs)
        assert caught.value.code == "image_unpack_failed"
        assert "too many levels of symbolic links" in caught.value.message
        assert not os.path.lexists(rootfs)
    else:
        unpack_image(pulled.layout, pulled.tag, rootfs)
        # What umoci made of the layer, all inside the root: the ``../`` and absolute names land at its top;
        # the symlink is kept as written (absolute: it points at the guest's own /etc once booted) and the
        # member written through it lands in the image's etc/; both hard links link to the image's own
        # etc/passwd; the device node and the setuid bit are kept (the guest's root could make them anyway;
        # the parent directory is root's alone so that no host user reaches them).
        assert (rootfs / "escape").read_bytes() == b"escaped\n"
        assert (rootfs / "abs-escape").read_bytes() == b"absolute\n"
        assert os.readlink(rootfs / "hostetc") == "/etc"
        assert (rootfs / "etc" / "capsa-owned").read_bytes() == b"owned\n"
        image_passwd = (rootfs / "etc" / "passwd").lstat()
        assert image_passwd.st_nlink == 3
        for link in ("passwd-link", "passwd-link2"):
            assert (rootfs / link).lstat().st_ino == image_passwd.st_ino
        node = (rootfs / "dev" / "mem-node").lstat()
        assert stat.S_ISCHR(node.st_mode) and (os.major(node.st_rdev), os.minor(node.st_rdev)) == (1, 1)
        su = (rootfs / "bin" / "su-root").lstat()
        assert (stat.S_IMODE(su.st_mode), su.st_uid) == (0o4755, 0)

    assert [p for p in outside if os.path.lexists(p)] == []
    assert _tree(Path("/etc")) == etc_before
    assert _tree(parent, skip=rootfs) == parent_before


def test_unpacking_refuses_a_parent_that_others_can_reach(registry: Registry, pushed: str,
                                                          work: Path) -> None:
    pulled = _pull(f"{registry.host}/team/tool:v1", work / "layout", credentials=CREDS, insecure=True)
    shared = work / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(CapsaError) as caught:
        unpack_image(pulled.layout, pulled.tag, shared / "rootfs")
    assert caught.value.code == "image_unpack_failed" and "root's alone" in caught.value.message
    assert list(shared.iterdir()) == []


def _refused(text: str, work: Path, code: str, status: int, **kwargs: Any) -> str:
    layout = work / "layout"
    with pytest.raises(CapsaError) as caught:
        _pull(text, layout, **kwargs)
    error = caught.value
    assert (error.code, error.status) == (code, status), error.message
    shown = f"{error} {error.message} {error!r} {error.extra!r}"
    assert PASSWORD not in shown
    assert not layout.exists()
    return error.message


def test_failures_have_stable_codes_and_show_no_credentials(registry: Registry, pushed: str,
                                                            work: Path) -> None:
    host = registry.host
    _refused(f"{host}/team/Tool:v1", work, "bad_image_reference", 400, credentials=CREDS, insecure=True)
    assert "team/tool:nope" in _refused(f"{host}/team/tool:nope", work, "image_not_found", 404,
                                        credentials=CREDS, insecure=True)
    _refused(f"{host}/team/absent:v1", work, "image_not_found", 404, credentials=CREDS, insecure=True)
    _refused(f"{host}/team/tool@sha256:{'0' * 64}", work, "image_not_found", 404, credentials=CREDS,
             insecure=True)
    wrong = RegistryCredentials(USER, "wrong-" + PASSWORD)
    assert "refused the credentials" in _refused(f"{host}/team/tool:v1", work, "registry_auth_failed", 403,
                                                 credentials=wrong, insecure=True)
    assert "wrong-" not in _refused(f"{host}/team/tool:v1", work, "registry_auth_failed", 403,
                                    credentials=wrong, insecure=True)
    assert "asks for credentials" in _refused(f"{host}/team/tool:v1", work, "registry_auth_failed", 403,
                                              insecure=True)
    assert "--insecure-registry" in _refused(f"{host}/team/tool:v1", work, "registry_unreachable", 502,
                                             credentials=CREDS)
    _refused(f"127.0.0.1:{free_port()}/team/tool:v1", work, "registry_unreachable", 502, credentials=CREDS,
             insecure=True)
    too_large = _refused(f"{host}/team/tool:v1", work, "image_too_large", 413, credentials=CREDS,
                         insecure=True, max_bytes=1000)
    assert "over the limit of 1000" in too_large
    _refused(f"{host}/team/tool:v1", work, "image_pull_timeout", 504, credentials=CREDS, insecure=True,
             timeout=0.001)
    assert sorted(os.listdir(work)) == []
