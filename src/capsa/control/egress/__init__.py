"""Egress control in the control plane: secrets, session policies (and changing them live), grants of
internal networks, and the egress audit trail pulled from nodes."""

__all__: list[str] = []
