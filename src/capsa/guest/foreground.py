"""Foreground commands (``exec``): run to their end, output streamed as it is written, stdin from the host,
a timeout the guest enforces."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from capsa.guest.cgroups import oom_kills
from capsa.guest.channel import ChannelGone, Stream
from capsa.guest.command import (
    DRAIN_IDLE,
    READ_SIZE,
    grow_pipes,
    killpg,
    parse_command,
    reaped,
    spawn,
    write_all,
)
from capsa.guest.errors import OpError
from capsa.guest.limits import DEFAULT_MAX_OUTPUT, MAX_OUTPUT
from capsa.guest.protocol import Kind
from capsa.guest.results import exit_fields

__all__ = ["Deadlines", "op_exec"]


def _positive_number(args: dict[str, Any], key: str) -> float | None:
    value = args.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise OpError("bad_request", f"{key} must be a positive number")
    return float(value)


def _feed_stdin(stream: Stream, proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    fd = proc.stdin.fileno()
    broken = False
    try:
        for frame in stream.frames():
            if frame.kind == Kind.END:
                break
            if frame.kind != Kind.DATA:
                continue
            if not broken:
                try:
                    write_all(fd, frame.data)
                except OSError:
                    broken = True  # the command stopped reading; keep draining so the host is not stuck
            stream.consumed(len(frame.data))
    except (ChannelGone, OpError):
        pass
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()


class Deadlines:
    """One thread that runs the callbacks of every command's timeout when they fall due (a
    threading.Timer per command started a thread each time: milliseconds under TCG). With nothing
    scheduled it waits without a timeout, so an idle guest is not woken."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def call_later(self, delay: float, fn: Callable[[], None]) -> tuple[float, int, Callable[[], None]]:
        entry = (time.monotonic() + delay, next(self._seq), fn)
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="capsa-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()
        return entry

    def cancel(self, entry: tuple[float, int, Callable[[], None]]) -> None:
        with self._cond, contextlib.suppress(ValueError):
            self._heap.remove(entry)
            heapq.heapify(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception as exc:  # one command's timeout handling must not end everyone's
                print(f"capsa-guest: timeout callback failed: {exc!r}", file=sys.stderr)


DEADLINES = Deadlines()


def op_exec(stream: Stream, args: dict[str, Any], data: bytes) -> None:
    spec = parse_command(args)
    timeout = _positive_number(args, "timeout")
    max_output = args.get("max_output", DEFAULT_MAX_OUTPUT)
    if (isinstance(max_output, bool) or not isinstance(max_output, int)
            or not 0 <= max_output <= MAX_OUTPUT):
        raise OpError("bad_request", f"max_output must be an integer between 0 and {MAX_OUTPUT}")
    want_stdin = args.get("stdin", False)
    if not isinstance(want_stdin, bool):
        raise OpError("bad_request", "stdin must be a boolean (true: the host streams it)")
    started = time.monotonic()
    proc = spawn(spec, stdin=subprocess.PIPE if want_stdin else subprocess.DEVNULL,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    spawn_ms = (time.monotonic() - started) * 1000
    grow_pipes(proc)
    state = {"timed_out": False}

    def on_timeout() -> None:
        state["timed_out"] = True
        killpg(proc.pid)

    timer = DEADLINES.call_later(timeout, on_timeout) if timeout else None
    stream.on_cancel(lambda: killpg(proc.pid) if proc.returncode is None else None)
    stdin_thread = None
    if want_stdin:
        stdin_thread = threading.Thread(target=_feed_stdin, args=(stream, proc), daemon=True)
        stdin_thread.start()
    stream.send(Kind.EVENT, {"started": True, "pid": proc.pid})
    counts = {"stdout": 0, "stderr": 0}
    killed_by_oom: int | None = None
    try:
        _pump(stream, proc, counts, max_output)
        returncode = proc.wait()
    finally:
        if timer:
            DEADLINES.cancel(timer)
        if proc.poll() is None:
            killpg(proc.pid)
            proc.wait()
        killed_by_oom = oom_kills(proc.pid)  # before reaped() removes the command's cgroup
        reaped(proc)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    if stream.cancelled.is_set():
        raise ChannelGone("request cancelled")
    result = exit_fields(returncode)
    result.update(
        timed_out=state["timed_out"],
        stdout_bytes=counts["stdout"], stderr_bytes=counts["stderr"],
        stdout_truncated=counts["stdout"] > max_output, stderr_truncated=counts["stderr"] > max_output,
        duration=time.monotonic() - started, pid=proc.pid, spawn_ms=round(spawn_ms, 3),
        # The kernel's own count for this command's cgroup: true when an OOM killer (global or a memory
        # cgroup's) killed any of its processes, whatever the kernel log says.
        oom_killed=bool(killed_by_oom),
    )
    stream.result(result)


def _pump(stream: Stream, proc: subprocess.Popen[bytes], counts: dict[str, int], limit: int) -> None:
    """Forward both pipes until EOF (or quiet after exit); beyond ``limit`` drain without sending."""
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout.fileno(), selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
    exited_at: float | None = None
    last_data = time.monotonic()
    try:
        while sel.get_map():
            events = sel.select(0.05)
            now = time.monotonic()
            for key, _ in events:
                ch = key.data
                chunk = os.read(key.fd, READ_SIZE)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                last_data = now
                sent = counts[ch]
                counts[ch] = sent + len(chunk)
                if sent < limit:
                    stream.send_data(chunk[: limit - sent], {"ch": ch})
            if stream.cancelled.is_set():
                raise ChannelGone("request cancelled")
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and not events and now - max(exited_at, last_data) > DRAIN_IDLE:
                break
    finally:
        sel.close()
