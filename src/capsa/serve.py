"""``capsa serve``: the control plane and one local node agent in a single process.

This module sits outside ``capsa.control`` and ``capsa.node`` because it is the one place allowed to wire
the two together (import-linter keeps them independent); they still talk only over the node HTTP API.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["run"]


async def run(host: str, port: int, state_dir: Path, database_url: str | None, accel: str) -> None:
    """Serve the HTTP API on ``host:port`` until cancelled, with a local node using ``state_dir``."""
    raise NotImplementedError("capsa serve is being built (engineer D)")
