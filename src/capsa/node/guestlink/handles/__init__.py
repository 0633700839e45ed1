"""The long-lived guest calls a caller holds: a terminal, a port tunnel, an output stream, a watch."""
