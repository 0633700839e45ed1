"""Running the checks in order: the host's (accelerator, QEMU, storage, firewall, cgroups, VM user), the
state directory's, then the services a node talks to."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from capsa.node.doctor import host, paths, remote
from capsa.node.doctor.report import Check, DoctorConfig

__all__ = ["CHECKS", "first_failure", "run_checks"]

log = logging.getLogger(__name__)

CheckFn = Callable[[DoctorConfig], Awaitable[Check]]

CHECKS: tuple[tuple[str, CheckFn], ...] = (
    ("accelerator", host.accelerator),
    ("qemu", host.qemu),
    ("btrfs", host.btrfs),
    ("nftables", host.nftables),
    ("cgroups", host.cgroups),
    ("vm_user", host.qemu_user),
    ("state_dir", paths.state_dir),
    ("disk_space", paths.disk_space),
    ("store", remote.store),
    ("control_plane", remote.control_plane),
)
"""Every check, by name, in the order they run and are reported."""


async def run_checks(cfg: DoctorConfig, *, stop_at_failure: bool = False) -> list[Check]:
    """The outcome of every check in :data:`CHECKS` order (up to the first failure with
    ``stop_at_failure``). A check that raises is reported as failed, with the exception, not raised."""
    results: list[Check] = []
    for name, check in CHECKS:
        try:
            result = await check(cfg)
        except Exception as exc:
            log.exception("doctor check %s raised", name)
            result = Check(name, False, f"the check itself failed: {type(exc).__name__}: {exc}",
                           "see the log for the traceback")
        results.append(result)
        if stop_at_failure and not result.ok:
            break
    return results


def first_failure(checks: Sequence[Check]) -> Check | None:
    return next((c for c in checks if not c.ok), None)
