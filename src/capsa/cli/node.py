"""``capsa node``: a node agent on its own host, registered with a control plane over HTTP."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from capsa.cli.output import fail
from capsa.common.errors import CapsaError
from capsa.common.settings import Settings

__all__ = ["node"]

log = logging.getLogger(__name__)


def _check_listen(listen: str) -> None:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        fail(f"--listen must be HOST:PORT, got {listen!r}")


@click.command()
@click.option("--control-url", envvar="CAPSA_CONTROL_URL", show_envvar=True, required=True,
              help="The control plane's URL, e.g. http://10.0.0.1:8700.")
@click.option("--enrol-token", envvar="CAPSA_ENROL_TOKEN", show_envvar=True, default=None,
              help="One-time token from `capsa nodes token` (first start only; later starts use the stored "
                   "node credential).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="This node's VMs, disks, storage pool and credential [default: CAPSA_STATE_DIR or "
                   "/var/lib/capsa].")
@click.option("--listen", envvar="CAPSA_NODE_LISTEN", show_envvar=True, default="127.0.0.1:8701",
              show_default=True, help="HOST:PORT for the node API (the control plane calls it).")
@click.option("--advertise-url", envvar="CAPSA_ADVERTISE_URL", show_envvar=True, default=None,
              help="URL the control plane should use for this node [default: http://LISTEN].")
@click.option("--accel", type=click.Choice(["auto", "kvm", "tcg"]), default=None,
              help="VM accelerator [default: CAPSA_ACCEL or auto].")
def node(control_url: str, enrol_token: str | None, state_dir: Path | None, listen: str,
         advertise_url: str | None, accel: str | None) -> None:
    """Run a node agent until SIGTERM or SIGINT; then its sessions are paused or failed and nothing of it is
    left running, mounted or on disk.

    It first runs the host checks of `capsa doctor` and refuses to start at the first that fails. Under a
    systemd notify unit it reports READY=1 once registered and STOPPING=1 when it stops."""
    import asyncio

    from capsa.cli.doctor import doctor_config
    from capsa.common.sdnotify import notify
    from capsa.common.service import run_service
    from capsa.images.build import ensure_image, find_image
    from capsa.images.bundle import install_bundled_image
    from capsa.node.assembly import build_node
    from capsa.node.daemon import HttpControlLink, NodeService
    from capsa.node.doctor import first_failure, run_checks
    from capsa.node.statedir import prepare_state_dir

    _check_listen(listen)
    base = Settings()
    # The host checks of `capsa doctor`, before anything is made: the first failure is refused in one line.
    checks = asyncio.run(run_checks(doctor_config(state_dir, control_url, accel), stop_at_failure=True))
    failed = first_failure(checks)
    if failed is not None:
        detail = " ".join(failed.detail.split())
        fail(f"capsa node: host check {failed.name} failed: {detail} (fix: {failed.fix}; all checks: "
             "capsa doctor)")
    accel_check = next(c for c in checks if c.name == "accelerator")
    log.info("host checks passed; accelerator: %s", accel_check.detail)
    try:
        state = prepare_state_dir(state_dir or base.state_dir)
    except CapsaError as exc:
        fail(str(exc))
    settings = Settings(state_dir=state, accel=accel or base.accel)

    async def main() -> None:
        link = HttpControlLink(control_url, state, enrol_token=enrol_token)
        image = find_image(settings)
        if image is None:
            image = await asyncio.to_thread(install_bundled_image, settings, settings.image_bundle_dir)
            if image is not None:
                log.info("guest image %s unpacked from %s", image.digest[:12], settings.image_bundle_dir)
        if image is None:
            log.info("building the guest image (first start only)")
            image = await asyncio.to_thread(ensure_image, settings)
        try:
            parts = await build_node(settings, image, node_id="unregistered")
        except BaseException:
            await link.aclose()
            raise
        service = NodeService(parts, link, listen=listen, advertise_url=advertise_url)
        try:
            node_id = await service.start()
            print(f"node {node_id} registered", flush=True)
            log.info("node API on %s (state %s)", service.url, state)
            notify("READY=1", f"STATUS=node {node_id} serving on {service.url}")
            await service.wait()
        finally:
            if service.node_id is not None:
                notify("STOPPING=1", "STATUS=pausing sessions and removing VMs")
            await service.stop()

    try:
        run_service(main())
    except CapsaError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"capsa node: {exc.strerror or exc}")
