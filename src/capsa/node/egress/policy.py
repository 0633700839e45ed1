"""The egress policy document: defined in :mod:`capsa.common.egress_policy`, shared with the control
plane."""

from __future__ import annotations

from capsa.common.egress_policy import (
    ApprovalRule,
    ConnectionBinding,
    DomainRule,
    EgressPolicy,
    PolicyError,
    RateLimit,
    SecretBinding,
    domain_matches,
    policy_json_schema,
)

__all__ = [
    "ApprovalRule",
    "ConnectionBinding",
    "DomainRule",
    "EgressPolicy",
    "PolicyError",
    "RateLimit",
    "SecretBinding",
    "domain_matches",
    "policy_json_schema",
]
