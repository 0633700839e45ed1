"""Other dialects served by the control plane: each translates a foreign wire protocol into calls on the
control plane's core (sessions, snapshots, node clients). Nothing here runs in the guest or the node."""

__all__: list[str] = []
