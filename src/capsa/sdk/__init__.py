"""The capsa client SDK: ``Session`` (blocking) and ``AsyncSession`` over the capsa HTTP API."""

from __future__ import annotations

from capsa.common.wire.audit import AUDIT_KINDS
from capsa.common.wire.streams import FileEvent, OutputChunk, OutputEnd
from capsa.sdk.approvals import ApprovalInfo, AsyncApprovals
from capsa.sdk.approvals_sync import Approvals
from capsa.sdk.audit import AsyncAudit, AuditCheckpoint, AuditPage, AuditRecord, AuditVerification
from capsa.sdk.audit_sync import Audit
from capsa.sdk.client import AsyncClient, AsyncKeys
from capsa.sdk.commands import AsyncCommands, AsyncProcess, OutputCallback
from capsa.sdk.config import DEFAULT_API_URL, ClientConfig
from capsa.sdk.connections import (
    AsyncConnectionProviders,
    AsyncConnections,
    ConnectionInfo,
    Login,
    LoginPoll,
    ProviderInfo,
    Revocation,
)
from capsa.sdk.connections_sync import ConnectionProviders, Connections
from capsa.sdk.egress import AsyncEgress, AsyncSecrets, AuditEvent, PolicyInfo, SecretInfo
from capsa.sdk.egress_sync import Egress, Secrets
from capsa.sdk.errors import (
    BadRequest,
    CapsaAPIError,
    CapsaClientError,
    CapsaConnectionError,
    CapsaTimeoutError,
    FieldError,
    Forbidden,
    InternalError,
    InvalidState,
    NoCapacity,
    NodeUnreachable,
    NotFound,
    NotReady,
    PayloadTooLarge,
    RateLimited,
    SessionFailed,
    TemplateNotFound,
    Unauthorized,
    Unavailable,
    UnexpectedResponse,
    ValidationFailed,
)
from capsa.sdk.files import AsyncFiles, AsyncWatch, UploadSource
from capsa.sdk.models import (
    ApiKey,
    CommandResult,
    FileInfo,
    PortToken,
    PortTokenInfo,
    ProcessInfo,
    ProcessOutput,
    SessionInfo,
    SnapshotInfo,
)
from capsa.sdk.nodes import AsyncNodes, DrainResult, DrainStayed, EnrolToken, NodeInfo, Nodes
from capsa.sdk.ports import AsyncPortForward, AsyncPorts
from capsa.sdk.ports_sync import PortForward, Ports
from capsa.sdk.session import AsyncSession
from capsa.sdk.snapshots import AsyncSnapshots
from capsa.sdk.sync import Client, Commands, Files, Keys, Process, Session, Snapshots, Watch
from capsa.sdk.terminals import AsyncPty, AsyncTerminal
from capsa.sdk.terminals_sync import Pty, Terminal

__all__ = [
    "AUDIT_KINDS",
    "DEFAULT_API_URL",
    "ApiKey",
    "ApprovalInfo",
    "Approvals",
    "AsyncApprovals",
    "AsyncAudit",
    "AsyncClient",
    "AsyncCommands",
    "AsyncConnectionProviders",
    "AsyncConnections",
    "AsyncEgress",
    "AsyncFiles",
    "AsyncKeys",
    "AsyncNodes",
    "AsyncPortForward",
    "AsyncPorts",
    "AsyncProcess",
    "AsyncPty",
    "AsyncSecrets",
    "AsyncSession",
    "AsyncSnapshots",
    "AsyncTerminal",
    "AsyncWatch",
    "Audit",
    "AuditCheckpoint",
    "AuditEvent",
    "AuditPage",
    "AuditRecord",
    "AuditVerification",
    "BadRequest",
    "CapsaAPIError",
    "CapsaClientError",
    "CapsaConnectionError",
    "CapsaTimeoutError",
    "Client",
    "ClientConfig",
    "CommandResult",
    "Commands",
    "ConnectionInfo",
    "ConnectionProviders",
    "Connections",
    "DrainResult",
    "DrainStayed",
    "Egress",
    "EnrolToken",
    "FieldError",
    "FileEvent",
    "FileInfo",
    "Files",
    "Forbidden",
    "InternalError",
    "InvalidState",
    "Keys",
    "Login",
    "LoginPoll",
    "NoCapacity",
    "NodeInfo",
    "NodeUnreachable",
    "Nodes",
    "NotFound",
    "NotReady",
    "OutputCallback",
    "OutputChunk",
    "OutputEnd",
    "PayloadTooLarge",
    "PolicyInfo",
    "PortForward",
    "PortToken",
    "PortTokenInfo",
    "Ports",
    "Process",
    "ProcessInfo",
    "ProcessOutput",
    "ProviderInfo",
    "Pty",
    "RateLimited",
    "Revocation",
    "SecretInfo",
    "Secrets",
    "Session",
    "SessionFailed",
    "SessionInfo",
    "SnapshotInfo",
    "Snapshots",
    "TemplateNotFound",
    "Terminal",
    "Unauthorized",
    "Unavailable",
    "UnexpectedResponse",
    "UploadSource",
    "ValidationFailed",
    "Watch",
]
