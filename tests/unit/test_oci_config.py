"""An image's config read from its OCI layout (capsa.node.templates.oci.config), on layouts written here blob
by blob: what a template takes from the config, every blob checked against its descriptor, linux/amd64 only.
(A layout made by umoci and pulled by skopeo: tests/integration/test_oci_pull.py.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from capsa.common.errors import CapsaError
from capsa.node.templates.oci.config import read_image_config

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def _blob(layout: Path, data: bytes, media_type: str) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def _layout(layout: Path, config: dict[str, Any], *, arch: str = "amd64",
            tag: str = "image") -> dict[str, Any]:
    image = {"os": "linux", "architecture": arch, "config": config,
             "rootfs": {"type": "layers", "diff_ids": []}}
    config_desc = _blob(layout, json.dumps(image).encode(), CONFIG)
    layer = {"mediaType": LAYER, "digest": "sha256:" + "0" * 64, "size": 1000}  # never read
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST, "config": config_desc, "layers": [layer, layer]}
    manifest_desc = _blob(layout, json.dumps(manifest).encode(), MANIFEST)
    manifest_desc["annotations"] = {"org.opencontainers.image.ref.name": tag}
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [manifest_desc]}))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return {"config": config_desc, "manifest": manifest_desc}


def _refused(layout: Path, code: str = "bad_image_config", tag: str = "image") -> str:
    with pytest.raises(CapsaError) as caught:
        read_image_config(layout, tag)
    assert (caught.value.code, caught.value.status) == (code, 400)
    return caught.value.message


def test_the_config_reads_back_what_the_image_sets(tmp_path: Path) -> None:
    descs = _layout(tmp_path, {"Env": ["PATH=/usr/bin:/bin", "GREETING=a=b"], "WorkingDir": "/work",
                               "User": "1000:1000", "Entrypoint": ["/bin/sh", "-c"], "Cmd": ["exec tool"]})
    config = read_image_config(tmp_path, "image")
    assert config.env == {"PATH": "/usr/bin:/bin", "GREETING": "a=b"}
    assert (config.working_dir, config.user) == ("/work", "1000:1000")
    assert (config.entrypoint, config.cmd) == (("/bin/sh", "-c"), ("exec tool",))
    assert config.platform == "linux/amd64"
    assert config.digest == descs["config"]["digest"]
    assert config.manifest_digest == descs["manifest"]["digest"]
    assert (config.size, config.layers) == (descs["config"]["size"] + 2000, 2)


def test_an_unset_config_reads_as_empty(tmp_path: Path) -> None:
    _layout(tmp_path, {})
    config = read_image_config(tmp_path, "image")
    assert (config.env, config.working_dir, config.user) == ({}, None, None)
    assert (config.entrypoint, config.cmd) == ((), ())


def test_a_blob_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    descs = _layout(tmp_path, {"User": "root"})
    blob = tmp_path / "blobs" / "sha256" / descs["config"]["digest"].removeprefix("sha256:")
    blob.write_bytes(blob.read_bytes().replace(b'"root"', b'"toor"'))
    assert "does not match its descriptor" in _refused(tmp_path)


def test_a_descriptor_digest_cannot_name_a_path_outside_the_blobs(tmp_path: Path) -> None:
    _layout(tmp_path, {})
    index = json.loads((tmp_path / "index.json").read_text())
    index["manifests"][0]["digest"] = "sha256:../../../etc/passwd"
    (tmp_path / "index.json").write_text(json.dumps(index))
    assert "no sha256 digest" in _refused(tmp_path)


def test_another_platform_is_refused(tmp_path: Path) -> None:
    _layout(tmp_path, {}, arch="arm64")
    assert "linux/arm64" in _refused(tmp_path, "image_platform_unsupported")


def test_a_missing_tag_and_a_bad_env_entry_are_refused(tmp_path: Path) -> None:
    _layout(tmp_path, {"Env": ["NOVALUE"]})
    assert "0 manifests tagged 'other'" in _refused(tmp_path, tag="other")
    assert "NAME=VALUE" in _refused(tmp_path)
