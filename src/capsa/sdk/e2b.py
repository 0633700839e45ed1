"""Where capsa serves the E2B dialect, and the environment that points the stock ``e2b`` SDK at it.

No E2B code is needed on the client: the environment alone (printed by ``capsa e2b env``) makes the stock
SDK talk to capsa (docs/e2b.md).
"""

from __future__ import annotations

from capsa.sdk.config import ClientConfig

__all__ = ["E2B_ENVD_PATH", "E2B_MOUNT_PATH", "e2b_environment"]

E2B_MOUNT_PATH = "/e2b"
"""The control plane serves E2B's REST API under this path (``E2B_API_URL``)."""
E2B_ENVD_PATH = "/envd"
"""… and the sandbox daemon protocol under this one below it (``E2B_SANDBOX_URL``)."""


def e2b_environment(config: ClientConfig) -> dict[str, str]:
    """``E2B_*`` variables for the capsa API and key in ``config`` (which must have a key).

    ``E2B_VALIDATE_API_KEY=false``: SDKs that check the key's format (2.31) otherwise refuse keys that
    do not look like ``e2b_<hex>``.
    """
    if not config.api_key:
        raise ValueError("no API key: set CAPSA_API_KEY or pass one")
    base = config.api_url.rstrip("/") + E2B_MOUNT_PATH
    return {"E2B_API_URL": base, "E2B_SANDBOX_URL": base + E2B_ENVD_PATH, "E2B_API_KEY": config.api_key,
            "E2B_VALIDATE_API_KEY": "false"}
