"""The tenant audit chain and the audit trails: appending (per request, group-committed), reading and
verifying, signed checkpoints and their anchor, retention, and what ``/v1/audit`` does."""

__all__: list[str] = []
