"""Browsers and desktops in sandboxes: the Chrome DevTools Protocol over port tunnels, and computer-use
actions on a browser page or a desktop session's X screen."""

__all__: list[str] = []
