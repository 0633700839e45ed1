"""The node agent's HTTP API (``/node/v1``, spec/node.openapi.json), called only by the control plane.

One module per resource; every route parses its request with the models of :mod:`capsa.common.node_api`,
calls one action on the :class:`~capsa.node.agent.NodeAgent` and serializes the answer with those models.
"""

from __future__ import annotations

from capsa.node.api.app import create_node_app

__all__ = ["create_node_app"]
