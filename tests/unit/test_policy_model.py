"""The egress policy document: parsing, validation errors, matching and the exported schema."""

from __future__ import annotations

import json

import pytest

from capsa.common.egress_policy import (
    MAX_REQUEST_BYTES,
    MAX_RESPONSE_BYTES,
    EgressPolicy,
    PolicyError,
    domain_matches,
    policy_json_schema,
)

YAML_DOC = """
domains:
  - domain: api.example.com
    methods: [get, post]
    path_prefixes: [/v1/]
    rate_limit: {requests_per_minute: 60, burst: 5}
    max_request_bytes: 1000
  - domain: "*.example.com"
  - domain: "*.deep.example.com"
secrets:
  - secret: sec_abc
    header: Authorization
    domain: api.example.com
    env: EXAMPLE_KEY
max_response_bytes: 2048
"""


def test_yaml_and_json_give_the_same_policy() -> None:
    from_yaml = EgressPolicy.parse(YAML_DOC)
    from_json = EgressPolicy.parse(from_yaml.to_json())
    assert from_yaml == from_json
    assert EgressPolicy.parse(from_yaml.to_yaml()) == from_yaml
    rule = from_yaml.rule_for("api.example.com")
    assert rule is not None and rule.methods == ["GET", "POST"]
    assert from_yaml.request_limit(rule) == 1000 and from_yaml.response_limit(rule) == 2048


def test_most_specific_rule_wins() -> None:
    policy = EgressPolicy.parse(YAML_DOC)
    assert policy.rule_for("API.Example.com.") is not None
    assert policy.rule_for("api.example.com").domain == "api.example.com"  # type: ignore[union-attr]
    assert policy.rule_for("x.example.com").domain == "*.example.com"  # type: ignore[union-attr]
    assert policy.rule_for("a.deep.example.com").domain == "*.deep.example.com"  # type: ignore[union-attr]
    assert policy.rule_for("example.com") is None  # a wildcard does not cover the apex
    assert policy.rule_for("example.com.evil.test") is None
    assert policy.rule_for("evilexample.com") is None


def test_method_and_path_rules() -> None:
    rule = EgressPolicy.parse(YAML_DOC).rule_for("api.example.com")
    assert rule is not None
    assert rule.allows_method("get") and not rule.allows_method("DELETE")
    assert rule.allows_path("/v1/chat") and not rule.allows_path("/v2/chat") and not rule.allows_path("/v1")


def test_wildcard_matching() -> None:
    assert domain_matches("*.a.test", "b.a.test")
    assert domain_matches("*.a.test", "c.b.a.test")
    assert not domain_matches("*.a.test", "a.test")
    assert not domain_matches("*.a.test", "ba.test")
    assert domain_matches("a.test", "A.TEST.")


def test_empty_policy_allows_nothing() -> None:
    policy = EgressPolicy.parse("")
    assert policy.domains == [] and policy.rule_for("anything.test") is None


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ('{"domains": [{"domain": "10.0.0.1"}]}', "IP literals are not allowed"),
        ('{"domains": [{"domain": "*.*.example.com"}]}', "not a valid domain"),
        ('{"domains": [{"domain": "localhost"}]}', "not a valid domain"),
        ('{"domains": [{"domain": "a.test", "methods": ["TRACE"]}]}', "unsupported methods"),
        ('{"domains": [{"domain": "a.test", "path_prefixes": ["v1"]}]}', "path prefix must start"),
        ('{"domains": [{"domain": "a.test"}, {"domain": "A.test"}]}', "domain listed twice"),
        ('{"domains": [{"domain": "a.test"}], "secrets": [{"secret": "s", "domain": "b.test"}]}',
         "does not allow"),
        ('{"domains": [{"domain": "a.test"}], "secrets": [{"secret": "s", "domain": "a.test", '
         '"header": "Host"}]}', "cannot carry a secret"),
        ('{"domains": [{"domain": "*.a.test"}], "secrets": [{"secret": "s", "domain": "*.a.test"}]}',
         "one exact DNS name"),
        ('{"domains": [], "surprise": 1}', "surprise"),
        ("[1, 2]", "must be a mapping"),
        ("domains: [unclosed", "neither JSON nor YAML"),
        ('{"domains": [{"domain": "a.test", "rate_limit": {"requests_per_minute": 0}}]}', "greater than 0"),
    ],
)
def test_bad_documents_get_clear_errors(doc: str, fragment: str) -> None:
    with pytest.raises(PolicyError) as info:
        EgressPolicy.parse(doc)
    assert fragment in info.value.message
    assert info.value.code == "invalid_policy" and info.value.status == 422


def test_schema_is_exported() -> None:
    schema = json.loads(policy_json_schema())
    assert schema["title"] == "capsa egress policy"
    assert {"domains", "secrets"} <= set(schema["properties"])
    assert "DomainRule" in schema["$defs"] and "SecretBinding" in schema["$defs"]
    assert schema["additionalProperties"] is False


def test_published_schema_file_matches_the_model() -> None:
    """src/capsa/node/egress/policy.schema.json is what users validate against; regenerate it with
    ``python -c "from capsa.common.egress_policy import policy_json_schema; print(policy_json_schema())"``."""
    from pathlib import Path

    import capsa.node.egress as egress_package

    published = Path(egress_package.__file__).with_name("policy.schema.json").read_text()
    assert published == policy_json_schema() + "\n"


@pytest.mark.parametrize("doc", [
    {"max_request_bytes": MAX_REQUEST_BYTES + 1},
    {"max_response_bytes": MAX_RESPONSE_BYTES + 1},
    {"domains": [{"domain": "a.test", "max_request_bytes": MAX_REQUEST_BYTES + 1}]},
    {"domains": [{"domain": "a.test", "max_response_bytes": MAX_RESPONSE_BYTES + 1}]},
])
def test_body_limits_are_bounded(doc: dict[str, object]) -> None:
    with pytest.raises(PolicyError, match="less than or equal"):
        EgressPolicy.from_data(doc)
    EgressPolicy.from_data({"max_request_bytes": MAX_REQUEST_BYTES, "max_response_bytes": MAX_RESPONSE_BYTES})
