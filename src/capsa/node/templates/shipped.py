"""Template specs shipped with capsa (``specs/*.yaml`` beside this module; ``templates/*.yaml`` in the
repository links there), which a node builds on first use and caches beside the guest image keyed by the
spec's content."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from capsa.node.templates.build import TemplateSpec, parse_spec, spec_record

__all__ = ["ShippedTemplate", "shipped_names", "shipped_template"]

_SPECS = resources.files("capsa.node.templates") / "specs"


@dataclass(frozen=True)
class ShippedTemplate:
    spec: TemplateSpec
    sources: dict[str, bytes]

    @property
    def cache_name(self) -> str:
        """Its key in the template cache: the name and a hash of the spec, so a changed spec misses."""
        body = json.dumps(spec_record(self.spec, self.sources), sort_keys=True).encode()
        return f"{self.spec.name}.{hashlib.sha256(body).hexdigest()[:12]}"

    def matches(self, record: dict[str, object] | None) -> bool:
        """Whether a stored template's spec record is this spec's (not an older or a custom one)."""
        return record == spec_record(self.spec, self.sources)


def shipped_names() -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in _SPECS.iterdir() if p.name.endswith(".yaml"))


def shipped_template(name: str) -> ShippedTemplate | None:
    """The shipped spec named ``name``, or None."""
    if name not in shipped_names():
        return None
    res = _SPECS / f"{name}.yaml"
    spec, sources = parse_spec(res.read_text(encoding="utf-8"), Path(str(res)))
    return ShippedTemplate(spec, sources)
