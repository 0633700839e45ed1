"""Controlled exceptions to egress's public-only rule, as an operator configures them.

- ``CAPSA_EGRESS_ALLOW_NETWORKS``: CIDRs (comma or space separated) a sandbox may reach although they are
  not public (a package mirror, an internal API). An address in them is reached only by sandboxes whose
  tenant an admin granted a network covering it (``/v1/egress-grants``); loopback, link-local (metadata
  169.254.169.254), multicast, unspecified, the node's own and the control plane's addresses stay refused
  unless an entry names them explicitly (see :mod:`capsa.node.egress.internal_networks`).
- ``CAPSA_EGRESS_UPSTREAM_PROXY``: ``http://[user:password@]host:port`` or ``https://...``: the broker leaves
  through this proxy (a CONNECT tunnel per upstream connection, TLS and plain HTTP alike) and never connects
  to a destination itself. Every policy check happens first. The credentials go only into the
  ``Proxy-Authorization`` header of the broker's CONNECT: never to a sandbox, never into a log or an error.

Nodes enforce both; the control plane reads ``CAPSA_EGRESS_ALLOW_NETWORKS`` too (``capsa serve`` runs both
from one environment) to refuse, when a policy is set, a name that resolves into those networks from a
tenant without a grant.
"""

from __future__ import annotations

import base64
import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any
from urllib.parse import unquote, urlsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = [
    "EgressNetworkSettings",
    "IPAddress",
    "IPNetwork",
    "UpstreamProxy",
    "covers",
    "parse_networks",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_MAX_NETWORKS = 256


def parse_networks(value: str | Iterable[str]) -> tuple[IPNetwork, ...]:
    """CIDRs from a comma/space separated string (or a list); host bits must be zero (``10.0.0.1/8`` is
    refused rather than silently widened)."""
    items = re.split(r"[\s,]+", value.strip()) if isinstance(value, str) else list(value)
    out: list[IPNetwork] = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        try:
            net = ipaddress.ip_network(text, strict=True)
        except ValueError as exc:
            raise ValueError(f"not a network (CIDR): {text!r}: {exc}") from None
        if net not in out:
            out.append(net)
    if len(out) > _MAX_NETWORKS:
        raise ValueError(f"at most {_MAX_NETWORKS} networks")
    return tuple(out)


def covers(networks: Sequence[IPNetwork], addr: IPAddress) -> bool:
    """Whether ``addr`` (an IPv4-mapped IPv6 address counts as its IPv4 address) is in one of ``networks``."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return any(addr in net for net in networks)


@dataclass(frozen=True)
class UpstreamProxy:
    """``CAPSA_EGRESS_UPSTREAM_PROXY`` parsed. ``repr`` and ``str`` never show the credentials."""

    scheme: str
    host: str
    port: int
    authorization: bytes | None = field(default=None, repr=False)
    """The ``Proxy-Authorization`` value (Basic) when the URL carries credentials."""

    @classmethod
    def parse(cls, url: str) -> UpstreamProxy:
        # Messages name the problem, never the URL: it may hold a password.
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https"):
            raise ValueError("the upstream proxy must be an http:// or https:// URL")
        try:
            host, port = parts.hostname, parts.port
        except ValueError:
            raise ValueError("the upstream proxy URL has a malformed port") from None
        if not host:
            raise ValueError("the upstream proxy URL has no host")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError("the upstream proxy URL must not have a path, query or fragment")
        auth = None
        if parts.username is not None:
            creds = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            auth = b"Basic " + base64.b64encode(creds)
        return cls(parts.scheme, host.lower(), port or (443 if parts.scheme == "https" else 80), auth)

    @property
    def address(self) -> str:
        """``scheme://host:port``: what logs may show."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def __str__(self) -> str:
        return self.address


class EgressNetworkSettings(BaseSettings):
    """``CAPSA_EGRESS_ALLOW_NETWORKS`` and ``CAPSA_EGRESS_UPSTREAM_PROXY`` (see the module docstring)."""

    # hide_input_in_errors: a refused proxy URL may carry a password.
    model_config = SettingsConfigDict(env_prefix="CAPSA_EGRESS_", extra="ignore", hide_input_in_errors=True)

    allow_networks: Annotated[tuple[IPNetwork, ...], NoDecode] = Field(default=())
    upstream_proxy: SecretStr | None = None
    """A URL; a secret because it may carry the proxy's credentials."""

    @field_validator("allow_networks", mode="before")
    @classmethod
    def _networks(cls, value: Any) -> tuple[IPNetwork, ...]:
        if value is None:
            return ()
        if isinstance(value, str | list | tuple):
            return parse_networks(value)
        raise ValueError("a comma separated list of CIDRs")

    @field_validator("upstream_proxy")
    @classmethod
    def _proxy(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value().strip():
            return None
        UpstreamProxy.parse(value.get_secret_value())
        return value

    def proxy(self) -> UpstreamProxy | None:
        value = self.upstream_proxy
        return None if value is None else UpstreamProxy.parse(value.get_secret_value())
