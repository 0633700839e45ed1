"""Progress events emitted while an image is built (rendered by the CLI, ignored by default)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["STEPS", "BuildEvent", "ProgressCallback", "StepState"]

STEPS: tuple[str, ...] = ("download", "extract", "debootstrap", "initramfs", "rootfs", "ext4")
"""The build steps, in order."""


class StepState(enum.StrEnum):
    STARTED = "started"
    DONE = "done"
    CACHED = "cached"  # skipped because its result was already in the cache
    FAILED = "failed"


@dataclass(frozen=True)
class BuildEvent:
    step: str
    state: StepState
    detail: str = ""


ProgressCallback = Callable[[BuildEvent], None]
