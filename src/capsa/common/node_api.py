"""The node API contract (``/node/v1``, spec/node.openapi.json): every body the node agent and the control
plane send each other for a sandbox and its guest operations, declared once.

The node validates requests with these models at its HTTP edge and serializes its answers with them;
:class:`capsa.control.nodes.client.NodeClient` builds the requests and parses the answers into the same
models. Requests forbid unknown fields; answers allow them, so an older control plane can read a newer node.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, IPvAnyNetwork, SecretStr, TypeAdapter

from capsa.common.egress_policy import ApprovalScope, ApprovalState
from capsa.common.wire.streams import ExecError, ExecOutput
from capsa.guest.limits import (
    COMMAND_ENV_ENTRIES,
    DEFAULT_MAX_OUTPUT,
    ENV_NAME_CHARS,
    ENV_VALUE_CHARS,
    MAX_OUTPUT,
)

__all__ = [
    "APPROVAL_ID_PATTERN",
    "EXEC_EVENT",
    "GUEST_PATH_PATTERN",
    "MAX_EXEC_OUTPUT",
    "NDJSON",
    "ApprovalDecision",
    "ApprovalInfo",
    "ApprovalList",
    "AuditEvent",
    "AuditPage",
    "BranchEgress",
    "BranchRequest",
    "CommandSpec",
    "ExecEvent",
    "ExecFinished",
    "ExecRequest",
    "ExecResult",
    "ExecStatus",
    "FileInfo",
    "FileList",
    "KillRequest",
    "NodeHealth",
    "NodeInfo",
    "PauseRequest",
    "PolicyUpdate",
    "PolicyUpdated",
    "PoolEntry",
    "PoolStatus",
    "ProcessInfo",
    "ProcessList",
    "ProcessOutput",
    "ProcessStart",
    "RestoreRequest",
    "SandboxCreate",
    "SandboxInfo",
    "SandboxList",
    "SnapshotCreate",
    "SnapshotInfo",
    "SnapshotList",
    "TemplateInfo",
    "TemplateList",
]

NDJSON = "application/x-ndjson"
"""Media type of the exec event stream (one :data:`ExecEvent` per line)."""
GUEST_PATH_PATTERN = r"^/[^\x00]*$"
"""An absolute path inside the sandbox (query parameter ``path`` of the file routes, at most 4096 chars)."""
APPROVAL_ID_PATTERN = r"^apr_[a-z0-9]{20}$"
"""An approval's id (made by the node that holds its request)."""
MAX_EXEC_OUTPUT = MAX_OUTPUT
"""Upper bound of :attr:`ExecRequest.max_output` (bytes kept per stream)."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore")


_SandboxId = Annotated[str, Field(pattern=r"^sbx_[0-9a-z]{20}$")]
_Env = Annotated[dict[Annotated[str, Field(max_length=ENV_NAME_CHARS)],
                      Annotated[str, Field(max_length=ENV_VALUE_CHARS)]],
                 Field(max_length=COMMAND_ENV_ENTRIES)]
_Secrets = Annotated[dict[Annotated[str, Field(pattern=r"^sec_[0-9a-z]{20}$")],
                          Annotated[SecretStr, Field(min_length=1, max_length=65536)]],
                     Field(max_length=64)]
_Placeholders = Annotated[dict[Annotated[str, Field(pattern=r"^sec_[0-9a-z]{20}$")],
                               Annotated[str, Field(pattern=r"^capsa_ph_[A-Za-z0-9_-]{16,128}$")]],
                          Field(max_length=64)]
"""secret id -> the session's placeholder for it (what its guest holds), recorded by the control plane."""
_SessionId = Annotated[str, Field(max_length=64)]
_Networks = Annotated[list[IPvAnyNetwork], Field(max_length=256)]
"""The networks the session's tenant was granted (``/v1/egress-grants``): of the node's internal networks
(``CAPSA_EGRESS_ALLOW_NETWORKS``), those the sandbox may reach."""
_Tenant = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")]
_Labels = Annotated[dict[Annotated[str, Field(min_length=1, max_length=64)],
                         Annotated[str, Field(max_length=256)]], Field(max_length=32)]


# -- the node --------------------------------------------------------------------------------------------
class NodeHealth(_Answer):
    status: Literal["ok"]
    node_id: str


class NodeInfo(_Answer):
    node_id: str
    runtime: str
    templates: list[str]
    capacity: dict[str, int]
    """``memory_mib``, ``vcpus``, ``max_sandboxes``."""
    used: dict[str, int]
    """``memory_mib``, ``vcpus``, ``sandboxes`` (booting ones included)."""
    failed_sandboxes: list[str]


