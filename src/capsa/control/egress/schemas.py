"""Request bodies of the egress API: a secret to store, a session's policy (its answers are
:mod:`capsa.common.wire.egress`)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, field_validator

from capsa.common.egress_policy import EgressPolicy, PolicyError

__all__ = [
    "SECRET_VALUE_CONTROL",
    "SECRET_VALUE_WHITESPACE",
    "PolicyDocument",
    "PolicyUpdate",
    "SecretCreate",
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


class PolicyUpdate(_Strict):
    policy: PolicyDocument
