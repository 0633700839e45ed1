"""``capsa vm run``: boot a throwaway microVM, run one command in it, stream its output, destroy the VM.

Exit status: the command's own exit code; 128+N when it was killed by signal N; 124 when it ran past
``--timeout``; 125 when the VM could not boot or died (with a one-line message on stderr); 130 on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from pathlib import Path

import click

from capsa.common.settings import Settings

__all__ = ["EXIT_TIMEOUT", "EXIT_VM_FAILED", "vm"]

EXIT_TIMEOUT = 124
EXIT_VM_FAILED = 125
EXIT_INTERRUPTED = 130


def _err(message: str) -> None:
    click.echo(f"capsa: {message}", err=True)


@click.group()
def vm() -> None:
    """Throwaway microVMs: one VM per command, destroyed afterwards."""


@vm.command("run", context_settings={"allow_interspersed_args": False})
@click.option("--memory", "memory_mib", type=click.IntRange(64, 1024 * 1024), default=256, show_default=True,
              help="Guest memory in MiB.")
@click.option("--vcpus", type=click.IntRange(1, 64), default=1, show_default=True, help="Guest vCPUs.")
@click.option("--accel", type=click.Choice(["auto", "kvm", "tcg"]), default=None,
              help="Accelerator (default: CAPSA_ACCEL or auto: probe KVM, fall back to TCG).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Kill the command after this many seconds (exit status 124).")
@click.option("--max-output", type=click.IntRange(min=0), default=64 * 1024 * 1024, show_default=True,
              help="Bytes of stdout and of stderr to pass through; the rest is dropped with a warning.")
@click.option("-i", "--stdin", "pass_stdin", is_flag=True, help="Send this process's stdin to the command.")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where VM working folders go (default: CAPSA_STATE_DIR or /var/lib/capsa).")
@click.option("-v", "--verbose", is_flag=True, help="Report boot time and accelerator on stderr.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(memory_mib: int, vcpus: int, accel: str | None, timeout: float | None, max_output: int,
        pass_stdin: bool, state_dir: Path | None, verbose: bool, command: tuple[str, ...]) -> None:
    """Run COMMAND (an argv, after `--`) in a fresh microVM and exit with its status."""
    from capsa.common.logs import configure
    from capsa.images import ensure_image

    settings = Settings(state_dir=state_dir) if state_dir is not None else Settings()
    if accel is not None:
        settings = settings.model_copy(update={"accel": accel})
    configure(level=logging.INFO if verbose else logging.ERROR)
    try:
        image = ensure_image(settings)
    except Exception as exc:  # the image pipeline reports its own error types; any of them ends the run
        _err(f"guest image unavailable: {exc}")
        sys.exit(EXIT_VM_FAILED)
    stdin = sys.stdin.buffer.read() if pass_stdin else None
    code = asyncio.run(_run(settings, image, list(command), memory_mib=memory_mib, vcpus=vcpus,
                            cmd_timeout=timeout, max_output=max_output, stdin=stdin, verbose=verbose))
    sys.exit(code)


async def _run(settings: Settings, image: object, argv: list[str], *, memory_mib: int, vcpus: int,
               cmd_timeout: float | None, max_output: int, stdin: bytes | None, verbose: bool) -> int:
    from capsa.node.guestlink.errors import GuestError
    from capsa.node.runtime.base import BootError, GuestImage, SandboxFailed, VMSpec
    from capsa.node.runtime.qemu import QemuRuntime, QemuSandbox

    assert isinstance(image, GuestImage)
    runtime = QemuRuntime(settings)
    sandbox: QemuSandbox | None = None
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    terminated = False

    def on_sigterm() -> None:
        nonlocal terminated
        terminated = True
        if main is not None:
            main.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    out, err = sys.stdout.buffer, sys.stderr.buffer

    def write_out(data: bytes) -> None:
        out.write(data)
        out.flush()

    def write_err(data: bytes) -> None:
        err.write(data)
        err.flush()

    try:
        started = time.monotonic()
        try:
            sandbox = await runtime.boot(VMSpec(image=image, memory_mib=memory_mib, vcpus=vcpus))
        except BootError as exc:
            _err(f"VM failed to boot: {str(exc).splitlines()[0]}")
            return EXIT_VM_FAILED
        if verbose:
            decision = runtime.accel_decision
            why = f" ({decision.reason})" if decision else ""
            _err(f"VM {sandbox.id} ready in {time.monotonic() - started:.1f}s, "
                 f"accelerator {sandbox.accelerator.value}{why}")
        try:
            result = await sandbox.guest.exec(argv, timeout=cmd_timeout, stdin=stdin, on_stdout=write_out,
                                              on_stderr=write_err, max_output=max_output)
        except SandboxFailed as exc:
            _err(f"VM failed: {exc.message}")
            return EXIT_VM_FAILED
        except GuestError as exc:
            _err(f"command could not run: {exc}")
            return EXIT_VM_FAILED
        for name, truncated in (("stdout", result.stdout_truncated), ("stderr", result.stderr_truncated)):
            if truncated:
                _err(f"{name} exceeded --max-output ({max_output} bytes); the rest was dropped")
        if result.timed_out:
            _err(f"command timed out after {cmd_timeout:g}s and was killed")
            return EXIT_TIMEOUT
        if result.signal is not None:
            return 128 + result.signal
        return result.exit_code if result.exit_code is not None else EXIT_VM_FAILED
    except asyncio.CancelledError:
        _err("terminated; destroying the VM" if terminated else "interrupted; destroying the VM")
        return 128 + signal.SIGTERM if terminated else EXIT_INTERRUPTED
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        # Shielded: a second Ctrl-C must not leave the VM behind half-destroyed.
        with contextlib.suppress(Exception):
            await asyncio.shield(runtime.close())
