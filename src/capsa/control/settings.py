"""Control plane settings, read from ``CAPSA_*`` environment variables or passed explicitly."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from capsa.common.settings import AllowNetworks

__all__ = ["ControlSettings", "TenantQuota"]

_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_DOMAIN_RE = re.compile(rf"^(?=.{{1,200}}$){_LABEL}(\.{_LABEL})*(:[1-9][0-9]{{0,4}})?$")


def _ports_domain(value: str | None) -> str | None:
    """A host name (lower case, optional ``:port``), without scheme or path."""
    if value is None or not value.strip():
        return None
    domain = value.strip().lower().rstrip(".")
    if not _DOMAIN_RE.match(domain):
        raise ValueError(f"ports_domain must be a host name such as ports.example.com[:8443], not {value!r}")
    return domain


class TenantQuota(BaseModel):
    """What one tenant may hold at once; 0: no limit. Sessions, vCPUs and memory count the sessions that
    have (or are getting) a sandbox (``creating`` or ``running``); paused sessions and snapshots are
    counted apart (they hold no sandbox but hold space in a node's storage pool)."""

    model_config = ConfigDict(extra="forbid")

    max_sessions: Annotated[int, Field(ge=0)] = 500
    max_vcpus: Annotated[int, Field(ge=0)] = 512
    max_memory_mib: Annotated[int, Field(ge=0)] = 256 * 1024
    max_paused_sessions: Annotated[int, Field(ge=0)] = 100
    """Sessions in state ``paused`` (each keeps at least its pause snapshot); checked at pause."""
    max_snapshots: Annotated[int, Field(ge=0)] = 1000
    """Snapshots of every kind (manual, rolling, branch, pause, and those ``keep_snapshots`` keeps after
    a session ends), checked whenever one is taken."""
    max_snapshot_bytes: Annotated[int, Field(ge=0)] = 100 * 1024**3
    """Their bytes as the nodes report them (``size_bytes``); a snapshot that takes the tenant over it is
    deleted again and refused."""


class ControlSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CAPSA_", extra="ignore")

    database_url: str = "sqlite+aiosqlite:////var/lib/capsa/capsa.db"
    bootstrap_key: str | None = None
    """An admin key (``csk_<id>_<secret>``) to install at startup; otherwise one is generated once."""
    bootstrap_tenant: str = "admin"

    session_create_limit: int = 60
    """Session creations allowed per API key per rate window."""
    command_limit: int = 600
    """Command executions allowed per API key per rate window."""
    snapshot_limit: Annotated[int, Field(ge=1)] = 30
    """Manual snapshots (``POST /v1/sessions/{id}/snapshots``) allowed per API key per rate window."""
    rate_window_seconds: int = 60
    rate_lease: Annotated[int, Field(ge=1)] = 16
    """Most rate-limit units a replica claims from the database at once and spends from memory (at most
    1/20 of the limit): one database write per lease instead of per request; with R replicas a key can be
    refused up to (R - 1) * (lease - 1) units before its limit, never admitted beyond it."""
    activity_stamp_interval: Annotated[float, Field(ge=0)] = 5.0
    """A session's ``last_activity_at`` is written at most once per this many seconds (and at most once
    per quarter of its idle timeout), not on every command; the reaper allows for that much staleness, so
    an idle session is closed between its idle timeout and that plus this interval (plus the reaper's
    own interval). 0: write on every call."""

    audit_ack: Literal["async", "durable"] = "async"
    """When an API call's answer goes out relative to its audit events (``CAPSA_AUDIT_ACK``).
    ``async``: at once; the replica commits the events moments later (group commit, in order), reads of
    the trail through it wait for them, and a stopping replica writes them before it closes. A replica
    that dies abruptly loses the events of the calls it answered in its last moments (the calls'
    effects happened either way). ``durable``: the last byte of the answer waits for the commit, adding
    a transaction's time (a few ms) to every call."""
    audit_linger_ms: Annotated[float, Field(ge=0, le=1000)] = 20.0
    """With ``audit_ack=async``: how long the replica's audit writer waits for more events before a
    transaction (reads of the trail and stopping cut it short), so calls made one after another share
    one instead of paying one each. It adds to how long answered calls' events are held in memory
    only. 0: write at once."""
    key_cache_seconds: Annotated[float, Field(ge=0, le=300)] = 5.0
    """How long a replica trusts an API key's record (tenant, admin, revoked) without reading it again:
    a key revoked through another replica keeps working on this one for up to this long (the replica
    that revoked it refuses it at once). 0: read the key on every call."""
    sqlite_synchronous: Literal["normal", "full"] = "normal"
    """SQLite only (``PRAGMA synchronous`` in WAL mode): ``normal`` writes the log to disk at checkpoints,
    so a commit survives capsa crashing or being killed, but the last commits before the machine itself
    loses power may be rolled back (the database stays consistent and the audit chain verifiable);
    ``full`` syncs every commit (an fsync per commit: measured 13.6 ms vs 0.02 ms per commit on this
    kind of VM disk). PostgreSQL keeps its own settings."""
    session_cache_seconds: Annotated[float, Field(ge=0, le=300)] = 0.0
    """How long a replica trusts a running session's row (its sandbox and node) for commands, files and
    processes without reading it again (:mod:`capsa.control.sessions.cache`). Off (0) by default for the
    control service: with several replicas, a session paused and resumed through one replica is sent to
    its old sandbox by another that still holds it, whose caller is then told to send the call again
    (``invalid_state``). ``capsa serve`` (one replica: every transition goes through it and forgets the
    entry) turns it on at 5 s unless this is set."""

    store_url: str | None = None
    """The fleet's store (``CAPSA_STORE_URL``, as the nodes have it): the reaper deletes chunks no snapshot
    or template names any more, every ``store_collect_interval`` seconds."""
    store_s3_endpoint: str | None = None
    store_collect_interval: Annotated[float, Field(gt=0)] = 3600.0
    store_collect_grace: Annotated[float, Field(ge=0)] = 3600.0
    """Chunks younger than this are kept even when nothing names them (a push writes its chunks first)."""

    reaper_interval: float = 2.0
    """Seconds between reaper passes (expired sessions, silent nodes); 0 disables the reaper."""
    node_heartbeat_timeout: float = 30.0
    """A node that has not sent a heartbeat for this long gets no new sandboxes (it is not healthy)."""
    node_dead_after_s: Annotated[float, Field(gt=0)] = 30.0
    """A node silent this long (``CAPSA_NODE_DEAD_AFTER_S``) is lost: its running sessions are recovered on
    another node from their latest stored snapshot, paused at a snapshot it held, or failed
    (``node_lost``)."""
    node_request_timeout: float = 120.0
    """Timeout for non-streaming calls to a node (sandbox creation under TCG can take a while)."""
    max_file_bytes: int = 1 << 30
    """Largest file upload accepted through the API."""
    default_command_timeout: float = 60.0

    secret_key: SecretStr | None = None
    """Base64 of 32 random bytes: the key secrets are encrypted with at rest (``CAPSA_SECRET_KEY``)."""
    secret_key_file: Path | None = None
    metrics_token: SecretStr | None = Field(default=None, min_length=16)
    """A bearer token that may read ``GET /metrics`` and nothing else (``CAPSA_METRICS_TOKEN``: what a
    Prometheus ServiceMonitor sends); an admin API key may read it too."""
    """A file holding that key (``capsa serve`` creates one, mode 0600, in its state directory)."""
    rolling_snapshot_interval: float = 2.0
    """Seconds between passes that take due rolling snapshots; 0 disables them in this replica."""

    tenant_quota: TenantQuota = Field(default_factory=TenantQuota)
    """Every tenant's quota (``CAPSA_TENANT_QUOTA='{"max_sessions": 20}'``), enforced at create, branch and
    resume with ``quota_exceeded`` (403)."""
    tenant_quotas: dict[str, TenantQuota] = Field(default_factory=dict)
    """Per-tenant overrides of ``tenant_quota`` (``CAPSA_TENANT_QUOTAS='{"acme": {"max_vcpus": 512}}'``)."""
    keep_snapshots_days: Annotated[float, Field(ge=0)] = 7.0
    """How long a session created with ``keep_snapshots`` keeps its snapshots after it ends
    (``CAPSA_KEEP_SNAPSHOTS_DAYS``); the reaper deletes them after that. 0: kept forever (they
    still count against the tenant's snapshot quota either way)."""

    e2b_compat: bool = True
    """Serve the E2B dialect (REST API + envd protocol, ``capsa.compat.e2b``) under ``/e2b``
    (``CAPSA_E2B_COMPAT=false`` turns it off)."""
    e2b_watcher_max_bytes: Annotated[int, Field(ge=4096)] = 1 << 20
    """Bytes of unpolled events one E2B polled watcher (``CreateWatcher``) may buffer; past it the watcher
    stops and its next poll answers ``resource_exhausted``."""
    e2b_watchers_max_bytes: Annotated[int, Field(ge=4096)] = 64 << 20
    """Bytes of unpolled events all E2B polled watchers on one replica may buffer together."""
    e2b_watchers_per_tenant: Annotated[int, Field(ge=1)] = 64
    """E2B polled watchers one tenant may hold on one replica (besides 64 per sandbox)."""
    e2b_watcher_unpolled_seconds: Annotated[float, Field(gt=0)] = 120.0
    """An E2B polled watcher not polled for this long is dropped (its stream closed, its buffer freed)."""
    public_url: str | None = None
    """The base URL clients reach the API at (port token URLs); none: the URL of the request that asks."""
    ports_domain: Annotated[str | None, AfterValidator(_ports_domain)] = None
    """Serve each session's ports on a host of their own, ``<port>-<session id>.<ports_domain>``
    (``CAPSA_PORTS_DOMAIN=ports.example.com``, optionally with ``:port``), never on the API's origin: a
    wildcard DNS name (and certificate) for it points at the control plane, which routes by ``Host``.
    Port URLs the API answers use it. None: the path route ``/v1/sessions/{id}/ports/{port}/`` only,
    whose answers are stripped of what could act on the API's origin (:mod:`capsa.control.ports.headers`)."""
    port_token_ttl: Annotated[int, Field(ge=60)] = 86400
    """Seconds a port token lasts when its request names no ``ttl_seconds`` (``CAPSA_PORT_TOKEN_TTL``)."""
    port_token_max_ttl: Annotated[int, Field(ge=60)] = 7 * 86400
    """The longest ``ttl_seconds`` a port token may ask for (``CAPSA_PORT_TOKEN_MAX_TTL``)."""
    oauth_ca_file: Path | None = None
    """Extra CA certificates (PEM) trusted for connection providers' endpoints, beside the system's (an
    identity provider on a private CA); ``CAPSA_OAUTH_CA_FILE``."""
    oauth_allow_networks: AllowNetworks = []
    """Networks connection providers' endpoints (the issuer, its discovery document's endpoints and the
    ones given) may resolve into although they are not public (``CAPSA_OAUTH_ALLOW_NETWORKS``, comma- or
    space-separated CIDRs): an identity provider on the operator's own network. Every other endpoint must
    resolve only to public addresses (pinned for each connection) and be ``https://``; ``http://`` only to
    addresses in these networks. Empty by default."""
    webhook_allow_networks: AllowNetworks = []
    """``CAPSA_WEBHOOK_ALLOW_NETWORKS`` as the control plane reads it to refuse a policy's
    ``approval_webhook`` at the API (``destination_refused``); nodes read the same variable and screen
    again on every notification: give both the same value."""
    connection_login_ttl: Annotated[float, Field(gt=0, le=3600)] = 600.0
    """Seconds a sign-in (its ``state``, PKCE verifier or device code) stays usable."""
    allow_insecure_node_urls: bool = False
    """Accept plain ``http://`` node URLs off loopback (``CAPSA_ALLOW_INSECURE_NODE_URLS=1``, labs and
    tests only): the node's API token and every session's secrets would cross the network in clear."""

    audit_retention_days: Annotated[float, Field(ge=0)] = 30.0
    """Audit events older than this are purged by the reaper; 0 keeps them forever."""
    audit_max_events_per_tenant: Annotated[int, Field(ge=0)] = 1_000_000
    """A tenant's newest audit events kept; older ones are purged by the reaper; 0: no count limit."""
    audit_signing_key_file: Path | None = None
    """The Ed25519 private key (PEM, mode 0600) that signs audit checkpoints
    (``CAPSA_AUDIT_SIGNING_KEY_FILE``); ``capsa serve`` and ``capsa control`` create
    ``audit-signing.key`` in their state directory when it is not set. Keep it out of the database's
    reach (and its backups): whoever holds it can sign a shortened chain. None: no checkpoints, and a
    cut tail of the chain is not detected."""
    audit_checkpoint_file: Path | None = None
    """The append-only file signed checkpoints go to (``CAPSA_AUDIT_CHECKPOINT_FILE``; default
    ``audit-checkpoints.jsonl`` beside the key)."""
    audit_checkpoint_interval: Annotated[float, Field(ge=0)] = 300.0
    """Seconds between checkpoints of every chain that moved (``CAPSA_AUDIT_CHECKPOINT_INTERVAL``); 0:
    only on demand (``POST /v1/audit/checkpoints``) and when the replica stops. Events newer than the
    newest checkpoint are not covered by it."""
    audit_chain_retention_days: Annotated[float, Field(ge=0)] = 0.0
    """Events of the tenant audit chain older than this are dropped by the reaper, a stretch at a time,
    each behind a signed ``retention`` checkpoint that vouches for it (``CAPSA_AUDIT_CHAIN_RETENTION_DAYS``;
    needs the signing key); 0 (the default) keeps the chain forever."""
    audit_pages_per_collection: Annotated[int, Field(ge=1)] = 5
    """Audit pages (1000 events each) one heartbeat or audit read copies from a node; the rest waits for
    the next one, so a flooding node cannot hold a request or the database for long."""

    def quota_for(self, tenant: str) -> TenantQuota:
        return self.tenant_quotas.get(tenant, self.tenant_quota)
