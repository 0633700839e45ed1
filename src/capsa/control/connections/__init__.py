"""Connections: OAuth 2.0 providers and sign-ins (``/v1/connection-providers``, ``/v1/connections``),
their sealed records, tokens for nodes and refresh, and purging finished sign-ins."""

__all__: list[str] = []
