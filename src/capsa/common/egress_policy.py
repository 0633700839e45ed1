"""The egress policy document: which destinations a session may reach and how.

A policy is part of a session's create request and can be replaced while the session runs. It is
expressed as JSON or YAML; :func:`policy_json_schema` exports the schema users validate against.
It lives in ``common`` because both sides read it: the control plane validates what users send, the
node's broker enforces it.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from capsa.common.errors import CapsaError

__all__ = [
    "APPROVAL_TIMEOUT_DEFAULT",
    "APPROVAL_TIMEOUT_MAX",
    "MAX_REQUEST_BYTES",
    "MAX_RESPONSE_BYTES",
    "ApprovalRule",
    "ApprovalScope",
    "ApprovalState",
    "ConnectionBinding",
    "DomainRule",
    "EgressPolicy",
    "PolicyError",
    "RateLimit",
    "SecretBinding",
    "domain_matches",
    "policy_json_schema",
]

_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_HOST_RE = re.compile(rf"^{_LABEL}(\.{_LABEL})+$")
_HEADER_RE = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
_METHODS = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}
# Bodies stream through the broker (nothing holds a whole body), but a transfer still costs time and a
# connection: the limits a policy may set are bounded.
MAX_REQUEST_BYTES = 1 << 30
MAX_RESPONSE_BYTES = 1 << 32
APPROVAL_TIMEOUT_DEFAULT = 300
APPROVAL_TIMEOUT_MAX = 3600
"""A held request keeps its connection (and its buffered body) for at most this long."""
_MEDIA_RE = re.compile(r"^([a-z0-9][a-z0-9!#$&^_.+-]*|\*)/([a-z0-9][a-z0-9!#$&^_.+-]*|\*)$")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_DEFAULT_NAME_RE = re.compile(r"^[a-z0-9*][a-z0-9*_.-]{0,252}#[0-9]{1,2}$")
"""The name a rule without one is given, ``<domain>#<index>``: it must parse again when the policy is sent
on as JSON (control plane to node)."""
ApprovalScope = Literal["once", "session"]
ApprovalState = Literal["pending", "approved", "denied", "timeout", "cancelled"]
"""Where a held request stands: ``pending`` until a decision, its timeout or the sandbox's end."""
# Headers a binding may not target: they steer routing or framing, not credentials.
_FORBIDDEN_BINDING_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te"}


def _binding_header(what: str) -> AfterValidator:
    """The check of the header a binding puts ``what`` (a secret, a token) in: a valid name that is not one
    of :data:`_FORBIDDEN_BINDING_HEADERS`."""

    def check(value: str) -> str:
        if not _HEADER_RE.match(value) or value.lower() in _FORBIDDEN_BINDING_HEADERS:
            raise ValueError(f"header {value!r} cannot carry {what}")
        return value

    return AfterValidator(check)


def _exact_name(raw: str, refusal: str) -> str:
    """``raw`` as the one exact DNS name a binding sends its credential to (lower case, no trailing dot; not
    a pattern, not an IP literal); ValueError("<refusal>, got <raw>") otherwise."""
    name = raw.strip().lower().rstrip(".")
    if not _HOST_RE.match(name) or _is_ip_literal(name):
        raise ValueError(f"{refusal}, got {raw!r}")
    return name


class PolicyError(CapsaError):
    code = "invalid_policy"
    status = 422


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


class RateLimit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int = Field(gt=0, le=1_000_000)
    burst: int | None = Field(default=None, gt=0, le=1_000_000)
    """Requests allowed at once before the per-minute rate applies; defaults to the per-minute figure."""


def _check_methods_list(value: list[str] | None) -> list[str] | None:
    if value is None:
        return None
    out = [m.upper() for m in value]
    bad = [m for m in out if m not in _METHODS]
    if bad:
        raise ValueError(f"unsupported methods {bad}; choose from {sorted(_METHODS)}")
    return out


