"""Bodies of the node agent API (spec/node.openapi.json)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

__all__ = [
    "AuditEventOut",
    "AuditPageOut",
    "ExecRequest",
    "FileInfoOut",
    "FileListOut",
    "KillBody",
    "NodeInfo",
    "PolicyUpdateIn",
    "PolicyUpdateOut",
    "ProcessListOut",
    "ProcessOut",
    "ProcessOutputOut",
    "ProcessStart",
    "SandboxCreate",
    "SandboxList",
    "SandboxOut",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_Env = Annotated[dict[Annotated[str, Field(max_length=128)], Annotated[str, Field(max_length=4096)]],
                 Field(max_length=256)]


_Secrets = Annotated[dict[Annotated[str, Field(pattern=r"^sec_[0-9a-z]{20}$")],
                           Annotated[SecretStr, Field(min_length=1, max_length=65536)]],
                      Field(max_length=64)]


class SandboxCreate(_Strict):
    id: Annotated[str, Field(pattern=r"^sbx_[0-9a-z]{20}$")]
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


class PolicyUpdateIn(_Strict):
    policy: dict[str, Any]
    secrets: _Secrets = Field(default_factory=dict)


class PolicyUpdateOut(BaseModel):
    ca_reissued: bool
    """The sandbox CA had to be re-issued for new domains and was re-installed in the guest."""


class AuditEventOut(BaseModel):
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


class AuditPageOut(BaseModel):
    epoch: str
    """Changes with every node process; a cursor from another epoch restarts from the oldest event."""
    items: list[AuditEventOut]
    last_seq: int
    lost: int


class SandboxOut(BaseModel):
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


class SandboxList(BaseModel):
    items: list[SandboxOut]


class NodeInfo(BaseModel):
    node_id: str
    runtime: str
    templates: list[str]
    capacity: dict[str, int]
    used: dict[str, int]
    failed_sandboxes: list[str]


class ProcessStart(_Strict):
    cmd: str | Annotated[list[str], Field(min_length=1)]
    env: _Env = Field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None


class ExecRequest(ProcessStart):
    timeout: Annotated[float, Field(gt=0)] | None = None
    stdin: str | None = None
    max_output: Annotated[int, Field(ge=0, le=1 << 30)] = 16 << 20


class ProcessOut(BaseModel):
    pid: int
    cmd: list[str]
    running: bool
    exit_code: int | None
    signal: int | None
    started_at: str


class ProcessListOut(BaseModel):
    items: list[ProcessOut]


class ProcessOutputOut(BaseModel):
    stdout: str
    stderr: str
    running: bool
    exit_code: int | None
    signal: int | None
    stdout_truncated: bool
    stderr_truncated: bool


class KillBody(_Strict):
    signal: Annotated[int, Field(ge=1, le=64)] = 15


class FileInfoOut(BaseModel):
    path: str
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


class FileListOut(BaseModel):
    items: list[FileInfoOut]
