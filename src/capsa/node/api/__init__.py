"""The node agent's HTTP API (``/node/v1``, spec/node.openapi.json), called only by the control plane.

One module per resource; every route parses its request with the models of :mod:`capsa.common.node_api`,
calls one action on the :class:`~capsa.node.agent.agent.NodeAgent` and serializes the answer with those
models.

The package imports nothing itself (``capsa.node.api.app`` assembles the routes). Errors are answered with the
node's one status table (:mod:`capsa.node.statuses`).
"""
