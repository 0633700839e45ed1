"""Session ports: who may reach them, where they are served, and the proxy that relays HTTP and
WebSocket traffic to them."""

__all__: list[str] = []
