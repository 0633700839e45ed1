"""capsa.integrations.langchain against the installed deepagents package's own interface, on the fake
runtime's stack (real API, node agent and guest daemon; commands run in a confined host process)."""

from __future__ import annotations

import asyncio

from deepagents.backends.protocol import (
    BackendProtocol,
    SandboxBackendProtocol,
    execute_accepts_timeout,
)
from deepagents.backends.sandbox import BaseSandbox

from capsa.integrations.langchain import TIMEOUT_EXIT_CODE, CapsaSandbox
from tests.support.api_stack import ApiStack
from tests.support.deepagents_workflow import (
    arun_deepagents_agent,
    run_deepagents_agent,
    run_deepagents_workflow,
)


async def _backend(stack: ApiStack) -> CapsaSandbox:
    key = await stack.tenant_key("lc")
    return await asyncio.to_thread(CapsaSandbox.create, api_url=stack.url, api_key=key)


async def test_backend_is_a_deepagents_sandbox_and_runs_a_workflow(stack: ApiStack) -> None:
    backend = await _backend(stack)
    try:
        assert isinstance(backend, SandboxBackendProtocol) and isinstance(backend, BaseSandbox)
        assert isinstance(backend, BackendProtocol)
        assert execute_accepts_timeout(CapsaSandbox)
        assert backend.id.startswith("ses_")
        await asyncio.to_thread(run_deepagents_workflow, backend, "/tmp/lc-work")
    finally:
        await asyncio.to_thread(backend.close)
    assert backend.session.state == "closed"


async def test_execute_combines_output_and_reports_exit_timeout_and_failure(stack: ApiStack) -> None:
    backend = await _backend(stack)
    try:
        res = await backend.aexecute("echo one; echo two >&2; echo three; exit 3")
        assert (res.output, res.exit_code, res.truncated) == ("one\ntwo\nthree\n", 3, False)

        res = await backend.aexecute("echo started; sleep 30", timeout=1)
        assert res.exit_code == TIMEOUT_EXIT_CODE
        assert res.output.startswith("started\n") and "timed out after 1 seconds" in res.output

        res = await backend.aexecute("kill -9 $$")
        assert res.exit_code == 128 + 9

        # past the server's output limit (16 MiB per stream) the output is cut and flagged
        res = await backend.aexecute("head -c 17000000 /dev/zero | tr '\\0' a")
        assert res.truncated and res.exit_code == 0
        assert len(res.output) == 16 * 1024 * 1024 and set(res.output) == {"a"}

        res = await backend.aexecute("")
        assert res.exit_code == 1 and res.output.startswith("Error:")

        # the sync API answers the same (run on the SDK's loop thread)
        res = await asyncio.to_thread(backend.execute, "printf abc")
        assert (res.output, res.exit_code) == ("abc", 0)
    finally:
        await asyncio.to_thread(backend.close)
    # once the session is gone, execute reports it instead of raising
    res = await backend.aexecute("true")
    assert res.exit_code is None and res.output.startswith("Error: ")


async def test_files_answer_per_file_errors(stack: ApiStack) -> None:
    backend = await _backend(stack)
    try:
        up = await backend.aupload_files([("/tmp/up/a/b.bin", bytes(range(256))), ("relative.txt", b"x"),
                                          ("/tmp/up", b"a directory is in the way")])
        assert [(r.path, r.error) for r in up] == [
            ("/tmp/up/a/b.bin", None), ("relative.txt", "invalid_path"), ("/tmp/up", "is_directory")]
        down = await backend.adownload_files(["/tmp/up/a/b.bin", "/tmp/up/none", "/tmp/up", "no/slash"])
        assert down[0].content == bytes(range(256)) and down[0].error is None
        assert [(r.error, r.content) for r in down[1:]] == [("file_not_found", None), ("is_directory", None),
                                                           ("invalid_path", None)]
        # the async file tools of BaseSandbox go through aexecute/aupload_files
        assert (await backend.awrite("/tmp/up/t.txt", "hello\n")).error is None
        read = await backend.aread("/tmp/up/t.txt")
        assert read.file_data is not None and read.file_data["content"] == "hello"
    finally:
        await asyncio.to_thread(backend.close)


async def test_a_deep_agent_runs_its_tools_in_the_session(stack: ApiStack) -> None:
    backend = await _backend(stack)
    try:
        messages = await asyncio.to_thread(run_deepagents_agent, backend, "/tmp/agent")
        assert len(messages) == 7
    finally:
        await asyncio.to_thread(backend.close)


async def test_async_backend_and_a_deep_agent_run_through_ainvoke(stack: ApiStack) -> None:
    key = await stack.tenant_key("lc-async")
    async with await CapsaSandbox.acreate(api_url=stack.url, api_key=key, timeout=300) as backend:
        assert backend.session.info.state == "running"
        messages = await arun_deepagents_agent(backend, "/tmp/agent-async")
        assert len(messages) == 7
        # the event loop stayed free: the stack (served on this loop) answered every tool call
    assert backend.session.state == "closed"
