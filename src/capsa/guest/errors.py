"""Failures of guest operations, each with a stable code the host maps to its own errors."""

from __future__ import annotations

import errno

__all__ = ["OpError", "from_os_error"]


class OpError(Exception):
    """An operation failed in a way the host should see as ``code`` + ``message``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_ERRNO_CODES = {
    errno.ENOENT: "not_found",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EROFS: "permission_denied",
    errno.EISDIR: "is_a_directory",
    errno.ENOTDIR: "not_a_directory",
    errno.EEXIST: "already_exists",
    errno.ENOTEMPTY: "directory_not_empty",
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "no_space",
    errno.ENAMETOOLONG: "bad_request",
    errno.EINVAL: "bad_request",
    errno.ELOOP: "bad_request",
    errno.ESRCH: "no_such_process",
    errno.ENOEXEC: "not_executable",
    errno.E2BIG: "bad_request",
}


def from_os_error(exc: OSError, what: str = "") -> OpError:
    code = _ERRNO_CODES.get(exc.errno or 0, "io_error")
    detail = exc.strerror or str(exc)
    subject = what or (exc.filename if isinstance(exc.filename, str) else "")
    return OpError(code, f"{subject}: {detail}" if subject else detail)
