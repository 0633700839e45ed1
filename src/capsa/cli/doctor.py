"""``capsa doctor``: checks this host for what a node needs, each with pass/fail and a one-line fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from capsa.common.settings import Settings

if TYPE_CHECKING:  # the node package is imported when a command runs, not for `capsa --help`
    from capsa.node.doctor import Check, DoctorConfig

__all__ = ["doctor", "doctor_config", "format_check"]


def doctor_config(state_dir: Path | None, control_url: str | None,
                  accel: str | None = None) -> DoctorConfig:
    """The checks' input from ``CAPSA_*`` and the options, with the guest image if it is built already."""
    from capsa.images.build import find_image
    from capsa.node.doctor import DoctorConfig

    base = Settings()
    settings = base.model_copy(update={"state_dir": state_dir or base.state_dir,
                                       "accel": accel or base.accel})
    return DoctorConfig(settings, control_url=control_url or None, image=find_image(settings))


def format_check(check: Check) -> str:
    """``PASS name  detail`` (one line), and for a failure a second line with the fix."""
    line = f"{'PASS' if check.ok else 'FAIL'}  {check.name:<14} {check.detail}"
    if not check.ok and check.fix:
        line += f"\n      {'':<14} fix: {check.fix}"
    return line


@click.command()
@click.option("--json", "as_json", is_flag=True, help='Print {"checks": [{"name", "ok", "detail", "fix"}]}.')
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The node's state directory [default: CAPSA_STATE_DIR or /var/lib/capsa].")
@click.option("--control-url", envvar="CAPSA_CONTROL_URL", show_envvar=True, default=None,
              help="The control plane to reach (GET /v1/health) [default: not checked].")
def doctor(as_json: bool, state_dir: Path | None, control_url: str | None) -> None:
    """Check this host for what a node needs: the accelerator (a KVM probe boot, else the TCG fallback),
    QEMU, btrfs and loop devices, nftables, cgroups, the VM user, the state directory, free space, the store
    and the control plane. Exits 1 when any check fails; `capsa node` runs the same checks at start."""
    import asyncio

    from capsa.node.doctor import run_checks

    checks = asyncio.run(run_checks(doctor_config(state_dir, control_url)))
    if as_json:
        click.echo(json.dumps({"checks": [c.as_dict() for c in checks]}, indent=2))
    else:
        for check in checks:
            click.echo(format_check(check))
    raise SystemExit(0 if all(c.ok for c in checks) else 1)
