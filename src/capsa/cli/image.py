"""``capsa image``: build and inspect the guest image."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from capsa.common.image import GuestImage
from capsa.common.settings import Settings

__all__ = ["image"]

_STATE_STYLE = {"done": "green", "cached": "cyan", "failed": "red"}


def _settings(cache_dir: Path | None) -> Settings:
    return Settings(cache_dir=cache_dir) if cache_dir is not None else Settings()


def _print_summary(console: Console, manifest: dict[str, Any], image_dir: Path) -> None:
    table = Table(title=f"guest image {manifest['digest'][:16]}", show_header=True)
    table.add_column("artifact")
    table.add_column("size", justify="right")
    table.add_column("on disk", justify="right")
    table.add_column("sha256")
    for name, art in manifest["artifacts"].items():
        table.add_row(name, f"{art['size'] / 2**20:.1f} MiB",
                      f"{art['allocated'] / 2**20:.1f} MiB", art["sha256"][:16])
    console.print(table)
    console.print(f"in {image_dir}", soft_wrap=True)
    k = manifest["kernel"]
    console.print(f"kernel {k['release']} ({k['package']} {k['version']}), "
                  f"{len(manifest['packages'])} Debian packages, built in {manifest['build_seconds']:.0f} s "
                  f"at {manifest['built_at']}")


@click.group()
def image() -> None:
    """Build and inspect the guest image (kernel, initramfs, root filesystem)."""


@image.command("build")
@click.option("--force", is_flag=True,
              help="Refresh package lists and rebuild even if a matching image exists.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Image cache directory (default: CAPSA_CACHE_DIR or /var/cache/capsa).")
@click.option("--json", "as_json", is_flag=True, help="Print the image manifest as JSON on stdout.")
@click.option("--template/--no-template", default=True, show_default=True,
              help="Also build the base template snapshot into the cache (root only), so a fresh node "
                   "restores its first sandbox from it instead of cold-booting.")
@click.option("--memory", "memory_mib", type=click.IntRange(64, 65536), default=256, show_default=True,
              help="Memory (MiB) of the cached base template.")
@click.option("--vcpus", type=click.IntRange(1, 64), default=1, show_default=True,
              help="vCPUs of the cached base template.")
def build(force: bool, cache_dir: Path | None, as_json: bool, template: bool, memory_mib: int,
          vcpus: int) -> None:
    """Build the guest image from Debian packages, or reuse the cached one; then the base template."""
    from capsa.images import BuildEvent, ImageBuildError, ensure_image, load_manifest
    from capsa.images.progress import STEPS

    # Progress goes to stderr so that --json output on stdout stays machine-readable.
    console = Console(stderr=True)
    progress = Progress(SpinnerColumn(), TextColumn("{task.description:<12}"),
                        TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=console)
    tasks: dict[str, TaskID] = {}

    def on_event(event: BuildEvent) -> None:
        if not tasks:
            for step in STEPS:
                tasks[step] = progress.add_task(step, total=1, start=False, detail="[dim]waiting")
        task = tasks[event.step]
        style = _STATE_STYLE.get(event.state.value, "yellow")
        detail = f"[{style}]{event.state.value}[/] {event.detail}"
        if event.state.value == "started":
            progress.start_task(task)
        else:
            progress.update(task, completed=1 if event.state.value != "failed" else 0)
            progress.stop_task(task)
        progress.update(task, detail=detail)

    try:
        with progress:
            img = ensure_image(_settings(cache_dir), progress=on_event, force=force)
    except ImageBuildError as exc:
        console.print(f"[red]image build failed:[/] {exc.message}")
        sys.exit(1)
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: nothing was added to the image cache")
        sys.exit(130)
    image_dir = img.kernel.parent
    manifest = load_manifest(image_dir) or {}
    if as_json:
        click.echo(json.dumps(manifest, indent=2))
    else:
        if not tasks:
            console.print("[cyan]cached[/]: the image for the current inputs is already built")
        _print_summary(console, manifest, image_dir)
    if template:
        _template_cache(console, _settings(cache_dir), img, memory_mib, vcpus, force)


def _template_cache(console: Console, settings: Settings, img: GuestImage, memory_mib: int, vcpus: int,
                    force: bool) -> None:
    if os.geteuid() != 0:
        console.print("[yellow]skipped[/] the base template cache: building it boots a VM as its own uid "
                      "(root only); nodes will build it on first start")
        return
    from capsa.node.templates.warm import warm_template_cache

    started = time.monotonic()
    try:
        with console.status("base template") as status:
            entry, built = asyncio.run(warm_template_cache(
                settings, img, memory_mib=memory_mib, vcpus=vcpus, force=force,
                progress=lambda msg: status.update(f"base template: {msg}")))
    except Exception as exc:
        console.print(f"[red]base template build failed:[/] {exc}")
        sys.exit(1)
    state = "[green]built[/]" if built else "[cyan]cached[/]"
    console.print(f"{state}: base template ({memory_mib} MiB, {vcpus} vCPU) in "
                  f"{time.monotonic() - started:.1f} s, {entry}", soft_wrap=True)


@image.command("show")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Image cache directory (default: CAPSA_CACHE_DIR or /var/cache/capsa).")
@click.option("--json", "as_json", is_flag=True, help="Print the image manifest as JSON on stdout.")
def show(cache_dir: Path | None, as_json: bool) -> None:
    """Show the cached image for the current inputs (exit 1 if there is none; never builds)."""
    from capsa.images import find_image, load_manifest

    img = find_image(_settings(cache_dir))
    if img is None:
        click.echo("no image for the current inputs is cached; run `capsa image build`", err=True)
        sys.exit(1)
    manifest = load_manifest(img.kernel.parent) or {}
    if as_json:
        click.echo(json.dumps(manifest, indent=2))
    else:
        _print_summary(Console(), manifest, img.kernel.parent)
