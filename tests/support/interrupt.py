"""Starting a child that Ctrl-C can reach.

A shell without job control (a CI script's lanes, ``cmd &``) starts its background jobs with SIGINT ignored,
and an ignored signal stays ignored across ``exec``: a ``capsa`` started from such a test run would never see
the SIGINT the test sends. A user's Ctrl-C reaches a foreground process whose SIGINT is the default, which
:func:`sigint_default` restores in the child before it runs."""

from __future__ import annotations

import signal

__all__ = ["sigint_default"]


def sigint_default() -> None:
    """``preexec_fn`` for :class:`subprocess.Popen`: SIGINT back to its default disposition in the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
