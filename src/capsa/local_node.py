"""``capsa serve``'s control plane calling its own node in-process.

In ``capsa serve`` the control plane and its node share one process, yet every node call went through
HTTP over the node's Unix socket: serialized, parsed and routed twice, about 3 ms on this kind of host,
on every command and every creation. :class:`LocalNodeClient` takes the two calls of the session hot
path, a command run to its end and a sandbox creation, straight to the node's handlers
(:func:`capsa.node.api.commands.exec_to_end`, :func:`capsa.node.api.sandboxes.create_from`), with the
node API's own request and answer models and its error codes and statuses (a ``NodeError`` the same as
over HTTP). Everything else, streams included, still goes over the socket like any node's. The node
token is not presented: the caller is this process. A node on another host is reached over HTTP only.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping
from typing import TypeVar

from pydantic import ValidationError

from capsa.common.errors import CapsaError
from capsa.common.node_api import ExecRequest, ExecResult, SandboxCreate, SandboxInfo
from capsa.control.nodeclient import EgressArgs, NodeClient, NodeError
from capsa.node.agent import NodeAgent
from capsa.node.api.commands import exec_to_end
from capsa.node.api.errors import status_of
from capsa.node.api.sandboxes import create_from

__all__ = ["LocalNodeClient"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class LocalNodeClient(NodeClient):
    def __init__(self, url: str, token: str, agent: NodeAgent, *, timeout: float = 120.0) -> None:
        super().__init__(url, token, timeout=timeout)
        self._agent = agent

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        return await _as_node_call(exec_to_end(self._agent, sandbox_id, request))

    async def create_sandbox(self, sandbox_id: str, template: str, memory_mib: int, vcpus: int,
                             env: Mapping[str, str], *, egress: EgressArgs | None = None) -> SandboxInfo:
        body = self.create_body(sandbox_id, template, memory_mib, vcpus, env, egress=egress)
        try:
            request = SandboxCreate.model_validate(body)  # what the node's route validates
        except ValidationError as exc:
            fields = ", ".join(".".join(("body", *map(str, e.get("loc", ())))) for e in exc.errors()[:5])
            raise NodeError("validation_error", 422, f"invalid request: {fields}") from None
        return await _as_node_call(create_from(self._agent, request))


async def _as_node_call(call: Awaitable[_T]) -> _T:
    """The node's answer, or the ``NodeError`` its API would have answered with."""
    try:
        return await call
    except NodeError:
        raise
    except CapsaError as exc:
        raise NodeError(exc.code, status_of(exc), exc.message) from exc
    except Exception as exc:
        log.exception("node agent error")
        raise NodeError("internal_error", 500, "internal error") from exc
