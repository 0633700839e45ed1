"""Per-sandbox network namespaces, tap devices and nftables firewalls."""

__all__: list[str] = []
