"""What a node and the control plane send each other about connections (OAuth 2.0 sign-ins).

The control plane holds the client secret and the refresh token and refreshes; a node asks it for a
current access token of a connection a session on the node binds (``POST /v1/nodes/{id}/connections/
{connection}/token``) and is told to forget one when it is revoked (``POST /node/v1/connections/
{connection}/revoke``). Both sides decide "fresh enough" with :func:`refresh_margin`, so a node asks
exactly when the control plane would refresh.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ConnectionTokenOut", "ConnectionTokenRequest", "refresh_margin"]


def refresh_margin(lifetime: float) -> float:
    """Seconds before expiry at which a token counts as due for refresh: a quarter of its lifetime, at
    most a minute (a token that lives an hour is refreshed one minute early; one that lives 8 s, 2 s)."""
    return min(60.0, max(0.0, lifetime) / 4)


class ConnectionTokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: Annotated[str, Field(max_length=64)]
    """The session whose request needs the token: its policy must bind the connection, on this node."""


class ConnectionTokenOut(BaseModel):
    access_token: str = Field(repr=False)
    """Goes to the node only; the node keeps it encrypted and the broker puts it in the bound header."""
    expires_in: float
    """Seconds the token is still valid (the control plane's view; the node counts from receipt)."""
    lifetime: float
    """Seconds the token was issued for (for the refresh margin)."""
