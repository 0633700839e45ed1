"""Request and response bodies of the public API (docs/api-contract.md).

The answers that the SDK parses (sessions, snapshots, command results, processes, files) are declared once,
in :mod:`capsa.sdk.models`, and imported here; this module adds the requests, with their limits, and the
list envelopes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from capsa.common.node_wire import (
    Capacity,
    HeartbeatOut,
    NodeEnrol,
    NodeEnrolled,
    NodeHeartbeat,
    NodeOut,
    NodeRegister,
)
from capsa.control.egress.schemas import PolicyDocument
from capsa.guest.limits import ENV_ENTRIES, ENV_NAME_CHARS, ENV_VALUE_CHARS, STDIN_CHARS
from capsa.sdk.models import (
    CommandResult,
    FileInfo,
    PortToken,
    PortTokenInfo,
    ProcessInfo,
    ProcessOutput,
    RollingSnapshots,
    SessionInfo,
    SessionState,
    SnapshotInfo,
)

__all__ = [
    "ApiKeyCreate",
    "ApiKeyCreated",
    "ApiKeyList",
    "ApiKeyOut",
    "BranchOut",
    "BranchRequest",
    "Capacity",
    "CommandRequest",
    "CommandResult",
    "DrainOut",
    "DrainStayed",
    "FileInfo",
    "FileList",
    "Health",
    "HeartbeatOut",
    "KillRequest",
    "NodeCreate",
    "NodeEnrol",
    "NodeEnrolled",
    "NodeHeartbeat",
    "NodeList",
    "NodeOut",
    "NodeRegister",
    "NodeToken",
    "NodeTokenCreate",
    "NodeUpdate",
    "PortToken",
    "PortTokenCreate",
    "PortTokenInfo",
    "PortTokenList",
    "ProblemDetail",
    "ProcessInfo",
    "ProcessList",
    "ProcessOutput",
    "Ready",
    "RestoreRequest",
    "RollingSnapshots",
    "SessionCreate",
    "SessionList",
    "SessionOut",
    "SessionState",
    "SnapshotCreate",
    "SnapshotList",
    "SnapshotOut",
    "TimeoutUpdate",
]

_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
_Name = Annotated[str, Field(pattern=_NAME_PATTERN, min_length=1, max_length=ENV_NAME_CHARS)]
_Value = Annotated[str, Field(max_length=ENV_VALUE_CHARS)]


def _no_nul(mapping: dict[str, str]) -> dict[str, str]:
    # A NUL byte cannot be passed through an environment or stored in PostgreSQL text.
    for key, value in mapping.items():
        if "\x00" in value:
            raise ValueError(f"value of {key!r} contains a NUL character")
    return mapping


_StrMap = Annotated[dict[_Name, _Value], Field(max_length=ENV_ENTRIES), AfterValidator(_no_nul)]
"""An env (and a session's metadata): :data:`~capsa.guest.limits.ENV_ENTRIES` entries at most."""
_Text = Annotated[str, AfterValidator(lambda s: _no_nul({"text": s})["text"])]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProblemDetail(BaseModel):
    type: str
    title: str
    status: int
    detail: str
    code: str


class Health(BaseModel):
    status: Literal["ok"]
    version: str


class Ready(BaseModel):
    status: Literal["ready"]




class SessionCreate(_Strict):
    template: Annotated[str, Field(min_length=1, max_length=128,
                                   pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")] = "base"
    timeout: Annotated[int, Field(ge=1, le=86400)] = 3600
    idle_timeout: Annotated[int, Field(ge=1, le=86400)] | None = None
    env: _StrMap = Field(default_factory=dict)
    metadata: _StrMap = Field(default_factory=dict)
    memory_mib: Annotated[int, Field(ge=64, le=65536)] = 256
    vcpus: Annotated[int, Field(ge=1, le=64)] = 1
    policy: PolicyDocument | None = None
    """Egress policy (domains, rules, secret bindings by secret name or id); none: no network at all."""
    on_timeout: Literal["pause", "close"] = "close"
    """What the reaper does when the TTL or idle timeout passes: pause (keep a snapshot) or close."""
    rolling_snapshots: RollingSnapshots | None = None
    keep_snapshots: bool = False
    """Keep the session's snapshots when it closes (they are deleted otherwise)."""
    expose: Annotated[list[Annotated[int, Field(ge=1, le=65535)]], Field(max_length=64)] | None = None
    """The only ports the port proxy may reach (``port_not_exposed``, 403, for others); none: any port."""


class SessionOut(SessionInfo):
    # The SDK's SessionInfo under the name the API's schema has always used; no field is added here.
    pass


class SessionList(BaseModel):
    items: list[SessionOut]
    next_cursor: str | None


class TimeoutUpdate(_Strict):
    timeout: Annotated[int, Field(ge=1, le=86400)]


class BranchRequest(_Strict):
    n: Annotated[int, Field(ge=1, le=32, strict=True)] = 1


class BranchOut(BaseModel):
    snapshot_id: str
    """The snapshot every branch started from."""
    items: list[SessionOut]


class SnapshotCreate(_Strict):
    pass


class RestoreRequest(_Strict):
    snapshot_id: Annotated[str, Field(pattern=r"^snap_[0-9a-z]{20}$")]


class SnapshotOut(SnapshotInfo):
    # The SDK's SnapshotInfo under the name the API's schema has always used; no field is added here.
    pass


class SnapshotList(BaseModel):
    items: list[SnapshotOut]


class CommandRequest(_Strict):
    cmd: Annotated[_Text, Field(min_length=1, max_length=131072)] | Annotated[
        list[Annotated[_Text, Field(max_length=131072)]], Field(min_length=1, max_length=4096)]
    env: _StrMap = Field(default_factory=dict)
    cwd: Annotated[_Text, Field(min_length=1, max_length=4096)] | None = None
    user: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_-]*$", max_length=32)] | None = None
    timeout: Annotated[float, Field(gt=0, le=86400)] | None = None
    stdin: Annotated[str, Field(max_length=STDIN_CHARS)] | None = None
    background: bool = False
    open_stdin: bool = False
    """Background only: keep a pipe to the process's stdin for ``/processes/{pid}/stdin`` (else /dev/null)."""






class ProcessList(BaseModel):
    items: list[ProcessInfo]




class KillRequest(_Strict):
    signal: Annotated[int, Field(ge=1, le=64)] = 15




class FileList(BaseModel):
    items: list[FileInfo]


class ApiKeyCreate(_Strict):
    tenant: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    admin: bool = False
    name: Annotated[_Text, Field(max_length=128)] | None = None


class ApiKeyOut(BaseModel):
    id: str
    tenant: str
    admin: bool
    name: str | None
    created_at: datetime
    revoked_at: datetime | None


class ApiKeyCreated(ApiKeyOut):
    key: str


class ApiKeyList(BaseModel):
    items: list[ApiKeyOut]


class NodeCreate(_Strict):
    """An admin registering a node by hand: the admin picks the id.

    ``token`` is both the node's API token (which the control plane presents to it) and its credential
    for heartbeats; a node started with ``capsa node`` enrols instead and gets a credential of its own.
    """

    id: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    url: Annotated[str, Field(min_length=1, max_length=1024, pattern=r"^(https?|unix)://")]
    token: Annotated[str, Field(min_length=16, max_length=256, pattern=r"^[\x21-\x7e]+$")]
    capacity: Capacity
    templates: Annotated[list[Annotated[str, Field(min_length=1, max_length=128)]], Field(max_length=256)] = \
        Field(default_factory=lambda: ["base"])
    egress: bool = True
    """Whether the node can run sessions with an egress policy (assumed, as before nodes reported it)."""

    def registration(self) -> NodeRegister:
        return NodeRegister(url=self.url, api_token=self.token, capacity=self.capacity,
                            templates=self.templates, egress=self.egress)


class NodeUpdate(_Strict):
    """An admin changing a node."""

    capacity_limit: Capacity | None = None
    """The most the node may report (memory, vCPUs, sandboxes); its reports are bounded by it, so raising
    what a node takes needs an admin."""


class PortTokenCreate(_Strict):
    ttl_seconds: Annotated[int, Field(ge=60)] | None = None
    """How long the token works (at least a minute, at most the API's ``CAPSA_PORT_TOKEN_MAX_TTL``,
    a week by default); none: ``CAPSA_PORT_TOKEN_TTL`` (a day by default)."""


class PortTokenList(BaseModel):
    items: list[PortTokenInfo]


class NodeTokenCreate(_Strict):
    ttl_seconds: Annotated[int, Field(ge=60, le=7 * 86400)] = 3600
    """How long the enrolment token stays valid (one minute to one week)."""


class NodeToken(BaseModel):
    token: str
    """A one-time enrolment token for ``capsa node --enrol-token``; shown once, stored hashed."""
    expires_at: datetime


class NodeList(BaseModel):
    items: list[NodeOut]


class DrainStayed(BaseModel):
    session_id: str
    reason: str
    """Why it did not move (it stays paused and can be resumed)."""


class DrainOut(BaseModel):
    node: NodeOut
    moved: list[str]
    """Sessions now running on another node, with their memory, processes and files."""
    stayed: list[DrainStayed]
    drained: bool
    """No session holds a sandbox on the node any more."""
