"""``capsa template``: build, list, show and remove templates on this node (node-local, like ``image``).

Templates live in the node's storage pool (``CAPSA_STATE_DIR``); a running ``capsa serve`` on the same
state directory sees a new template at its next creation request. Builds restore the base template into a
build VM, so this needs root like the node itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click
from rich.console import Console
from rich.table import Table

from capsa.common.errors import CapsaError
from capsa.common.settings import Settings

if TYPE_CHECKING:
    from capsa.node.templates.store import TemplateStore

__all__ = ["template"]

T = TypeVar("T")


@contextmanager
def _store(state_dir: Path | None, *, need_image: bool) -> Iterator[TemplateStore]:
    from capsa.images.build import ensure_image, find_image
    from capsa.node.runtime.qemu import PoolStorage, QemuRuntime
    from capsa.node.storage.mounts import MountError
    from capsa.node.storage.pool import StoragePool
    from capsa.node.templates.store import TemplateStore

    settings = Settings(state_dir=state_dir) if state_dir is not None else Settings()
    image = ensure_image(settings) if need_image else find_image(settings)
    if image is None:
        from capsa.common.image import GuestImage

        # Listing and removing need no image; the store only uses it to build and to check freshness.
        image = GuestImage(kernel=Path("/"), initrd=Path("/"), rootfs=Path("/"), digest="", kernel_release="")
    pool = StoragePool.from_settings(settings)
    try:
        runtime = QemuRuntime(settings, storage=PoolStorage(pool))
        yield TemplateStore(runtime, image)
    finally:
        if pool.mounted_here:
            # Mounted for this command only (no node had it mounted): leave the machine as it was. If a
            # node started on the same state dir meanwhile, its open files make umount fail: keep it.
            with contextlib.suppress(MountError):
                pool.unmount()


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _run(console: Console, go: Callable[[], Coroutine[Any, Any, T]], interrupted: str) -> T:
    """Run ``go()``; a CapsaError is a one-line message and exit 1, Ctrl-C says ``interrupted``."""
    try:
        return asyncio.run(go())
    except CapsaError as exc:
        _fail(console, exc)
    except KeyboardInterrupt:
        console.print(f"[red]interrupted[/]: {interrupted}")
        sys.exit(130)


def _fail(console: Console, exc: CapsaError) -> NoReturn:
    console.print(f"[red]{exc.code}[/]: {exc.message}")
    sys.exit(1)


_state_opt = click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                          help="Node state directory (default: CAPSA_STATE_DIR or /var/lib/capsa).")
_json_opt = click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")


@click.group()
def template() -> None:
    """Build and manage sandbox templates (snapshots of prepared guests) on this node."""


@template.command("build")
@click.argument("spec_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_state_opt
@_json_opt
def build(spec_file: Path, state_dir: Path | None, as_json: bool) -> None:
    """Build a template from SPEC_FILE (YAML: name, base, apt, pip, files, commands, env)."""
    from capsa.node.templates.build import build_template, load_spec

    console = Console(stderr=True)
    try:
        spec, sources = load_spec(spec_file)
    except CapsaError as exc:
        _fail(console, exc)
        return

    async def _go() -> dict[str, Any]:
        from capsa.node.egress.node_egress import NodeEgress
        from capsa.node.templates.cache import TemplateCache
        from capsa.node.templates.shipped import shipped_template
        from capsa.store import store_from_settings

        with _store(state_dir, need_image=True) as store:
            # A spec with network: true boots its build VM on a throwaway namespace (nothing leaves it).
            egress = (NodeEgress.create(netns_prefix="capsa-tb-") if spec.network
                      else None)
            try:
                with console.status(f"building template {spec.name}") as status:
                    def say(msg: str) -> None:
                        console.print(f"  {msg}")
                        status.update(f"template {spec.name}: {msg}")

                    t = await build_template(store, spec, sources, progress=say, network=(
                        egress.throwaway_network if egress is not None else None))
                    shipped = shipped_template(spec.name)
                    if shipped is not None and shipped.matches(t.spec):
                        # The shipped spec itself: nodes on this host import it instead of building it.
                        say("copying it into the template cache")
                        settings = Settings()
                        cache = TemplateCache(settings.cache_dir, store_from_settings(settings))
                        await asyncio.to_thread(cache.publish, shipped.cache_name, t.path,
                                                t.snapshot.manifest)
                return t.as_dict()
            finally:
                if egress is not None:
                    await egress.close()
                await store.runtime.close()

    info = _run(console, _go, "the template was not stored")
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        console.print(f"[green]built[/] {info['name']} {info['digest']} ({_size(info['size_bytes'])})")


@template.command("warm")
@click.argument("names", nargs=-1)
@click.option("--all", "warm_all", is_flag=True, help="Every template a node builds: base, base-net and the "
              "shipped ones.")
@click.option("--force", is_flag=True, help="Build even when the cache has a restorable entry.")
@_json_opt
def warm(names: tuple[str, ...], warm_all: bool, force: bool, as_json: bool) -> None:
    """Build templates into the template cache (beside the guest image) unless it already holds a
    restorable entry for each, so nodes import them instead of building them: NAMES of base, base-net,
    browser, desktop. Builds in a scratch node of its own; needs root."""
    from capsa.images.build import ensure_image
    from capsa.node.templates.warm import WarmResult, warm_templates, warmable_names

    console = Console(stderr=True)
    chosen = warmable_names() if warm_all else list(dict.fromkeys(names))
    if not chosen:
        console.print("[red]usage[/]: name at least one template, or --all")
        sys.exit(2)
    started = time.monotonic()

    def say(msg: str) -> None:
        console.print(f"{time.monotonic() - started:7.1f} s  {msg}", soft_wrap=True)

    async def _go() -> list[WarmResult]:
        settings = Settings()
        image = await asyncio.to_thread(ensure_image, settings)
        return await warm_templates(settings, image, chosen, force=force, progress=say)

    results = _run(console, _go, "templates not built were not cached")
    if as_json:
        click.echo(json.dumps([{"name": r.name, "entry": str(r.entry), "built": r.built,
                                "seconds": round(r.seconds, 1)} for r in results], indent=2))
    else:
        for r in results:
            state = "[green]built[/]" if r.built else "[cyan]cached[/]"
            console.print(f"{state} {r.name} in {r.seconds:.1f} s: {r.entry}", soft_wrap=True)


@template.command("ls")
@_state_opt
@_json_opt
def ls(state_dir: Path | None, as_json: bool) -> None:
    """List the templates stored on this node."""
    with _store(state_dir, need_image=False) as store:
        items = [t.as_dict() for t in store.all()]
    if as_json:
        click.echo(json.dumps(items, indent=2))
        return
    table = Table(show_header=True)
    for col in ("name", "memory", "vcpus", "digest", "size", "created"):
        table.add_column(col)
    for t in items:
        table.add_row(t["name"], f"{t['memory_mib']} MiB", str(t["vcpus"]), t["digest"][:19],
                      _size(t["size_bytes"]), t["created_at"])
    Console().print(table)


@template.command("show")
@click.argument("name")
@_state_opt
@_json_opt
def show(name: str, state_dir: Path | None, as_json: bool) -> None:
    """Show a template (every size it was built in) and the spec it was built from."""
    console = Console(stderr=True)
    try:
        with _store(state_dir, need_image=False) as store:
            items = [t.as_dict() for t in store.variants(name)]
    except CapsaError as exc:
        _fail(console, exc)
        return
    if not items:
        console.print(f"[red]template_not_found[/]: no template {name!r} on this node")
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(items, indent=2))
        return
    out = Console()
    for t in items:
        out.print(f"[bold]{t['name']}[/] {t['memory_mib']} MiB / {t['vcpus']} vCPU  {t['digest']}")
        out.print(f"  snapshot {t['snapshot']}, image {t['image_digest'][:19]}, {_size(t['size_bytes'])}, "
                  f"created {t['created_at']}")
        if t["spec"]:
            out.print_json(json.dumps(t["spec"]))


@template.command("rm")
@click.argument("name")
@_state_opt
def rm(name: str, state_dir: Path | None) -> None:
    """Delete a template (all its sizes). Running sandboxes made from it are not affected."""
    console = Console(stderr=True)
    if name == "base":
        console.print("[red]template_protected[/]: the base template is rebuilt by the node; not removed")
        sys.exit(1)
    try:
        with _store(state_dir, need_image=False) as store:
            n = store.delete(name)
    except CapsaError as exc:
        _fail(console, exc)
        return
    if n == 0:
        console.print(f"[red]template_not_found[/]: no template {name!r} on this node")
        sys.exit(1)
    console.print(f"removed {name} ({n} size(s))")
