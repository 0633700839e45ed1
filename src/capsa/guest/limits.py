"""Limits of commands, declared once: checked at the public edge (the control plane's schemas), by the node
API's schemas, and in the guest daemon. Standard library only (the module ships in the guest image).
"""

from __future__ import annotations

__all__ = [
    "COMMAND_ENV_ENTRIES",
    "DEFAULT_MAX_OUTPUT",
    "ENV_ENTRIES",
    "ENV_NAME_CHARS",
    "ENV_VALUE_CHARS",
    "MAX_OUTPUT",
    "STDIN_CHARS",
]

ENV_ENTRIES = 64
"""Entries of one env the public API takes: a session's, or one command's (problem ``validation_error``)."""
COMMAND_ENV_ENTRIES = 256
"""Entries of the env a command is given in the guest: the sandbox's env, what egress put there (proxy
settings, secret placeholders) and the command's own, merged by the node; the bound of one env in the node
API and of what the guest daemon accepts. Public envs (:data:`ENV_ENTRIES` each) fit in it with room."""
ENV_NAME_CHARS = 128
"""Characters of an env variable's name."""
ENV_VALUE_CHARS = 4096
"""Characters of an env variable's value."""
DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024
"""Bytes of stdout and of stderr a command keeps when the caller does not say (the rest is truncated)."""
MAX_OUTPUT = 1 << 30
"""The most a caller may ask a command to keep per stream (``max_output``)."""
STDIN_CHARS = 16 * 1024 * 1024
"""Characters of a command's stdin given with the request (``stdin``)."""
