"""What a node and the control plane send each other over ``/v1/nodes`` (enrol, register, heartbeat, leave).

Both sides import these models: the control plane validates them at its edge, the ``capsa node`` daemon
builds them. Requests forbid unknown fields; answers allow them, so an older node can read a newer plane.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "Capacity",
    "HeartbeatOut",
    "NodeEnrol",
    "NodeEnrolled",
    "NodeHeartbeat",
    "NodeOut",
    "NodeRegister",
]

_Url = Annotated[str, Field(min_length=1, max_length=1024, pattern=r"^(https?|unix)://")]
"""Where the node's API listens; the control plane also wants https://, unix:// or http:// on loopback
(capsa.control.nodes.urls)."""
_ApiToken = Annotated[str, Field(min_length=16, max_length=256, pattern=r"^[\x21-\x7e]+$")]
"""The token the control plane presents when it calls the node's API."""
_Templates = Annotated[list[Annotated[str, Field(min_length=1, max_length=128)]], Field(max_length=256)]
_SandboxIds = Annotated[list[Annotated[str, Field(max_length=64)]], Field(max_length=10000)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Capacity(_Strict):
    memory_mib: Annotated[int, Field(ge=0, le=1 << 30)]
    vcpus: Annotated[int, Field(ge=0, le=1 << 20)]
    max_sandboxes: Annotated[int, Field(ge=0, le=1 << 20)]


class NodeRegister(_Strict):
    """A node (re-)announcing where it listens and what it can run; sent after every start."""

    url: _Url
    api_token: _ApiToken
    capacity: Capacity
    templates: _Templates = Field(default_factory=lambda: ["base"])
    egress: bool = False
    """Whether the node can run sessions with an egress policy (it has a broker and can make taps)."""
    store: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    """The fleet store the node writes its snapshots to (``CAPSA_STORE_URL``, with its S3 endpoint); nodes
    reporting the same store restore each other's stored snapshots."""


class NodeEnrol(NodeRegister):
    """First contact of a new node, authenticated by a one-time enrolment token."""

    name: Annotated[str, Field(min_length=1, max_length=128)] | None = None


class NodeEnrolled(BaseModel):
    id: str
    credential: str
    """The node's own secret for register, heartbeat and leave; shown once, stored hashed."""


class NodeHeartbeat(_Strict):
    capacity: Capacity | None = None
    used: dict[Annotated[str, Field(max_length=64)], Annotated[int, Field(ge=0, le=1 << 40)]] = \
        Field(default_factory=dict, max_length=16)
    failed_sandboxes: _SandboxIds = Field(default_factory=list)
    """Sandboxes whose VM died since they were created; their sessions become ``failed``."""
    sandboxes: _SandboxIds | None = None
    """Every sandbox the node holds; the answer's ``destroy_sandboxes`` lists those no live session owns."""
    templates: _Templates | None = None
    """The templates the node can boot now, when they changed since it registered."""


class NodeOut(BaseModel):
    id: str
    name: str | None = None
    url: str
    capacity: dict[str, int]
    """What placement uses: the node's report, bounded by ``capacity_limit``."""
    capacity_limit: dict[str, int] | None = None
    """What the node enrolled with or an admin set (``PATCH /v1/nodes/{id}``); reports never exceed it."""
    used: dict[str, int]
    templates: list[str]
    egress: bool = False
    store: str | None = None
    draining: bool = False
    """Its sessions are being moved off (``capsa nodes drain``); it gets no new ones."""
    registered_at: datetime
    last_heartbeat_at: datetime
    left_at: datetime | None = None
    """When the node said it was stopping; it gets no new sessions until it registers again."""
    healthy: bool


class HeartbeatOut(NodeOut):
    destroy_sandboxes: list[str]
    """Sandboxes the node should destroy: their sessions ended but the destroy call never reached the node."""
