"""Where the node agent's session sandboxes come from: a :class:`SandboxSource`.

* :class:`ColdBootSource`: boot the template's guest image (``runtime.boot``).
* :class:`TemplateSource`: restore from the template's snapshot (docs/node-snapshots.md): bind one from
  the warm pool, or restore on demand when it is empty. A sandbox of ``base`` with a NIC (an egress
  policy) is restored from ``base-net``, the same guest snapshotted with one virtio-net device of a fixed
  MAC (:data:`NET_TEMPLATE_MAC`; every sandbox has its own namespace, so equal MACs never meet), built
  once on the egress's throwaway network. The restored NIC gets the new sandbox's tap and the guest its
  address; if any of that fails, the sandbox is cold-booted instead. A custom template built with a NIC
  (``network: true``, e.g. ``browser``) is restored the same way onto the session's network.
* Templates shipped with capsa (:mod:`capsa.node.templates.shipped`) are built on first use (cached like
  ``base``, keyed by the spec's content).

A source only makes the VM; the agent checks the request, holds the capacity, attaches egress and keeps
the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from capsa.common.errors import CapsaError
from capsa.common.image import GuestImage
from capsa.node.egress.node_egress import NodeEgress
from capsa.node.egress.trust_store import TrustStore
from capsa.node.guestlink.identity import IdentityBinder, bind_sandbox, hostname_for
from capsa.node.net.sandbox_net import SandboxNet
from capsa.node.runtime.base import RamMode, Runtime, Sandbox, SnapshottingRuntime, VMSpec
from capsa.node.statuses import status_of
from capsa.node.templates.build import build_template, remove_stale_work
from capsa.node.templates.cache import TemplateCache
from capsa.node.templates.shipped import shipped_names, shipped_template
from capsa.node.templates.store import (
    BASE,
    NET_TEMPLATE_MAC,
    Template,
    TemplateStore,
    check_template_name,
    warm_up,
)
from capsa.node.templates.warm_pool import PoolKey, PoolMetrics, WarmPool

__all__ = [
    "NET_TEMPLATE",
    "CacheKey",
    "ColdBootSource",
    "MadeSandbox",
    "SandboxRequest",
    "SandboxSource",
    "TemplateSource",
    "cache_key",
]

log = logging.getLogger(__name__)

NET_TEMPLATE = "base-net"

Prepare = Callable[[Sandbox], Awaitable[None]]
Attach = Callable[[SandboxNet | None], Awaitable[SandboxNet]]
"""Attaches the sandbox's egress and returns its network: onto a pooled VM's network when given one
(which the sandbox then owns, also if this fails), else onto a new namespace and tap."""


@dataclass(frozen=True)
class SandboxRequest:
    sandbox_id: str
    template: str
    memory_mib: int
    vcpus: int
    attach: Attach | None = None
    """How the sandbox gets its NIC's network (egress); None: no NIC. The source calls it exactly once
    before it returns (also when it fails after that, the caller detaches)."""
    prepare: Prepare | None = None
    """Run on the new sandbox before it counts as made (e.g. install the egress CA); if it fails, the
    sandbox is destroyed."""
    tenant: str | None = None
    """Whose sandbox it is: with template sharing, whose sandboxes its RAM pages may be shared with."""


@dataclass(frozen=True)
class MadeSandbox:
    sandbox: Sandbox
    source: str
    """``boot``, ``pool`` or ``restore``"""
    snapshot: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    """The template's own env (the request's goes over it)."""
    nic_mac: str | None = None
    """The MAC of its NIC, if it has one (a snapshot of it must be restored with the same)."""


class SandboxSource(Protocol):
    """Makes session sandboxes for the agent."""

    def template_names(self) -> list[str]:
        """The templates sessions can ask for."""
        ...

    def image_for(self, digest: str) -> GuestImage:
        """The guest image with ``digest`` (a snapshot's); ``snapshot_mismatch`` if the node has none."""
        ...

    async def start(self) -> None:
        """Begin serving (e.g. build templates, fill pools in the background)."""
        ...

    async def close(self) -> None:
        """Stop and destroy what the source holds that is not a session's (idle pooled sandboxes)."""
        ...

    async def make(self, request: SandboxRequest) -> MadeSandbox:
        """A running sandbox for ``request``; leaves nothing behind on failure."""
        ...


async def _all(*calls: Awaitable[None]) -> None:
    """Run ``calls`` at once, let every one finish, then raise the first failure (if any)."""
    for outcome in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome


async def _prepared(runtime: Runtime, sandbox: Sandbox, prepare: Prepare | None) -> Sandbox:
    if prepare is not None:
        try:
            await prepare(sandbox)
        except BaseException:
            await asyncio.shield(runtime.destroy(sandbox))
            raise
    return sandbox


class ColdBootSource:
    """Every sandbox is a cold boot of its template's image (``images``: template name -> image)."""

    def __init__(self, runtime: Runtime, images: Mapping[str, GuestImage]) -> None:
        self.runtime = runtime
        self.images = dict(images)

    def template_names(self) -> list[str]:
        return sorted(self.images)

    def image_for(self, digest: str) -> GuestImage:
        for image in self.images.values():
            if image.digest == digest:
                return image
        raise CapsaError(f"no guest image {digest} on this node for that snapshot", code="snapshot_mismatch",
                         status=409)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def make(self, request: SandboxRequest) -> MadeSandbox:
        image = self._image(request.template)
        network = await request.attach(None) if request.attach is not None else None
        return await self.boot(request, network, image)

    def _image(self, template: str) -> GuestImage:
        image = self.images.get(template)
        if image is None:
            raise CapsaError(f"template {template!r} not on this node", code="template_not_found", status=404)
        return image

    async def boot(self, request: SandboxRequest, network: SandboxNet | None,
                   image: GuestImage | None = None) -> MadeSandbox:
        """Cold-boot ``request`` on ``network`` (already attached)."""
        spec = VMSpec(image=image or self._image(request.template), memory_mib=request.memory_mib,
                      vcpus=request.vcpus, network=network,
                      labels={"sandbox": request.sandbox_id, "template": request.template})
        sandbox = await self.runtime.boot(spec, sandbox_id=request.sandbox_id)
        return MadeSandbox(await _prepared(self.runtime, sandbox, request.prepare), "boot",
                           nic_mac=network.mac if network is not None else None)


def _ram_mode(template: Template, default: RamMode = RamMode.COPY) -> RamMode:
    """How a sandbox restored from ``template`` holds its RAM: its spec's ``ram: private`` (busy guests:
    browsers) maps a clone privately, otherwise ``default``."""
    return RamMode.CLONE if (template.spec or {}).get("ram") == "private" else default


@dataclass(frozen=True)
class CacheKey:
    """Where the template cache keeps a template: its entry name, size and NIC MAC (``None``: no NIC)."""

    name: str
    memory_mib: int
    vcpus: int
    mac: str | None


def cache_key(store: TemplateStore, name: str) -> CacheKey:
    """The cache key of ``base`` and ``base-net`` at the store's default size, and of a shipped template at
    its spec's size (its entry named after the spec's digest, so an edited spec is another entry)."""
    shipped = shipped_template(name) if name not in (BASE, NET_TEMPLATE) else None
    if shipped is None:
        return CacheKey(name, store.base_memory_mib, store.base_vcpus,
                        NET_TEMPLATE_MAC if name == NET_TEMPLATE else None)
    spec = shipped.spec
    return CacheKey(shipped.cache_name, spec.memory_mib or store.base_memory_mib,
                    spec.vcpus or store.base_vcpus, NET_TEMPLATE_MAC if spec.network else None)


class TemplateSource:
    """Sandboxes restored from template snapshots, through a warm pool; cold boot only as a fallback."""

    def __init__(self, runtime: SnapshottingRuntime, image: GuestImage, *, egress: NodeEgress | None = None,
                 pool_size: int = 1, pool_sizes: Mapping[str, int] | None = None,
                 ram_mode: RamMode = RamMode.COPY, base_memory_mib: int = 256, base_vcpus: int = 1,
                 bind: IdentityBinder[Sandbox] = bind_sandbox, metrics: PoolMetrics | None = None,
                 trust: TrustStore | None = None, cache: TemplateCache | None = None,
                 warm_up_rounds: int = 2, warm_restores: bool = True, pool_refill_delay: float = 0.0,
                 sharing: Literal["off", "tenant", "all"] = "off") -> None:
        self.runtime = runtime
        self.image = image
        self.egress = egress
        self.trust = trust or TrustStore()
        self._pool_nets: dict[str, tuple[SandboxNet, str]] = {}
        """pooled VM id -> its network (a namespace and tap without a broker) and its template snapshot"""
        self.ram_mode = ram_mode
        self.sharing = sharing
        """Which sandboxes share a template's RAM pages (``CAPSA_TEMPLATE_SHARING``, see :meth:`_restore`)."""
        self.bind = bind
        self.store = TemplateStore(runtime, image, base_memory_mib=base_memory_mib, base_vcpus=base_vcpus,
                                   cache=cache, warm_up_rounds=warm_up_rounds)
        self.warm_restores = warm_restores
        """Run the warm-up commands in a sandbox restored on demand before handing it out, so the user's
        first command is as fast as later ones (the restore then takes that much longer)."""
        self.metrics = metrics or PoolMetrics()
        self.warm = WarmPool(self._pool_restore, self._pool_destroy, default_size=pool_size,
                             sizes=pool_sizes, metrics=self.metrics, refill_delay=pool_refill_delay)
        self.cold = ColdBootSource(runtime, {BASE: image})
        self._warmup: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._warmup = asyncio.create_task(self._warm_up(), name="templates-warm-up")

    async def _warm_up(self) -> None:
        """Build ``base`` if missing and start filling the pools of the templates on disk."""
        try:
            await asyncio.to_thread(remove_stale_work, self.store.root)
            base = await self.store.ensure_base(self.store.base_memory_mib, self.store.base_vcpus)
            self.warm.watch(base.key)
            if self.egress is not None and NET_TEMPLATE in self.warm.sizes:
                # Asked for by name: base-net's pool fills from the start (its first refill builds it).
                # Otherwise it starts filling after the first networked session (a restore on demand).
                self.warm.watch((NET_TEMPLATE, base.memory_mib, base.vcpus))
            for t in await asyncio.to_thread(self.store.all):
                if t.name not in (BASE, NET_TEMPLATE) and await asyncio.to_thread(self.store.is_current, t):
                    self.warm.watch(t.key)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("building the base template failed; sandboxes will build it on demand")

    async def wait_ready(self) -> None:
        """Wait until the start-up template build (or import from the cache) is over: from then on a
        sandbox of ``base`` is a restore, never a cold boot (unless that build failed)."""
        if self._warmup is not None:
            await asyncio.shield(self._warmup)

    @property
    def base_origin(self) -> str | None:
        """Where the start-up ``base`` came from: ``pool`` (already there), ``cache`` (imported from the
        template cache), ``built`` (cold-booted), None (not yet, or its build failed)."""
        return self.store.origins.get((BASE, self.store.base_memory_mib, self.store.base_vcpus))

    async def close(self) -> None:
        if self._warmup is not None:
            self._warmup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._warmup
        await self.warm.close()
        await self.store.close()

    # -- templates ---------------------------------------------------------------------------------------

    def template_names(self) -> list[str]:
        return sorted((set(self.store.names()) | set(shipped_names())) - {NET_TEMPLATE})

    def image_for(self, digest: str) -> GuestImage:
        return self.cold.image_for(digest)

    def list_templates(self) -> list[dict[str, Any]]:
        return [t.as_dict() for t in self.store.all()]

    def get_template(self, name: str) -> list[Template]:
        variants = self.store.variants(name)
        if not variants:
            raise CapsaError(f"template {name!r} not on this node", code="template_not_found", status=404)
        return variants

    async def delete_template(self, name: str) -> None:
        check_template_name(name)
        if name == BASE:
            raise CapsaError("the base template cannot be deleted (it is rebuilt on demand)",
                             code="template_protected", status=409)
        self.get_template(name)
        await self.warm.drain(name)
        await asyncio.to_thread(self.store.delete, name)

    def pool_status(self) -> list[dict[str, object]]:
        return self.warm.status()

    # -- making sandboxes --------------------------------------------------------------------------------

    def _spec(self, template: Template, labels: Mapping[str, str], network: object | None = None) -> VMSpec:
        m = template.snapshot.manifest
        # Pooled restores (and their warm-ups) run in the background: see WarmPool.take. A ``ram: private``
        # template's sandboxes keep their RAM private through pauses (see _ram_mode).
        return VMSpec(image=self.image_for(m.image_digest), memory_mib=m.memory_mib, vcpus=m.vcpus,
                      network=network, labels=dict(labels), background=labels.get("pooled") == "1",
                      private_ram=_ram_mode(template) is RamMode.CLONE)

    async def _restore(self, template: Template, spec: VMSpec, *, tenant: str | None = None,
                       pooled: bool = False, sandbox_id: str | None = None) -> Sandbox:
        """``template`` restored as ``spec``, its RAM mapped as :attr:`sharing` says: privately from the
        copy of the template's pages shared within the tenant (``tenant``; pooled sandboxes have none yet,
        so they keep their own RAM) or within the node (``all``), else as ``ram_mode`` and the template's
        spec say."""
        if self.sharing == "all" or (self.sharing == "tenant" and not pooled):
            domain = "public" if self.sharing == "all" else f"tenant:{tenant}" if tenant else "node:"
            return await self.runtime.restore(template.snapshot, spec, sandbox_id=sandbox_id,
                                              ram_mode=RamMode.PRIVATE, ram_domain=domain)
        return await self.runtime.restore(template.snapshot, spec, sandbox_id=sandbox_id,
                                          ram_mode=_ram_mode(template, self.ram_mode))

    async def _pool_restore(self, key: PoolKey) -> Sandbox:
        if key[0] == NET_TEMPLATE:
            sandbox = await self._pool_restore_networked(key, await self.net_template(key[1], key[2]))
        else:
            template = await self.store.resolve(*key)
            if (template.spec or {}).get("network"):  # browser, desktop: a NIC, so a network of its own
                sandbox = await self._pool_restore_networked(key, template)
            else:
                spec = self._spec(template, {"template": key[0], "pooled": "1"})
                sandbox = await self._restore(template, spec, pooled=True)
        try:
            # A restored guest starts with cold caches (under TCG: no translated code; its RAM pages are
            # faulted in from the snapshot on first touch), so its first command is slow. Spend that on
            # throwaway commands (the paths user commands take) while it waits in the pool, not on the
            # user's first one.
            await warm_up(sandbox, rounds=1, strict=True)
        except BaseException:
            await asyncio.shield(self._pool_destroy(sandbox))
            raise
        return sandbox

    async def _pool_restore_networked(self, key: PoolKey, template: Template) -> Sandbox:
        """base-net (or a template with a NIC) restored onto a network of its own (firewalled, no broker
        until a session binds it: the guest's address, route and DNS are the same on every sandbox's
        network, so a bind only attaches the broker)."""
        if self.egress is None:
            raise CapsaError("this node has no egress service", code="egress_unavailable", status=503)
        net = await self.egress.pool_network()
        try:
            spec = self._spec(template, {"template": key[0], "pooled": "1"},
                              network=dataclasses.replace(net, mac=NET_TEMPLATE_MAC))
            sandbox = await self._restore(template, spec, pooled=True)
        except BaseException:
            await asyncio.shield(self.egress.release_network(net))
            raise
        self._pool_nets[sandbox.id] = (net, template.snapshot.id)
        return sandbox

    async def _pool_destroy(self, sandbox: Sandbox) -> None:
        try:
            await self.runtime.destroy(sandbox)
        finally:
            pooled = self._pool_nets.pop(sandbox.id, None)
            if pooled is not None and self.egress is not None:
                await self.egress.release_network(pooled[0])

    async def make(self, request: SandboxRequest) -> MadeSandbox:
        if request.template == NET_TEMPLATE:
            # Its NIC needs a tap: it only serves sessions of ``base`` with a policy.
            raise CapsaError(f"template {request.template!r} is internal to the node",
                             code="template_not_found", status=404)
        if request.attach is not None:
            return await self._make_networked(request)
        tpl = await self.resolve(request.template, request.memory_mib, request.vcpus)
        if (tpl.spec or {}).get("network"):
            raise CapsaError(f"template {request.template!r} has a browser or other network client and needs "
                             "an egress policy (its sandboxes have a NIC)", code="template_needs_network",
                             status=422)
        try:
            sandbox = await self.warm.take_soon(tpl.key)
            source = "pool"
            if sandbox is None:
                source = "restore"
                labels = {"sandbox": request.sandbox_id, "template": request.template}
                sandbox = await self._restore(tpl, self._spec(tpl, labels), tenant=request.tenant)
            try:
                if source == "restore" and self.warm_restores:
                    # Independent: the warm-up's throwaway commands need no identity (one round trip less).
                    await _all(warm_up(sandbox, rounds=1, strict=True),
                               self.bind(sandbox, hostname_for(request.sandbox_id)))
                else:
                    await self.bind(sandbox, hostname_for(request.sandbox_id))
            except BaseException:
                await asyncio.shield(self.runtime.destroy(sandbox))
                raise
            sandbox = await _prepared(self.runtime, sandbox, request.prepare)
        finally:
            self.warm.watch(tpl.key)
        return MadeSandbox(sandbox, source, tpl.snapshot.id, dict((tpl.spec or {}).get("env") or {}))

    async def _make_networked(self, request: SandboxRequest) -> MadeSandbox:
        """``base`` bound from base-net's warm pool (egress attached onto the pooled VM's network) or
        restored from base-net onto the request's new tap; any other template, or a failed restore,
        cold-boots."""
        if request.template != BASE and self.egress is not None and request.attach is not None:
            custom = await self.resolve(request.template, request.memory_mib, request.vcpus)
            if (custom.spec or {}).get("network"):
                return await self._make_networked_custom(request, custom)
        if request.template != BASE or self.egress is None or request.attach is None:
            return await self.cold.make(request)
        key: PoolKey = (NET_TEMPLATE, request.memory_mib, request.vcpus)
        network: SandboxNet | None = None
        try:
            sandbox = await self.warm.take_soon(key)
            if sandbox is not None:
                net, snapshot_id = self._pool_nets.pop(sandbox.id)
                source = "pool"
                try:
                    network = await request.attach(net)
                except BaseException:
                    await asyncio.shield(self.runtime.destroy(sandbox))
                    raise
            else:
                source = "restore"
                tpl = await self.net_template(request.memory_mib, request.vcpus)
                snapshot_id = tpl.snapshot.id
                network = await request.attach(None)
                spec = self._spec(tpl, {"sandbox": request.sandbox_id, "template": BASE},
                                  network=dataclasses.replace(network, mac=NET_TEMPLATE_MAC))
                sandbox = await self._restore(tpl, spec, tenant=request.tenant, sandbox_id=request.sandbox_id)
            # Identity, the CA install and the warm-up are independent guest calls: made at once (the
            # channel multiplexes them), which shortens the bind.
            steps = [self.bind(sandbox, hostname_for(request.sandbox_id))]
            if request.prepare is not None:
                steps.append(request.prepare(sandbox))
            if self.warm_restores and source == "restore":  # a pooled VM was warmed while it waited
                steps.append(warm_up(sandbox, rounds=1, strict=True))
            done = await asyncio.gather(*steps, return_exceptions=True)
            failed = [r for r in done if isinstance(r, BaseException)]
            if failed:
                await asyncio.shield(self.runtime.destroy(sandbox))
                raise failed[0]
            return MadeSandbox(sandbox, source, snapshot_id, nic_mac=NET_TEMPLATE_MAC)
        except CapsaError as exc:
            # The request's own faults (bad ids or secrets, a full node) would fail a cold boot too. A guest
            # error's status is decided by its code, in the node edge's one table.
            if status_of(exc) in (400, 404, 422, 503) or exc.code == "already_exists":
                raise
            log.warning("restoring %s from %s failed, cold-booting it: %s", request.sandbox_id, NET_TEMPLATE,
                        exc)
        except Exception as exc:
            log.warning("restoring %s from %s failed, cold-booting it: %s", request.sandbox_id, NET_TEMPLATE,
                        exc)
        finally:
            self.warm.watch(key)
        if network is None:
            network = await request.attach(None)
        return await self.cold.boot(request, network, self.image)

    async def _make_networked_custom(self, request: SandboxRequest, tpl: Template) -> MadeSandbox:
        """A template with a NIC (``network: true``): bound from its warm pool (the request's egress
        attached onto the pooled VM's network), or restored onto the request's new network."""
        assert request.attach is not None
        try:
            sandbox = await self.warm.take_soon(tpl.key)
            if sandbox is not None:
                source = "pool"
                net, _ = self._pool_nets.pop(sandbox.id)
                try:
                    await request.attach(net)
                except BaseException:
                    await asyncio.shield(self.runtime.destroy(sandbox))
                    raise
            else:
                source = "restore"
                network = await request.attach(None)
                labels = {"sandbox": request.sandbox_id, "template": request.template}
                spec = self._spec(tpl, labels, network=dataclasses.replace(network, mac=NET_TEMPLATE_MAC))
                sandbox = await self._restore(tpl, spec, tenant=request.tenant, sandbox_id=request.sandbox_id)
        finally:
            self.warm.watch(tpl.key)
        try:
            steps = [self.bind(sandbox, hostname_for(request.sandbox_id))]
            if request.prepare is not None:
                steps.append(request.prepare(sandbox))
            done = await asyncio.gather(*steps, return_exceptions=True)
            failed = [r for r in done if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
        except BaseException:
            await asyncio.shield(self.runtime.destroy(sandbox))
            raise
        return MadeSandbox(sandbox, source, tpl.snapshot.id, dict((tpl.spec or {}).get("env") or {}),
                           nic_mac=NET_TEMPLATE_MAC)

    async def resolve(self, name: str, memory_mib: int | None, vcpus: int | None) -> Template:
        """The template a session of ``name`` restores from; a shipped one (``browser``) is built on first
        use (or imported from the template cache), at its spec's size."""
        shipped = shipped_template(name) if name not in (BASE, NET_TEMPLATE) else None
        if shipped is None:
            return await self.store.resolve(name, memory_mib, vcpus)
        key = cache_key(self.store, name)
        size = (key.memory_mib, key.vcpus)
        if (memory_mib, vcpus) not in ((None, None), size):
            raise CapsaError(f"template {name!r} is {size[0]} MiB/{size[1]} vCPU, not {memory_mib} MiB/"
                             f"{vcpus} vCPU", code="template_mismatch", status=409)
        found = await asyncio.to_thread(self.store.find, name, *size)
        if found is not None and shipped.matches(found.spec):
            return found
        if found is not None:
            # Built from another version of the spec: the shipped name always means the shipped spec.
            log.info("template %s was built from another spec; rebuilding it", name)
            await self.warm.drain(name)
            await asyncio.to_thread(self.store.delete, name)
        return await self.store.ensure(name, *size, lambda: self.build_shipped(name), mac=key.mac,
                                       cache_name=key.name)

    async def build_shipped(self, name: str, progress: Callable[[str], None] | None = None) -> Template:
        """Build the shipped template ``name`` into the store at its spec's size (no cache, no lock)."""
        shipped = shipped_template(name)
        if shipped is None:
            raise CapsaError(f"{name!r} is not a shipped template", code="template_not_found", status=404)
        log.info("building shipped template %s", name)
        egress = self.egress
        return await build_template(self.store, shipped.spec, shipped.sources, progress, network=(
            egress.throwaway_network if egress is not None else None), trust=self.trust)

    async def net_template(self, memory_mib: int, vcpus: int) -> Template:
        """``base`` with a NIC (MAC :data:`NET_TEMPLATE_MAC`), cold-booted and snapshotted on first use."""
        return await self.store.ensure(NET_TEMPLATE, memory_mib, vcpus,
                                       lambda: self.build_net_template(memory_mib, vcpus),
                                       mac=NET_TEMPLATE_MAC)

    async def build_net_template(self, memory_mib: int, vcpus: int) -> Template:
        """Cold-boot ``base-net`` of this size into the store (no cache, no lock: callers hold it)."""
        assert self.egress is not None
        log.info("building template %s (%d MiB, %d vCPU)", NET_TEMPLATE, memory_mib, vcpus)
        # A throwaway namespace and tap (with the sandbox firewall: nothing leaves it) just for the build.
        async with self.egress.throwaway_network() as net:
            spec = VMSpec(image=self.image, memory_mib=memory_mib, vcpus=vcpus,
                          network=dataclasses.replace(net, mac=NET_TEMPLATE_MAC),
                          labels={"template": NET_TEMPLATE})
            sandbox = await self.runtime.boot(spec)
            try:
                # The image's own CA bundle, kept so that installing a sandbox CA is a file write.
                result = await sandbox.guest.exec(self.trust.prepare_script(), timeout=60)
                if result.exit_code != 0:
                    raise CapsaError("could not prepare the trust store of base-net: "
                                     f"{result.stderr[-300:]!r}", code="template_build_failed", status=500)
            except BaseException:
                await asyncio.shield(self.runtime.destroy(sandbox))
                raise
            return await self.store.store(NET_TEMPLATE, sandbox, spec=None)
