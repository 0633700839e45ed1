"""Peers for the session-creation benchmark (bench/run_peers.py): gVisor runsc, nitrobox, llm-sandbox.

Everything a peer needs is installed under the bench's own cache directory (never into the project's
virtualenv or the host's apt sources): see :mod:`peers.install`.
"""

__all__: list[str] = []
