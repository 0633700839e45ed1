"""Address-space layout randomization (ASLR) of user commands, which the host may turn off.

Under TCG (no hardware virtualization) QEMU translates guest code into host code and caches the result
by the code's virtual address. With ASLR every new process maps the dynamic loader and libc at new
addresses, so every command's start-up code is translated again, however often the same programs ran:
measured in the guest under TCG, ``true`` 41 ms with ASLR against 21-27 ms without, ``ls /`` 85-107 ms
against 35-38 ms. Under KVM there is no translation and ASLR costs nothing.

So the host decides (``CAPSA_COMMAND_ASLR``, by default off under TCG only) and tells the daemon with the
``set_aslr`` operation. Without ASLR, the daemon spawns commands with the ``ADDR_NO_RANDOMIZE``
personality flag: set on the spawning thread for the instant of the fork (a child inherits its parent
thread's personality, and exec keeps the flag), then put back. The daemon itself, init, and whatever ran
before keep their randomized layout; ``kernel.randomize_va_space`` stays 2, and a command may turn
the flag off again for its own children (``personality(2)``). A restarted daemon starts randomizing
again until the host says otherwise. The standard library has no personality call, so this uses
ctypes (as the guest's quiet.py does for port I/O)."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Any

from capsa.guest.channel import Stream
from capsa.guest.errors import OpError

__all__ = ["ADDR_NO_RANDOMIZE", "command_layout", "op_set_aslr", "randomized", "set_randomized"]

ADDR_NO_RANDOMIZE = 0x0040000
"""<linux/personality.h>: disable randomization of the virtual address space."""
_QUERY = 0xFFFFFFFF

_personality: Any = None
with contextlib.suppress(OSError, AttributeError):
    _personality = ctypes.CDLL(None, use_errno=True).personality
    _personality.argtypes = [ctypes.c_ulong]
    _personality.restype = ctypes.c_int

_randomized = True


def randomized() -> bool:
    """Whether commands spawned now get a randomized layout."""
    return _randomized


def set_randomized(on: bool) -> None:
    global _randomized
    _randomized = on


@contextlib.contextmanager
def command_layout() -> Iterator[None]:
    """Around a fork of a command: while commands run without ASLR, the calling thread carries
    ``ADDR_NO_RANDOMIZE`` (and hands it to the child); its own personality is restored afterwards."""
    if _randomized or _personality is None:
        yield
        return
    before = int(_personality(_QUERY))
    if before < 0 or before & ADDR_NO_RANDOMIZE:
        yield
        return
    _personality(before | ADDR_NO_RANDOMIZE)
    try:
        yield
    finally:
        _personality(before)


def op_set_aslr(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    enabled = args.get("enabled")
    if not isinstance(enabled, bool):
        raise OpError("bad_request", "enabled must be true or false")
    if not enabled and _personality is None:
        raise OpError("unsupported", "this guest cannot set a process personality")
    set_randomized(enabled)
    stream.result({"enabled": enabled})
