"""Drive the stock ``e2b`` SDK against capsa, configured only by environment (``eval "$(capsa e2b env)"``).

Run it with any venv that has the ``e2b`` package (it imports nothing of capsa), e.g. to check a newer SDK
than the one the test suite installs::

    python -m venv /tmp/e2b-new && /tmp/e2b-new/bin/pip install e2b==2.63.0
    eval "$(capsa e2b env)" && /tmp/e2b-new/bin/python scripts/e2b_sdk_check.py

Prints one line per check and ``N passed, N failed`` at the end; exits 1 if any failed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import sys
import threading
import time
import traceback
from collections.abc import Callable

from e2b import Sandbox


def main() -> int:
    results: list[tuple[str, bool, str]] = []

    def check(name: str, fn: Callable[[], object]) -> None:
        try:
            fn()
            results.append((name, True, ""))
        except Exception as exc:  # every failure is reported, the run goes on
            results.append((name, False, f"{type(exc).__name__}: {exc}"))
            traceback.print_exc(file=sys.stderr)

    print(f"e2b {importlib.metadata.version('e2b')}")
    started = time.monotonic()
    sbx = Sandbox.create()
    print(f"created {sbx.sandbox_id} in {time.monotonic() - started:.2f}s")

    def run_foreground() -> None:
        r = sbx.commands.run("echo hello; echo oops >&2")
        assert (r.stdout, r.stderr, r.exit_code) == ("hello\n", "oops\n", 0), r

    def run_background() -> None:
        seen: list[str] = []
        h = sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 0.3; done; sleep 60", background=True)
        # The sync SDK delivers a background command's output to callbacks while something waits on it.
        def wait() -> None:
            with contextlib.suppress(Exception):  # killed: CommandExitException
                h.wait(on_stdout=seen.append)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 20
        while "".join(seen).count("line") < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "".join(seen) == "line1\nline2\nline3\n", seen
        assert h.pid in [p.pid for p in sbx.commands.list()]
        assert h.kill()
        assert h.pid not in [p.pid for p in sbx.commands.list()]
        waiter.join(20)
        assert not waiter.is_alive()

    def files() -> None:
        sbx.files.make_dir("/tmp/e2bcheck")
        sbx.files.write("/tmp/e2bcheck/a.txt", "text ü")
        assert sbx.files.read("/tmp/e2bcheck/a.txt") == "text ü"
        sbx.files.write("/tmp/e2bcheck/b.bin", bytes(range(256)))
        assert bytes(sbx.files.read("/tmp/e2bcheck/b.bin", format="bytes")) == bytes(range(256))
        assert sorted(e.name for e in sbx.files.list("/tmp/e2bcheck")) == ["a.txt", "b.bin"]
        assert sbx.files.exists("/tmp/e2bcheck/a.txt") and not sbx.files.exists("/tmp/e2bcheck/zz")
        assert sbx.files.get_info("/tmp/e2bcheck/b.bin").size == 256
        assert sbx.files.make_dir("/tmp/e2bcheck/d/e") and not sbx.files.make_dir("/tmp/e2bcheck/d/e")
        assert sbx.files.rename("/tmp/e2bcheck/a.txt", "/tmp/e2bcheck/c.txt").name == "c.txt"
        sbx.files.remove("/tmp/e2bcheck/c.txt")
        assert not sbx.files.exists("/tmp/e2bcheck/c.txt")

    def stdin() -> None:
        h = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(h.pid, "fed through stdin\n")
        sbx.commands.close_stdin(h.pid)
        assert h.wait().stdout == "fed through stdin\n"

    def pty() -> None:
        from e2b import PtySize

        seen: list[bytes] = []
        h = sbx.pty.create(PtySize(rows=24, cols=80))

        def wait() -> None:
            with contextlib.suppress(Exception):  # killed
                h.wait(on_pty=seen.append)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        sbx.pty.resize(h.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(h.pid, b"stty size; echo pty-$((6*7))\n")
        deadline = time.monotonic() + 20
        while b"pty-42" not in b"".join(seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert b"pty-42" in b"".join(seen) and b"30 100" in b"".join(seen), b"".join(seen)[-300:]
        assert sbx.pty.kill(h.pid)
        waiter.join(20)
        assert not waiter.is_alive()

    def watch() -> None:
        sbx.files.make_dir("/tmp/e2bwatch")
        handle = sbx.files.watch_dir("/tmp/e2bwatch")
        sbx.files.write("/tmp/e2bwatch/new.txt", "x")
        deadline, names = time.monotonic() + 20, set()
        while "new.txt" not in names and time.monotonic() < deadline:
            names |= {e.name for e in handle.get_new_events()}
            time.sleep(0.2)
        handle.stop()
        assert "new.txt" in names, names

    def connect_and_timeout() -> None:
        other = Sandbox.connect(sbx.sandbox_id)
        assert other.commands.run("echo again").stdout == "again\n"
        sbx.set_timeout(900)
        assert sbx.get_info().state.value == "running"
        assert sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]

    check("commands.run foreground", run_foreground)
    check("commands.run background + on_stdout + list + kill", run_background)
    check("files", files)
    check("commands stdin", stdin)
    check("pty create + resize + send_stdin + kill", pty)
    check("files.watch_dir", watch)
    check("connect + set_timeout + get_info + list", connect_and_timeout)
    def fork() -> None:
        sbx.files.write("/tmp/e2bcheck/forked.txt", "from the parent")
        forks = sbx.fork(count=2)
        try:
            assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks), forks
            for child in forks:
                assert child.sandbox_id != sbx.sandbox_id
                assert child.files.read("/tmp/e2bcheck/forked.txt") == "from the parent"
        finally:
            for child in forks:
                if isinstance(child, Sandbox):
                    child.kill()

    if hasattr(Sandbox, "fork"):  # e2b >= 2.6x
        check("fork (capsa branch)", fork)
    check("kill", lambda: (sbx.kill(), None if not sbx.is_running() else 1 / 0))
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
    failed = sum(not ok for _, ok, _ in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