# -- sandboxes -------------------------------------------------------------------------------------------
class SandboxCreate(_Request):
    id: _SandboxId
    template: Annotated[str, Field(min_length=1, max_length=128)] = "base"
    memory_mib: Annotated[int, Field(ge=64, le=65536)] = 256
    vcpus: Annotated[int, Field(ge=1, le=64)] = 1
    env: _Env = Field(default_factory=dict)
    session_id: Annotated[str, Field(max_length=64)] | None = None
    """Recorded in the sandbox's egress audit events."""
    policy: dict[str, Any] | None = None
    """Egress policy document (capsa.common.egress_policy); none: the sandbox gets no NIC at all."""
    secrets: _Secrets = Field(default_factory=dict)
    """Values of the secrets the policy binds, by id. Write-only: never returned, never logged."""
    placeholders: _Placeholders = Field(default_factory=dict)
    """The session's placeholders by secret id; a binding without one gets a random placeholder."""
    granted_networks: _Networks = Field(default_factory=list)
    tenant: _Tenant | None = None
    """The session's tenant: with ``CAPSA_TEMPLATE_SHARING=tenant`` only sandboxes of one tenant share a
    template's RAM pages."""


class SandboxInfo(_Answer):
    id: str
    template: str
    memory_mib: int
    vcpus: int
    state: str
    failure: str | None
    accelerator: str
    created_at: float
    source: str | None = None
    """How it was made: pool | restore | boot (docs/node-snapshots.md); None from agents without snapshots."""
    snapshot: str | None = None
    """The snapshot it was restored from (a template's snapshot for pool and on-demand creations)."""
    create_ms: float | None = None


class SandboxList(_Answer):
    items: list[SandboxInfo]


# -- egress ----------------------------------------------------------------------------------------------
class PolicyUpdate(_Request):
    policy: dict[str, Any]
    secrets: _Secrets = Field(default_factory=dict)
    placeholders: _Placeholders = Field(default_factory=dict)
    """For new bindings (kept bindings keep the placeholder they have)."""
    granted_networks: _Networks | None = None
    """None: the sandbox keeps the ones it has."""


class PolicyUpdated(_Answer):
    ca_reissued: bool
    """The sandbox CA had to be re-issued for new domains and was re-installed in the guest."""


class AuditEvent(_Answer):
    seq: int
    kind: str
    session_id: str | None
    sandbox_id: str
    time: float
    source: str | None
    destination: str | None
    resolved_ip: str | None
    method: str | None
    path: str | None
    status: int | None
    bytes_out: int
    bytes_in: int
    decision: str
    rule: str | None
    reason: str | None
    secret_ids: list[str]
    count: int
    detail: dict[str, Any] | None = None
    """Approval and connection events: what was decided or used (absent for plain egress events)."""
    request_id: str | None = None
    """The control-plane API request that caused the event, when one did."""


class ApprovalInfo(_Answer):
    """A request held by a node's egress broker for approval (pending), or one decided recently."""

    id: str
    sandbox_id: str
    session_id: str | None
    destination: str
    method: str
    path: str
    rule: str
    """The policy's domain rule the request matched."""
    approval_rule: str
    scope: ApprovalScope
    preview: str
    """The start of the request body (at most 2 KiB), secrets and placeholders redacted."""
    body_bytes: int
    created_at: float
    expires_at: float
    state: ApprovalState
    decided_by: str | None = None
    decided_at: float | None = None
    reason: str | None = None


class ApprovalList(_Answer):
    items: list[ApprovalInfo]


class ApprovalDecision(_Request):
    approve: bool
    decided_by: Annotated[str, Field(min_length=1, max_length=128)]
    """Who decided (the control plane sends the API key id); named in the audit events."""
    scope: ApprovalScope | None = None
    """What an approval covers; None: the rule's scope."""
    reason: Annotated[str, Field(max_length=1024)] | None = None
    session_id: str | None = None
    """When given, the approval must be this session's (else ``approval_not_found``)."""


class AuditPage(_Answer):
    epoch: str
    """Changes with every node process; a cursor from another epoch restarts from the oldest event."""
    items: list[AuditEvent]
    last_seq: int
    lost: int
    dropped: dict[str, int] = Field(default_factory=dict)
    """Events per session id that left the node's buffer before any reader collected them (this epoch)."""


# -- commands and processes ------------------------------------------------------------------------------
class CommandSpec(_Request):
    cmd: str | Annotated[list[str], Field(min_length=1)]
    """A shell line (run by ``/bin/sh -c``) or an argv."""
    env: _Env = Field(default_factory=dict)
    """Added to the sandbox's own env for this command."""
    cwd: str | None = None
    user: str | None = None


class ProcessStart(CommandSpec):
    open_stdin: bool = False
    """Keep a pipe to the process's stdin (``/processes/{pid}/stdin``); otherwise stdin is /dev/null."""


class ExecRequest(CommandSpec):
    timeout: Annotated[float, Field(gt=0)] | None = None
    stdin: str | None = None
    max_output: Annotated[int, Field(ge=0, le=MAX_EXEC_OUTPUT)] = DEFAULT_MAX_OUTPUT
    """Bytes of stdout and of stderr kept; the rest is counted as truncated."""


