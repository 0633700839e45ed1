"""A multi-step deepagents workflow driven straight through a sandbox backend (no model): write a script,
run it, read its output, edit it, run it again, then ls, grep, glob, download and delete. Blocking: call it
in a thread when the server under test runs on the caller's event loop."""

from __future__ import annotations

from deepagents.backends.protocol import SandboxBackendProtocol

__all__ = ["run_deepagents_workflow"]


def run_deepagents_workflow(backend: SandboxBackendProtocol, root: str) -> dict[str, object]:
    """Run the workflow under the guest directory ``root`` (absolute, not existing yet); assert each step
    and return what the steps answered (for the caller to print or check further)."""
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
