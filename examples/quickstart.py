"""capsa quick start: run Python inside a fresh microVM, write and read a file there, close it.

Start a server first (``capsa serve``), then point the SDK at it:

    export CAPSA_API_URL=http://127.0.0.1:8700 CAPSA_API_KEY=csk_...   # the key `capsa serve` printed
    python examples/quickstart.py
"""

from __future__ import annotations

import sys

from capsa import CapsaClientError, Session

PROGRAM = """
import platform, sys
print(f"python {sys.version.split()[0]} on kernel {platform.release()}")
print(sum(i * i for i in range(1000)))
"""


def main() -> int:
    # Leaving the `with` block closes the session: its VM, disk and sockets are destroyed.
    with Session.create(template="base", timeout=600) as session:
        print(f"session {session.id} is {session.state}")

        result = session.commands.run(["python3", "-c", PROGRAM], timeout=60)
        print(result.stdout, end="")
        if result.exit_code != 0:
            print(f"python failed ({result.exit_code}): {result.stderr}", file=sys.stderr)
            return 1

        session.files.write("/tmp/hello.txt", "hello from inside the sandbox\n")
        print("read back:", session.files.read("/tmp/hello.txt"), end="")

        # Output can also be streamed while the command runs.
        session.commands.run("for i in 1 2 3; do echo tick $i; sleep 0.2; done",
                             on_stdout=lambda chunk: print(chunk, end="", flush=True))
    print(f"session {session.id} is {session.state}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CapsaClientError as exc:  # API and connection errors: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
