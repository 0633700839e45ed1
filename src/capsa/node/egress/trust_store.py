"""Putting a sandbox's egress CA into the guest's trust store.

The guest's TLS libraries (OpenSSL, GnuTLS, Python's ssl, curl) read one bundle file,
``/etc/ssl/certs/ca-certificates.crt``. The node keeps a copy of the image's own bundle beside it
(``<bundle>.capsa-base``, made once when a networked template is built: :meth:`TrustStore.prepare_script`)
and installs a CA by writing the bundle as that copy plus the CA: a stat and two writes over the guest
channel, no process in the guest (the copy is read from the first guest of a template and remembered). A
guest without the copy (a cold boot) gets it from a shell script instead (:meth:`TrustStore.install_script`).
Either way a re-issued CA replaces, not joins, the previous one.
Not ``update-ca-certificates``: it rehashes every certificate and takes seconds under TCG.

Programs with a trust store of their own (Chromium: its NSS database and policies) get the CA from a hook:
when the guest has an executable at :attr:`TrustStore.hook` (:data:`TRUST_HOOK`; a template puts it there),
it runs after each
install, with the CA already at :attr:`TrustStore.ca_file`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from capsa.common.errors import CapsaError

__all__ = ["CA_BUNDLE", "CA_PATH", "TRUST_HOOK", "TrustGuest", "TrustStore"]

CA_PATH = "/usr/local/share/ca-certificates/capsa-egress.crt"
TRUST_HOOK = "/etc/capsa/trust-hook"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
_MAX_BUNDLE = 16 << 20


class _Result(Protocol):
    @property
    def exit_code(self) -> int | None: ...
    @property
    def stderr(self) -> bytes: ...


class _Stat(Protocol):
    @property
    def size(self) -> int: ...
    @property
    def mtime(self) -> float: ...


class TrustGuest(Protocol):
    """The guest calls a CA install needs (:class:`capsa.node.guestlink.client.GuestClient` has them)."""

    async def stat(self, path: str) -> _Stat: ...

    async def read_file(self, path: str, max_bytes: int = ...) -> bytes: ...

    async def write_file(self, path: str, data: bytes, mode: int | None = None) -> object: ...

    async def exec(self, cmd: list[str], *, timeout: float | None = None) -> _Result: ...  # noqa: ASYNC109


@dataclass(frozen=True)
class TrustStore:
    """Where the guest's trust store is (the defaults are Debian's; tests point it elsewhere).

    The kept copy of the image's bundle is read from a guest once and then remembered by its size and
    modification time (every clone of a template has the same file), so a CA install on the hot path is a
    stat and two writes. The copy holds only the image's public root certificates."""

    bundle: str = CA_BUNDLE
    ca_file: str = CA_PATH
    hook: str = TRUST_HOOK
    _bases: dict[tuple[int, float], bytes] = field(default_factory=dict, compare=False, repr=False)

    @property
    def base(self) -> str:
        """The image's own bundle, kept so a CA can be added to it by a file write."""
        return self.bundle + ".capsa-base"

    def prepare_script(self) -> list[str]:
        """Keep a copy of the image's bundle (once): run in a template's guest before it is snapshotted."""
        return ["sh", "-c", f'b={self.bundle}; mkdir -p "$(dirname "$b")" && {{ [ -f "{self.base}" ] || '
                            f'cp "$b" "{self.base}" 2>/dev/null || : > "{self.base}"; }}']

    def install_script(self) -> list[str]:
        """The guest command that puts the file at :attr:`ca_file` into the bundle (slow path)."""
        b = self.bundle
        return ["sh", "-c", f'b={b}; mkdir -p "$(dirname "$b")" && {{ [ -f "{self.base}" ] || '
                            f'cp "$b" "{self.base}" 2>/dev/null || : > "{self.base}"; }} && '
                            f'cat "{self.base}" {self.ca_file} > "$b.capsa-tmp" && mv "$b.capsa-tmp" "$b"']

    async def install(self, guest: TrustGuest, ca_pem: bytes) -> bool:
        """Make the guest trust ``ca_pem`` (and no CA installed before it). Returns whether it took the
        fast path (file writes only, no process in the guest)."""
        try:
            info = await guest.stat(self.base)
            key = (info.size, info.mtime)
            base = self._bases.get(key)
            if base is None:
                base = await guest.read_file(self.base, max_bytes=_MAX_BUNDLE)
                if len(base) == info.size:
                    if len(self._bases) >= 8:
                        self._bases.pop(next(iter(self._bases)))
                    self._bases[key] = base
        except CapsaError as exc:
            if exc.code != "not_found":
                raise
            await guest.write_file(self.ca_file, ca_pem, mode=0o644)
            result = await guest.exec(self.install_script(), timeout=60)
            if result.exit_code != 0:
                raise CapsaError(f"could not install the egress CA in the guest: {result.stderr[-300:]!r}",
                                 code="egress_setup_failed", status=500) from None
            if await self._has_hook(guest):
                await self._run_hook(guest)
            return False
        if base and not base.endswith(b"\n"):
            base += b"\n"
        _, _, hook = await asyncio.gather(guest.write_file(self.bundle, base + ca_pem, mode=0o644),
                                          guest.write_file(self.ca_file, ca_pem, mode=0o644),
                                          self._has_hook(guest))
        if hook:
            await self._run_hook(guest)
        return True

    async def _has_hook(self, guest: TrustGuest) -> bool:
        try:
            await guest.stat(self.hook)
        except CapsaError as exc:
            if exc.code != "not_found":
                raise
            return False
        return True

    async def _run_hook(self, guest: TrustGuest) -> None:
        result = await guest.exec([self.hook, self.ca_file], timeout=180)
        if result.exit_code != 0:
            why = "timed out" if getattr(result, "timed_out", False) else repr(result.stderr[-300:])
            raise CapsaError(f"the guest's trust hook failed: {why}",
                             code="egress_setup_failed", status=500)
