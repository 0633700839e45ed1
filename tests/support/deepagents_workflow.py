"""Multi-step deepagents workflows on a sandbox backend, with no model call: one driven straight through the
backend's methods, one through a deep agent's own tools with a scripted list of tool calls in place of the
model. Both block: call them in a thread when the server under test runs on the caller's event loop."""

from __future__ import annotations

from typing import Any

from deepagents import create_deep_agent
from deepagents.backends.protocol import SandboxBackendProtocol
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, ToolMessage

__all__ = ["arun_deepagents_agent", "run_deepagents_agent", "run_deepagents_workflow"]


def run_deepagents_workflow(backend: SandboxBackendProtocol, root: str) -> dict[str, object]:
    """Run the workflow under the guest directory ``root`` (absolute, not existing yet); assert each step
    and return what the steps answered (for the caller to print or check further)."""
    assert isinstance(backend, SandboxBackendProtocol)
    script = f"{root}/sum.py"
    written = backend.write(script, "numbers = [3, 1, 2]\nprint(sum(numbers))\n")
    assert written.error is None and written.path == script, written

    ran = backend.execute(f"cd {root} && python3 sum.py > out.txt && cat out.txt")
    assert (ran.exit_code, ran.output.strip(), ran.truncated) == (0, "6", False), ran

    read = backend.read(f"{root}/out.txt")
    assert read.error is None and read.file_data is not None, read
    assert read.file_data["content"].strip() == "6", read

    edited = backend.edit(script, "[3, 1, 2]", "[3, 1, 2, 10]")
    assert edited.error is None and edited.occurrences == 1, edited
    missing = backend.edit(script, "no such text", "y")
    assert missing.error is not None and missing.occurrences is None, missing
    rerun = backend.execute(f"python3 {script}")
    assert (rerun.exit_code, rerun.output.strip()) == (0, "16"), rerun

    listed = backend.ls(root)
    assert listed.error is None and listed.entries is not None, listed
    assert {e["path"] for e in listed.entries} == {script, f"{root}/out.txt"}, listed

    grepped = backend.grep("sum(numbers)", path=root)
    assert grepped.error is None and grepped.matches is not None, grepped
    assert [(m["path"], m["line"]) for m in grepped.matches] == [(script, 2)], grepped

    globbed = backend.glob("*.py", path=root)
    assert globbed.error is None and globbed.matches is not None, globbed
    assert [m["path"] for m in globbed.matches] == [script], globbed

    downloaded = backend.download_files([script, f"{root}/nothing"])
    assert downloaded[0].error is None, downloaded[0]
    assert downloaded[0].content == b"numbers = [3, 1, 2, 10]\nprint(sum(numbers))\n"
    assert downloaded[1].error == "file_not_found" and downloaded[1].content is None, downloaded[1]

    deleted = backend.delete(f"{root}/out.txt")
    assert deleted.error is None, deleted
    assert backend.execute(f"test -e {root}/out.txt").exit_code == 1
    return {"ls": listed.entries, "grep": grepped.matches, "run": rerun.output}


class _ScriptedModel(GenericFakeChatModel):
    """Answers with the given messages in turn: a script of tool calls instead of a model (no model is
    called). Tools are bound by deepagents; a script needs no schema, so binding changes nothing."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> _ScriptedModel:
        return self


_PROMPT = {"messages": [{"role": "user", "content": "count the words, times seven"}]}


def _agent_steps(root: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("write_file", {"file_path": f"{root}/count.py",
                        "content": "words = 'six words in one small line'.split()\nprint(len(words) * 7)\n"}),
        ("execute", {"command": f"python3 {root}/count.py | tee {root}/result.txt"}),
        ("read_file", {"file_path": f"{root}/result.txt"}),
        ("edit_file", {"file_path": f"{root}/count.py", "old_string": "* 7", "new_string": "* 7 + 58"}),
        ("execute", {"command": f"python3 {root}/count.py; exit 5"}),
        ("ls", {"path": root}),
        ("grep", {"pattern": "* 7 + 58", "path": root}),
    ]


def _scripted_agent(backend: SandboxBackendProtocol, steps: list[tuple[str, dict[str, Any]]]) -> Any:
    script = [AIMessage(content="", tool_calls=[{"name": name, "args": args, "id": f"call{i}"}])
              for i, (name, args) in enumerate(steps)]
    return create_deep_agent(model=_ScriptedModel(messages=iter([*script, AIMessage(content="done")])),
                             backend=backend)


def _checked(state: dict[str, Any], steps: list[tuple[str, dict[str, Any]]], root: str) -> list[ToolMessage]:
    tools = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    assert [m.name for m in tools] == [name for name, _ in steps], tools
    assert all(m.status == "success" for m in tools), tools
    written, ran, read, edited, rerun, listed, grepped = (str(m.content) for m in tools)
    assert f"{root}/count.py" in written, written
    assert ran.splitlines()[0] == "42" and "exit code 0" in ran, ran
    assert "42" in read, read
    assert "count.py" in edited, edited
    assert rerun.splitlines()[0] == "100" and "exit code 5" in rerun, rerun
    assert f"{root}/count.py" in listed and f"{root}/result.txt" in listed, listed
    assert f"{root}/count.py" in grepped, grepped
    return tools


def run_deepagents_agent(backend: SandboxBackendProtocol, root: str) -> list[ToolMessage]:
    """A deep agent (``create_deep_agent``, deepagents' own tools and middleware) on ``backend``, driven by a
    scripted list of tool calls: write a script, run it, read its output, edit it, run it again, list and
    grep (``invoke``: the tools call the backend's blocking methods). Returns the tool messages, in order,
    after checking each."""
    steps = _agent_steps(root)
    return _checked(_scripted_agent(backend, steps).invoke(_PROMPT), steps, root)


async def arun_deepagents_agent(backend: SandboxBackendProtocol, root: str) -> list[ToolMessage]:
    """:func:`run_deepagents_agent` with ``ainvoke``: the tools call the backend's async methods."""
    steps = _agent_steps(root)
    return _checked(await _scripted_agent(backend, steps).ainvoke(_PROMPT), steps, root)
