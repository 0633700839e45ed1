"""Image references (capsa.node.templates.oci.reference): the forms a template's ``--image`` takes, Docker
Hub's defaults applied as Docker applies them, and a stable ``bad_image_reference`` (400) for the rest."""

from __future__ import annotations

import pytest

from capsa.common.errors import CapsaError
from capsa.node.templates.oci.reference import ImageReference, parse_reference

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:5000/team/tool:v1", ImageReference("127.0.0.1:5000", "team/tool", "v1")),
    ("localhost/tool", ImageReference("localhost", "tool", "latest")),
    ("localhost:5000/tool", ImageReference("localhost:5000", "tool", "latest")),
    ("registry.example.test/a/b/c:1.2-rc_3", ImageReference("registry.example.test", "a/b/c", "1.2-rc_3")),
    (f"registry.example.test/tool@{DIGEST}", ImageReference("registry.example.test", "tool", None, DIGEST)),
    (f"example.test/tool:v1@{DIGEST}", ImageReference("example.test", "tool", "v1", DIGEST)),
    ("busybox", ImageReference("docker.io", "library/busybox", "latest")),
    ("busybox:1.36", ImageReference("docker.io", "library/busybox", "1.36")),
    ("docker.io/busybox", ImageReference("docker.io", "library/busybox", "latest")),
    ("team/tool:v1", ImageReference("docker.io", "team/tool", "v1")),
    ("my_org/my__tool.x-y:v1", ImageReference("docker.io", "my_org/my__tool.x-y", "v1")),
])
def test_valid_references_parse_as_docker_reads_them(text: str, expected: ImageReference) -> None:
    assert parse_reference(text) == expected


def test_a_reference_prints_back_in_full_and_pins_to_a_digest() -> None:
    ref = parse_reference("127.0.0.1:5000/team/tool:v1")
    assert str(ref) == "127.0.0.1:5000/team/tool:v1"
    assert ref.name == "127.0.0.1:5000/team/tool"
    assert str(ref.pinned(DIGEST)) == f"127.0.0.1:5000/team/tool:v1@{DIGEST}"
    assert str(parse_reference("busybox")) == "docker.io/library/busybox:latest"


@pytest.mark.parametrize("text", [
    "",
    " busybox",
    "busy box",
    "busybox\n",
    "Team/Tool",  # upper case in a repository
    "docker://127.0.0.1:5000/tool:v1",
    "https://registry.example.test/tool",
    "127.0.0.1:5000/tool:",  # an empty tag
    "127.0.0.1:5000/tool:.v1",
    "127.0.0.1:5000/tool:" + "v" * 129,
    "127.0.0.1:5000/tool@sha256:abc",  # a short digest
    "127.0.0.1:5000/tool@sha512:" + "ab" * 64,  # only sha256
    "127.0.0.1:5000/tool@" + DIGEST.upper(),
    "127.0.0.1:99999/tool",  # a port out of range
    "-bad.example/tool",
    "127.0.0.1:5000//tool",
    "127.0.0.1:5000/tool/",
    "127.0.0.1:5000/to--ol_/x",
    "registry.example.test/" + "a" * 240,
    "a" * 1025,
])
def test_invalid_references_are_refused_with_a_stable_code(text: str) -> None:
    with pytest.raises(CapsaError) as caught:
        parse_reference(text)
    assert (caught.value.code, caught.value.status) == ("bad_image_reference", 400)
    assert caught.value.message.startswith("invalid image reference: ")


def test_credentials_in_a_reference_are_refused_without_echoing_them() -> None:
    with pytest.raises(CapsaError) as caught:
        parse_reference("alice:s3cret-pass@registry.example.test/tool:v1")
    assert caught.value.code == "bad_image_reference"
    assert "s3cret-pass" not in str(caught.value) and "alice" not in str(caught.value)
