"""Sessions: their states and lifecycle (create, close, fail, expire; pause, resume, branch, snapshots,
restore, rolling snapshots), the running-session cache, the relay every front end calls a running session's
sandbox through, processes, terminals and watches over it, and the ``session`` audit events."""

__all__: list[str] = []
