"""A LangChain deep agent whose files and shell live in a capsa microVM (``pip install 'capsa[langchain]'``).

Point it at a capsa server, then run it:

    export CAPSA_API_URL=http://127.0.0.1:8700 CAPSA_API_KEY=csk_...
    python examples/deepagents_sandbox.py                  # no model: drives the backend's tools itself
    MODEL=anthropic:claude-sonnet-4-5 python examples/deepagents_sandbox.py   # a real model drives them

With ``MODEL`` (any ``provider:model`` name deepagents accepts, and that provider's API key in the
environment) the agent decides which tools to call; without it the script calls the same backend
operations the agent's tools call (write_file, execute, read_file, edit_file, grep).
"""

from __future__ import annotations

import os
import sys

from capsa import CapsaClientError
from capsa.integrations.langchain import CapsaSandbox

TASK = "Write /root/fib.py printing the first ten Fibonacci numbers on one line, run it, report the output."
FIB = "a, b = 0, 1\nfor _ in range(10):\n    print(a, end=' ')\n    a, b = b, a + b\nprint()\n"


def main() -> int:
    # Leaving the `with` block closes the session the backend started: its VM is destroyed.
    with CapsaSandbox.create(timeout=600) as backend:
        print(f"backend {backend.id}")
        model = os.environ.get("MODEL")
        if model:
            from deepagents import create_deep_agent

            agent = create_deep_agent(model=model, backend=backend)
            state = agent.invoke({"messages": [{"role": "user", "content": TASK}]})
            print(state["messages"][-1].content)
            return 0
        print("write:", backend.write("/root/fib.py", FIB).error or "ok")
        ran = backend.execute("python3 /root/fib.py")
        print(f"execute: exit {ran.exit_code}: {ran.output.strip()}")
        print("read:", backend.read("/root/fib.py").file_data is not None)
        edited = backend.edit("/root/fib.py", "range(10)", "range(12)")
        print(f"edit: {edited.occurrences} replacement(s)")
        print(f"execute: {backend.execute('python3 /root/fib.py').output.strip()}")
        matches = backend.grep("range(12)", path="/root").matches or []
        print("grep:", [(m["path"], m["line"]) for m in matches])
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CapsaClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
