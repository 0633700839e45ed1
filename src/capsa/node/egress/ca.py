"""The per-sandbox certificate authority the broker uses to terminate the sandbox's TLS.

Each sandbox gets its own CA whose certificate carries X.509 name constraints limited to the domains its
policy allows, so even a leaked CA key could not vouch for any other name. Its certificate (PEM) is
installed in the guest's trust store; its key never leaves the node and dies with the sandbox.

Leaves: a name under a wildcard rule gets the wildcard leaf of its parent (``a.example.com`` and every other
name one label below ``example.com`` share ``*.example.com``), so a guest that walks through 10,000 names
under a wildcard costs one issuance. Every leaf of a CA shares one key (made with the CA), so issuing is one
signature; contexts live in a bounded LRU cache, and :meth:`SandboxCA.context_for` issues in a worker thread,
one issuance at a time per CA, never on the event loop.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ssl
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["MAX_LEAVES", "SandboxCA", "constraint_names", "leaf_name"]

_LEAF_DAYS = 7
_CA_DAYS = 30
MAX_LEAVES = 64
"""Server contexts a CA keeps (least recently used dropped first); each holds one leaf certificate."""


def leaf_name(host: str, wildcard: bool) -> str:
    """The certificate name that serves ``host``: itself under an exact rule, the wildcard of its parent
    (``*.b.example.com`` for ``a.b.example.com``) under a wildcard rule."""
    host = host.lower().rstrip(".")
    if wildcard and "." in host:
        return "*." + host.split(".", 1)[1]
    return host


def constraint_names(domains: Iterable[str]) -> list[str]:
    """dNSName constraints covering policy patterns (``*.example.com`` → ``example.com``)."""
    out: set[str] = set()
    for d in domains:
        out.add(d[2:] if d.startswith("*.") else d)
    return sorted(out)


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "capsa sandbox egress"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


class SandboxCA:
    """A name-constrained CA plus a cache of TLS server contexts for the leaf names it issued."""

    def __init__(self, sandbox_id: str, domains: Iterable[str]) -> None:
        self.sandbox_id = sandbox_id
        self.permitted = constraint_names(domains)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(f"capsa egress CA {sandbox_id}"))
            .issuer_name(_name(f"capsa egress CA {sandbox_id}"))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=_CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
        )
        if self.permitted:
            builder = builder.add_extension(
                x509.NameConstraints(permitted_subtrees=[x509.DNSName(n) for n in self.permitted],
                                     excluded_subtrees=None),
                critical=True,
            )
        else:
            # No allowed domain: constrain to a name that cannot exist so the CA vouches for nothing.
            builder = builder.add_extension(
                x509.NameConstraints(permitted_subtrees=[x509.DNSName("invalid")], excluded_subtrees=None),
                critical=True,
            )
        self.certificate = builder.sign(self._key, hashes.SHA256())
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._leaf_key_pem = self._leaf_key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption())
        self._contexts: OrderedDict[str, ssl.SSLContext] = OrderedDict()
        self._lock = threading.Lock()
        self._issuing: asyncio.Lock | None = None
        self.issued = 0
        """Leaves signed so far (a cache miss each)."""

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate to install in the guest trust store."""
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def covers(self, host: str) -> bool:
        host = host.lower()
        return any(host == n or host.endswith("." + n) for n in self.permitted)

    @property
    def cached(self) -> int:
        return len(self._contexts)

    def _issue(self, host: str) -> bytes:
        key = self._leaf_key
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=_LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                           critical=False)
            .sign(self._key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM) + self.cert_pem

    def cached_context(self, name: str) -> ssl.SSLContext | None:
        """The context for leaf ``name`` if it is already issued (never issues)."""
        with self._lock:
            ctx = self._contexts.get(name)
            if ctx is not None:
                self._contexts.move_to_end(name)
            return ctx

    async def context_for(self, name: str) -> ssl.SSLContext:
        """The context for leaf ``name``, issued in a worker thread on a miss (one at a time per CA)."""
        ctx = self.cached_context(name)
        if ctx is not None:
            return ctx
        if self._issuing is None:
            self._issuing = asyncio.Lock()
        async with self._issuing:
            return await asyncio.to_thread(self.server_context, name)

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a leaf for ``host`` (a name or ``*.parent``), issued on first use,
        then cached. Blocking: on the event loop call :meth:`context_for`."""
        ctx = self.cached_context(host)
        if ctx is not None:
            return ctx
        chain = self._issue(host)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])
        # ssl only loads keys from files: write them to a private temp dir, load, delete at once.
        with tempfile.TemporaryDirectory(prefix="capsa-leaf-") as tmp:
            cert_path, key_path = Path(tmp, "c.pem"), Path(tmp, "k.pem")
            cert_path.write_bytes(chain)
            key_path.touch(mode=0o600)
            key_path.write_bytes(self._leaf_key_pem)
            ctx.load_cert_chain(cert_path, key_path)
        with self._lock:
            self.issued += 1
            self._contexts[host] = ctx
            self._contexts.move_to_end(host)
            while len(self._contexts) > MAX_LEAVES:
                self._contexts.popitem(last=False)
        return ctx
