"""The node's one table of HTTP statuses by error code.

The node API's edge (:mod:`capsa.node.api.errors`) answers every error with the status :func:`status_of`
gives; nothing below the edge decides the HTTP status of a guest error: the guest client's errors
(:class:`~capsa.node.guestlink.errors.GuestError`) carry only their code. The node's core reads the same
table where it must tell a request's own fault from a VM's (:mod:`capsa.node.templates.source`: whether a
failed restore cold-boots). A leaf module, so that reading it does not import the routes.
"""

from __future__ import annotations

from capsa.common.errors import CapsaError
from capsa.node.guestlink.errors import GuestError, GuestRefused

__all__ = ["STATUS", "status_of"]

STATUS: dict[str, int] = {
    # The guest daemon's stable codes (capsa.guest.errors).
    "bad_request": 400,
    "unknown_op": 400,
    "unsafe_archive": 400,
    "not_executable": 400,
    "cancelled": 400,
    "permission_denied": 403,
    "not_found": 404,
    "no_such_process": 404,
    "is_a_directory": 409,
    "not_a_directory": 409,
    "already_exists": 409,
    "directory_not_empty": 409,
    "process_exited": 409,
    "stdin_closed": 409,
    "io_error": 500,
    "internal": 500,
    "unsupported": 501,
    "timeout": 504,
    "guest_timeout": 504,
    "no_space": 507,
    # The guest client's own verdicts on what the guest sent (capsa.node.guestlink).
    "too_large": 413,
    "protocol_error": 502,
    "port_unreachable": 502,
    # The sandbox or its guest channel is gone (capsa.node.agent.guest).
    "sandbox_failed": 409,
    "guest_unavailable": 503,
    # The edge itself.
    "unauthorized": 401,
    "validation_error": 422,
    "snapshots_unavailable": 501,
    "storage_full": 507,  # the storage pool's free-space floor (capsa.node.storage.floor)
    "internal_error": 500,
}
"""HTTP status by error code. Codes not listed (the agent's own: ``sandbox_not_found``, ``no_capacity``…)
keep the status the agent raised them with; guest errors whose code is not listed: see :func:`status_of`."""


def status_of(exc: CapsaError) -> int:
    """The HTTP status of an error raised below the edge. A guest code the table does not list is the
    request's fault (400) when a sandbox's guest refused the request, else the guest's (502)."""
    if exc.code in STATUS:
        return STATUS[exc.code]
    if isinstance(exc, GuestRefused):
        return 400
    if isinstance(exc, GuestError):
        return 502
    return exc.status
