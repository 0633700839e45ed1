"""Failures of guest calls, by the guest's stable code (capsa.guest.errors) or the client's own verdict.

Their ``status`` is the generic 502 every :class:`~capsa.common.errors.CapsaError` has; the HTTP status a
caller sees is decided by code, in one table at the node API's edge (:mod:`capsa.node.api.errors`).
"""

from __future__ import annotations

from capsa.common.errors import CapsaError
from capsa.guest.protocol import UNAVAILABLE

__all__ = ["ChannelClosed", "GuestError", "GuestRefused", "GuestTimeout", "GuestUnavailable"]


class GuestError(CapsaError):
    """The guest answered a request with an error (``code`` is the guest's stable error code), or the
    client gave up on what the guest sent (``protocol_error``, ``too_large``, ``guest_timeout`` ...)."""

    code = "guest_error"
    status = 502

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message or code, code=code)


class GuestRefused(GuestError):
    """A guest operation of a live sandbox failed with a code that blames the request, not the channel (what
    :class:`~capsa.node.agent.guest.SandboxGuest` raises for the guest's own codes)."""


class GuestUnavailable(GuestError):
    """The guest daemon instance serving the request died (PID 1 restarts it; the sandbox stays usable).
    The request may have run partly; later calls go to the new instance."""

    def __init__(self, message: str) -> None:
        super().__init__(UNAVAILABLE, message)


class GuestTimeout(GuestError):
    """The guest did not answer a call by its deadline
    (:class:`~capsa.node.guestlink.streams.GuestDeadlines`)."""

    def __init__(self, message: str) -> None:
        super().__init__("guest_timeout", message)


class ChannelClosed(GuestError):
    """The connection to the guest is gone; every pending and future call fails with this."""

    def __init__(self, message: str = "guest channel closed") -> None:
        super().__init__("channel_closed", message)