def _check_prefixes(value: list[str] | None) -> list[str] | None:
    if value is None:
        return None
    for p in value:
        if not p.startswith("/") or any(c in p for c in "?#\r\n\t "):
            raise ValueError(f"path prefix must start with '/' and hold no query or spaces: {p!r}")
    return value


_Methods = Annotated[list[str] | None, AfterValidator(_check_methods_list)]
"""HTTP methods a rule matches, upper-cased (None: any)."""
_PathPrefixes = Annotated[list[str] | None, Field(max_length=256), AfterValidator(_check_prefixes)]
"""URL path prefixes a rule matches, each starting with ``/`` (None: any)."""


class ApprovalRule(BaseModel):
    """Requests to the domain that a person (or a service) must approve before the broker forwards them.

    Every criterion given must match (``None``: any); a rule with none holds every request to the domain."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    """Identifies the rule in approvals and audit events (and what a ``session`` approval covers); defaults
    to ``<domain>#<index>``."""
    methods: _Methods = None
    path_prefixes: _PathPrefixes = None
    min_body_bytes: int | None = Field(default=None, ge=0, le=MAX_REQUEST_BYTES)
    """Only requests whose body has at least this many bytes."""
    timeout_s: int = Field(default=APPROVAL_TIMEOUT_DEFAULT, ge=1, le=APPROVAL_TIMEOUT_MAX)
    """How long the request is held waiting for a decision; no decision by then is a denial."""
    scope: ApprovalScope = "once"
    """What an approval covers when the decision does not say: ``once`` (this request) or ``session`` (every
    later request of the session matching this rule, while its sandbox runs)."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str | None) -> str | None:
        if value is not None and not _NAME_RE.match(value) and not _DEFAULT_NAME_RE.match(value):
            raise ValueError(f"approval rule name must be 1-64 of a-z 0-9 _ . - : {value!r}")
        return value

    def matches(self, method: str, path: str, body_bytes: int | None) -> bool:
        """Whether a request matches; ``body_bytes`` None means not known yet (counted as matching)."""
        if self.methods is not None and method.upper() not in self.methods:
            return False
        if self.path_prefixes is not None and not any(path.startswith(p) for p in self.path_prefixes):
            return False
        return self.min_body_bytes is None or body_bytes is None or body_bytes >= self.min_body_bytes


class DomainRule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    domain: str
    """``api.example.com`` (exactly that name) or ``*.example.com`` (any name below it, not the apex)."""
    methods: _Methods = None
    """Allowed HTTP methods; ``None`` allows the common ones (GET HEAD POST PUT PATCH DELETE OPTIONS)."""
    path_prefixes: _PathPrefixes = None
    """Allowed URL path prefixes (each starting with ``/``); ``None`` allows every path."""
    rate_limit: RateLimit | None = None
    max_request_bytes: int | None = Field(default=None, ge=0, le=MAX_REQUEST_BYTES)
    max_response_bytes: int | None = Field(default=None, ge=0, le=MAX_RESPONSE_BYTES)
    forbid_uploads_above: int | None = Field(default=None, ge=0, le=MAX_REQUEST_BYTES)
    """Uploads forbidden: a request body of more than this many bytes is refused (403); 0 refuses any body."""
    download_content_types: list[str] | None = Field(default=None, min_length=1, max_length=64)
    """Media types a response may have (``type/subtype``, ``type/*`` or ``*/*``); a response of another (or
    no) Content-Type is refused (403) without relaying its body. ``None``: any."""
    approvals: list[ApprovalRule] | None = Field(default=None, min_length=1, max_length=32)
    """Requests to hold for approval; the first matching rule applies. ``None``: none are held."""

    @field_validator("download_content_types")
    @classmethod
    def _check_media_types(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        out = [v.strip().lower() for v in value]
        bad = [v for v in out if not _MEDIA_RE.match(v) or (v.startswith("*/") and v != "*/*")]
        if bad:
            raise ValueError(f"not a media type (type/subtype, type/*, */*): {bad}")
        return out

    @model_validator(mode="after")
    def _name_approvals(self) -> DomainRule:
        names: set[str] = set()
        for index, rule in enumerate(self.approvals or ()):
            if rule.name is None:
                rule.name = f"{self.domain}#{index}"
            if rule.name in names:
                raise ValueError(f"approval rule name used twice: {rule.name}")
            names.add(rule.name)
        return self

    @field_validator("domain")
    @classmethod
    def _check_domain(cls, value: str) -> str:
        name = value.strip().lower().rstrip(".")
        bare = name[2:] if name.startswith("*.") else name
        if _is_ip_literal(bare):
            raise ValueError("IP literals are not allowed; name the destination by its DNS name")
        if "*" in bare or not _HOST_RE.match(bare) or len(bare) > 253:
            raise ValueError(f"not a valid domain or wildcard (*.example.com): {value!r}")
        return name

    @property
    def is_wildcard(self) -> bool:
        return self.domain.startswith("*.")

    def allows_method(self, method: str) -> bool:
        return method.upper() in (self.methods if self.methods is not None else _METHODS)

    def allows_path(self, path: str) -> bool:
        if self.path_prefixes is None:
            return True
        return any(path.startswith(p) for p in self.path_prefixes)

    def allows_download(self, content_type: str | None) -> bool:
        """Whether a response of this Content-Type (header value, parameters allowed) may be relayed."""
        if self.download_content_types is None:
            return True
        media = (content_type or "").split(";", 1)[0].strip().lower()
        if "/" not in media:
            return False
        kind = media.split("/", 1)[0]
        return any(a in (media, f"{kind}/*", "*/*") for a in self.download_content_types)


class SecretBinding(BaseModel):
    model_config = ConfigDict(extra="forbid")

    secret: str
    """Reference of a secret stored by the control plane (``sec_…``); the value never appears here."""
    header: Annotated[str, _binding_header("a secret")] = "Authorization"
    """The only request header in which the placeholder is swapped for the secret."""
    domain: str
    """The only destination (exact name) the secret is sent to, over verified HTTPS."""
    env: str | None = None
    """Environment variable that carries the placeholder into the sandbox."""

    @field_validator("domain")
    @classmethod
    def _check_domain(cls, value: str) -> str:
        return _exact_name(value, "a secret is bound to one exact DNS name")

    @field_validator("env")
    @classmethod
    def _check_env(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", value):
            raise ValueError(f"not an environment variable name: {value!r}")
        return value


class ConnectionBinding(BaseModel):
    """A connection (an OAuth 2.0 sign-in held by the control plane) whose current access token the broker
    puts in ``header`` of every request to ``domains``, over verified HTTPS. The sandbox never holds the
    token (nor a placeholder): a header of that name the sandbox sends is replaced."""

    model_config = ConfigDict(extra="forbid")

    connection: str
    """Reference of a connection (``con_…`` or, in what users send, its name)."""
    domains: list[str] = Field(min_length=1, max_length=64)
    """Exact DNS names the token is sent to; each must be allowed by the policy's ``domains``."""
    header: Annotated[str, _binding_header("a token")] = "Authorization"
    format: str = "Bearer {token}"
    """The header's value; ``{token}`` (exactly once) stands for the access token."""

    @field_validator("domains")
    @classmethod
    def _check_domains(cls, value: list[str]) -> list[str]:
        names = (_exact_name(raw, "a connection is bound to exact DNS names") for raw in value)
        return list(dict.fromkeys(names))  # without repeats, in the order given

    @field_validator("format")
    @classmethod
    def _check_format(cls, value: str) -> str:
        if value.count("{token}") != 1 or len(value) > 256:
            raise ValueError("format must hold {token} exactly once (at most 256 characters)")
        if any(not (0x20 <= ord(c) < 0x7F) for c in value):
            raise ValueError("format must be printable ASCII")
        return value

    def header_value(self, token: str) -> str:
        return self.format.replace("{token}", token)


