"""Building the guest image (kernel, initramfs, root filesystem) from Debian packages, and caching it.

Other parts of capsa use :func:`ensure_image` (build when missing) and :func:`find_image` (lookup
only); both return a :class:`~capsa.common.image.GuestImage`.
"""

from __future__ import annotations

from capsa.common.image import GuestImage
from capsa.images.build import ImageConfig, ensure_image, find_image, load_manifest
from capsa.images.errors import ImageBuildError
from capsa.images.progress import STEPS, BuildEvent, ProgressCallback, StepState

__all__ = [
    "STEPS",
    "BuildEvent",
    "GuestImage",
    "ImageBuildError",
    "ImageConfig",
    "ProgressCallback",
    "StepState",
    "ensure_image",
    "find_image",
    "load_manifest",
]
