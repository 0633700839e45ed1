"""The node agent and its parts: :mod:`.agent` (:class:`~capsa.node.agent.agent.NodeAgent`: create,
adopt, destroy, snapshot sandboxes), :mod:`.sandboxes` (the table of sandbox records and held capacity),
:mod:`.capacity` (how much the node takes on), :mod:`.snapshots` (snapshots of session sandboxes),
:mod:`.sandbox_egress` (one sandbox's egress while it is made) and :mod:`.guest` (a sandbox's guest as the
node API calls it)."""

__all__: list[str] = []
