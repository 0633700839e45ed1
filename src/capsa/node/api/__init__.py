"""The node agent's HTTP API (``/node/v1``, spec/node.openapi.json), called only by the control plane.

One module per resource; every route parses its request with the models of :mod:`capsa.common.node_api`,
calls one action on the :class:`~capsa.node.agent.agent.NodeAgent` and serializes the answer with those
models.

The package imports nothing itself (``capsa.node.api.app`` assembles the routes): the node's core may take the
edge's one status table (:func:`capsa.node.api.errors.status_of`) without importing the routes, and so the
agent, back.
"""
