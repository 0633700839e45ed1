"""Nodes as the control plane sees them: the registry (enrolment, heartbeats, loss), their secrets and
URLs, placement of new sandboxes, the HTTP client of the node API and what its errors become."""

__all__: list[str] = []
