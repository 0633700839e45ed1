"""Request and response bodies of the egress API: secrets, session policies, the audit trail."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, field_validator

from capsa.common.egress_policy import EgressPolicy, PolicyError

__all__ = [
    "SECRET_VALUE_CONTROL",
    "SECRET_VALUE_WHITESPACE",
    "AuditEventOut",
    "AuditList",
    "PolicyDocument",
    "PolicyOut",
    "PolicyUpdate",
    "SecretCreate",
    "SecretList",
    "SecretOut",
]


def _valid_policy(data: dict[str, Any]) -> dict[str, Any]:
    try:
        policy = EgressPolicy.from_data(data)
    except PolicyError as exc:
        raise ValueError(exc.message) from None
    return policy.model_dump(mode="json", exclude_none=True)


PolicyDocument = Annotated[dict[str, Any], AfterValidator(_valid_policy)]
"""An egress policy (schema: src/capsa/node/egress/policy.schema.json), normalised once validated."""


SECRET_VALUE_CONTROL = "a secret value cannot contain control characters (line breaks, tabs, NUL, DEL)"
SECRET_VALUE_WHITESPACE = "a secret value cannot start or end with whitespace"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SecretCreate(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    value: Annotated[SecretStr, Field(min_length=1, max_length=65536)]
    """Write-only: stored encrypted, never returned, never logged."""
    description: Annotated[str, Field(max_length=1024)] | None = None

    @field_validator("value")
    @classmethod
    def _header_safe(cls, value: SecretStr) -> SecretStr:
        # The broker puts the value into an HTTP header. Control characters could never be sent there (h11
        # would refuse the request, quoting the header in its error), and surrounding whitespace would be
        # stripped by the upstream's parser. Refused here, with a message that never quotes the value.
        text = value.get_secret_value()
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
            raise ValueError(SECRET_VALUE_CONTROL)
        if text != text.strip():
            raise ValueError(SECRET_VALUE_WHITESPACE)
        return value


class SecretOut(BaseModel):
    id: str
    name: str
    description: str | None
    created_at: datetime


class SecretList(BaseModel):
    items: list[SecretOut]


class PolicyUpdate(_Strict):
    policy: PolicyDocument


class PolicyOut(BaseModel):
    session_id: str
    policy: dict[str, Any] | None
    """None: the session was created without a policy and has no network."""
    updated_at: datetime | None
    ca_reissued: bool = False
    """Set by an update that added domains the sandbox's CA did not cover (a new CA was installed)."""


class AuditEventOut(BaseModel):
    id: int
    session_id: str
    sandbox_id: str
    time: datetime
    kind: Literal["http", "connect", "tls", "dns", "net", "approval", "connection"]
    decision: Literal["allow", "deny", "error"]
    source: str | None
    destination: str | None
    resolved_ip: str | None
    method: str | None
    path: str | None
    status: int | None
    bytes_out: int
    bytes_in: int
    rule: str | None
    reason: str | None
    secret_ids: list[str]
    """Secrets injected into this request (ids, never values)."""
    count: int
    """For ``net`` events: packets dropped since the previous event of the class; for denials: how many
    identical denials (same destination, rule and reason) this event stands for."""


class AuditList(BaseModel):
    items: list[AuditEventOut]
    next_cursor: str | None
    dropped: int = 0
    """Events of this session its node discarded before the control plane collected them (the sandbox
    filled its share of the node's audit buffer); they are missing from ``items``."""