class EgressPolicy(BaseModel):
    """Everything a sandbox may do on the network. An empty policy allows nothing."""

    model_config = ConfigDict(extra="forbid")

    # Bounded so a policy stays cheap to check on every request and to store with the session.
    domains: list[DomainRule] = Field(default_factory=list, max_length=1000)
    secrets: list[SecretBinding] = Field(default_factory=list, max_length=64)
    connections: list[ConnectionBinding] = Field(default_factory=list, max_length=64)
    max_request_bytes: int = Field(default=10 * 1024 * 1024, ge=0, le=MAX_REQUEST_BYTES)
    max_response_bytes: int = Field(default=50 * 1024 * 1024, ge=0, le=MAX_RESPONSE_BYTES)
    approval_webhook: str | None = Field(default=None, max_length=2048)
    """``http(s)://`` URL the node POSTs a JSON notification to whenever a request is held for approval."""

    @field_validator("approval_webhook")
    @classmethod
    def _check_webhook(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises on a malformed port
        except ValueError:
            raise ValueError(f"approval_webhook is not a URL: {value!r}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password \
                or any(c in value for c in "\r\n\t "):
            raise ValueError("approval_webhook must be an http:// or https:// URL without credentials")
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> EgressPolicy:
        seen: set[str] = set()
        for rule in self.domains:
            if rule.domain in seen:
                raise ValueError(f"domain listed twice: {rule.domain}")
            seen.add(rule.domain)
        for binding in self.secrets:
            if self.rule_for(binding.domain) is None:
                raise ValueError(f"secret {binding.secret} is bound to {binding.domain}, "
                                 "which the policy does not allow")
        targets: set[tuple[str, str]] = {(b.domain, b.header.lower()) for b in self.secrets}
        for conn in self.connections:
            for domain in conn.domains:
                if self.rule_for(domain) is None:
                    raise ValueError(f"connection {conn.connection} is bound to {domain}, "
                                     "which the policy does not allow")
                key = (domain, conn.header.lower())
                if key in targets:
                    raise ValueError(f"header {conn.header} to {domain} is bound twice")
                targets.add(key)
        return self

    def connections_for(self, host: str) -> list[ConnectionBinding]:
        """The connection bindings whose token goes to ``host`` (an exact name)."""
        host = host.lower().rstrip(".")
        return [c for c in self.connections if host in c.domains]

    def rule_for(self, host: str) -> DomainRule | None:
        """The most specific rule matching ``host``: an exact name beats the longest wildcard."""
        host = host.lower().rstrip(".")
        best: DomainRule | None = None
        for rule in self.domains:
            if not domain_matches(rule.domain, host):
                continue
            if not rule.is_wildcard:
                return rule
            if best is None or len(rule.domain) > len(best.domain):
                best = rule
        return best

    def request_limit(self, rule: DomainRule) -> int:
        return rule.max_request_bytes if rule.max_request_bytes is not None else self.max_request_bytes

    def response_limit(self, rule: DomainRule) -> int:
        return rule.max_response_bytes if rule.max_response_bytes is not None else self.max_response_bytes

    @classmethod
    def parse(cls, text: str | bytes) -> EgressPolicy:
        """Parse a JSON or YAML document (JSON is a subset of YAML), with a clear error on bad input."""
        try:
            data: Any = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PolicyError(f"policy is neither JSON nor YAML: {exc}") from None
        return cls.from_data(data if data is not None else {})

    @classmethod
    def from_data(cls, data: Any) -> EgressPolicy:
        if not isinstance(data, dict):
            raise PolicyError("policy must be a mapping")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            errors = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()
            )
            raise PolicyError(f"invalid egress policy: {errors}") from None

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)


def domain_matches(pattern: str, host: str) -> bool:
    host = host.lower().rstrip(".")
    if pattern.startswith("*."):
        suffix = pattern[1:]
        return host.endswith(suffix) and len(host) > len(suffix)
    return host == pattern


def policy_json_schema() -> str:
    """The JSON Schema (draft 2020-12, as pydantic emits it) of an egress policy document."""
    schema = EgressPolicy.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "capsa egress policy"
    return json.dumps(schema, indent=2, sort_keys=True)
