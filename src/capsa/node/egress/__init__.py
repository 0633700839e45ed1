"""Node-side egress control: policy, DNS stub, broker (TLS interception with a per-sandbox CA),
credential injection and redaction, audit events."""

__all__: list[str] = []
