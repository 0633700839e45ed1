"""Approvals in the control plane: held egress requests found on the nodes, and decisions sent to them
(``/v1/approvals``)."""

__all__: list[str] = []