class ExecStatus(_Answer):
    """How a command ended (shared by the JSON result and the stream's ``result`` event)."""

    exit_code: int | None
    signal: int | None
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    duration_ms: float
    oom_killed: bool = False
    """The kernel's OOM killer ended a process of the command."""


class ExecResult(ExecStatus):
    """The answer of ``POST /sandboxes/{id}/exec`` without ``Accept: application/x-ndjson``."""

    stdout: str
    stderr: str


class ExecFinished(ExecStatus):
    """The last event of a stream whose command ran to its end."""

    type: Literal["result"] = "result"


ExecEvent = Annotated[ExecOutput | ExecFinished | ExecError, Field(discriminator="type")]
"""One line of the exec event stream: output events, then exactly one ``result`` or ``error``."""
EXEC_EVENT: TypeAdapter[ExecOutput | ExecFinished | ExecError] = TypeAdapter(ExecEvent)
"""Parses and serializes one :data:`ExecEvent` (``EXEC_EVENT.validate_json(line)``)."""


class ProcessInfo(_Answer):
    pid: int
    cmd: list[str]
    running: bool
    exit_code: int | None
    signal: int | None
    started_at: str
    """ISO 8601, UTC."""
    stdin_open: bool = False
    """Started with ``open_stdin`` and its stdin not closed yet."""


class ProcessList(_Answer):
    items: list[ProcessInfo]


class ProcessOutput(_Answer):
    stdout: str
    stderr: str
    running: bool
    exit_code: int | None
    signal: int | None
    stdout_truncated: bool
    stderr_truncated: bool


class KillRequest(_Request):
    signal: Annotated[int, Field(ge=1, le=64)] = 15


# -- files -----------------------------------------------------------------------------------------------
class FileInfo(_Answer):
    path: str
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    """Permission bits."""
    mtime: float


class FileList(_Answer):
    items: list[FileInfo]


# -- snapshots -------------------------------------------------------------------------------------------
class SnapshotCreate(_Request):
    retain: bool = False
    """Kept when its sandbox is destroyed (pause snapshots always are)."""
    labels: _Labels = Field(default_factory=dict)
    tenant: _Tenant | None = None
    """Whose snapshot it is: the scope of its data in the fleet's store."""


class PauseRequest(_Request):
    labels: _Labels = Field(default_factory=dict)
    tenant: _Tenant | None = None


class RestoreRequest(_Request):
    id: _SandboxId
    """The new sandbox's id."""
    env: _Env = Field(default_factory=dict)
    session_id: _SessionId | None = None
    """Recorded in the sandbox's egress audit events."""
    policy: dict[str, Any] | None = None
    """The session's egress policy: required for a snapshot with a NIC (``policy_required``), refused for
    one without (``no_network``). Egress is attached again on a new namespace and tap."""
    secrets: _Secrets = Field(default_factory=dict)
    placeholders: _Placeholders = Field(default_factory=dict)
    """The session's placeholders: those its guest already holds keep working."""
    granted_networks: _Networks = Field(default_factory=list)


class BranchEgress(_Request):
    """One branch's egress: its own session (audit identity) under its own copy of the policy."""

    session_id: _SessionId | None = None
    policy: dict[str, Any]
    secrets: _Secrets = Field(default_factory=dict)
    placeholders: _Placeholders = Field(default_factory=dict)
    granted_networks: _Networks = Field(default_factory=list)


class BranchRequest(_Request):
    # The count is checked by the agent (invalid_branch_count), so 0 or 10 000 ids get that code.
    ids: Annotated[list[str], Field(max_length=100_000)]
    env: _Env = Field(default_factory=dict)
    egress: Annotated[list[BranchEgress], Field(max_length=100_000)] | None = None
    """One per id, in order, for a snapshot with a NIC (each branch gets its own namespace, tap and CA)."""


class SnapshotInfo(_Answer):
    id: str
    sandbox_id: str | None
    retain: bool
    template: str | None
    created_at: str
    parent: str | None
    memory_mib: int
    vcpus: int
    image_digest: str
    size_bytes: int
    labels: dict[str, str]
    stored: bool = False
    """In the fleet's store: any node that reads it can restore the snapshot."""


class SnapshotList(_Answer):
    items: list[SnapshotInfo]


# -- templates and the warm pool -------------------------------------------------------------------------
class TemplateInfo(_Answer):
    name: str
    digest: str
    snapshot: str
    memory_mib: int
    vcpus: int
    image_digest: str
    created_at: str
    spec: dict[str, Any] | None
    size_bytes: int


class TemplateList(_Answer):
    items: list[TemplateInfo]


class PoolEntry(_Answer):
    template: str
    memory_mib: int
    vcpus: int
    target: int
    idle: int
    restoring: int
    hits: int
    misses: int
    refill_failures: int


class PoolStatus(_Answer):
    templates: list[PoolEntry]
