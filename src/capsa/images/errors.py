"""Errors raised while building or finding a guest image."""

from __future__ import annotations

from capsa.common.errors import CapsaError

__all__ = ["ImageBuildError"]


class ImageBuildError(CapsaError):
    """A step of the image build failed; the message says which step and why."""

    code = "image_build_failed"
    status = 500
