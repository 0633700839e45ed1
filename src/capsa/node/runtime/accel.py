"""Remembering which accelerator works on this host.

``auto`` is settled by booting (a KVM probe boot, falling back to TCG), not by looking at /dev/kvm: on
PVM hosts /dev/kvm exists but stock kernels hang under it. A probe costs seconds, so its outcome is cached
in the process and on disk, keyed by what could change it (QEMU version, host kernel, the user QEMU runs as).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from capsa.node.runtime.base import Accelerator

__all__ = ["AccelCache", "AccelDecision", "parse_accel"]

_log = logging.getLogger(__name__)


def parse_accel(value: str | Accelerator) -> Accelerator:
    try:
        return Accelerator(str(value).lower())
    except ValueError:
        choices = ", ".join(a.value for a in Accelerator)
        raise ValueError(f"unknown accelerator {value!r} (choose one of: {choices})") from None


@dataclass(frozen=True)
class AccelDecision:
    accel: Accelerator
    reason: str
    decided_at: float


class AccelCache:
    """Probe outcomes: an in-process dict in front of a JSON file (``None`` path: process only)."""

    _process: dict[str, AccelDecision] = {}

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def get(self, key: str) -> AccelDecision | None:
        if key in self._process:
            return self._process[key]
        entry = self._load().get(key)
        if not isinstance(entry, dict):
            return None
        try:
            decision = AccelDecision(Accelerator(entry["accel"]), str(entry["reason"]),
                                     float(entry["decided_at"]))
        except (KeyError, ValueError, TypeError):
            return None
        if decision.accel is Accelerator.AUTO:
            return None
        self._process[key] = decision
        return decision

    def put(self, key: str, accel: Accelerator, reason: str) -> AccelDecision:
        decision = AccelDecision(accel, reason, time.time())
        self._process[key] = decision
        if self.path is None:
            return decision
        data = self._load()
        data[key] = {"accel": accel.value, "reason": reason, "decided_at": decision.decided_at}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".accel-", suffix=".tmp")
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh, indent=2, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as exc:  # a read-only cache only costs a probe next time
            _log.warning("cannot write accelerator cache %s: %s", self.path, exc)
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(tmp)
        return decision

    def forget(self, key: str | None = None) -> None:
        """Drop cached decisions (all when ``key`` is None) from the process; the file is left alone."""
        if key is None:
            self._process.clear()
        else:
            self._process.pop(key, None)

    def _load(self) -> dict[str, object]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}
