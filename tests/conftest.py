"""Fixtures shared by every test suite. Others may append fixtures here; keep each one small.

Helpers live in tests/support/ (public names); fixtures live in conftest files: here when more than one
suite uses them, else in that suite's conftest.py. Test modules never import from each other."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio
from hypothesis import settings as hypothesis_settings

from capsa.common.image import GuestImage
from capsa.common.settings import Settings
from tests.support.control_db import DATABASES, database_url, optional_postgres
from tests.support.postgres import PgCluster
from tests.support.s3_server import S3Server, s3_missing_reason, temporary_s3
from tests.support.skips import allowed_skip
from tests.support.vm import searchable_dir

if TYPE_CHECKING:
    from capsa.node.runtime.qemu import QemuRuntime

# Property tests and the API fuzzer run the same examples on every run ("ci", the default), so a red run
# is a bug that the next run reproduces, never a new random draw. HYPOTHESIS_PROFILE=explore draws fresh
# random examples (run it by hand to look for new bugs; what it finds becomes a fixed test case).
hypothesis_settings.register_profile("ci", derandomize=True, database=None)
hypothesis_settings.register_profile("explore", derandomize=False, max_examples=200)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def guest_image() -> GuestImage:
    """The real guest image for the current sources, from the cache (CAPSA_CACHE_DIR or
    /var/cache/capsa); built first if missing (about a minute with a warm package cache)."""
    from capsa.images import ensure_image

    return ensure_image(Settings())


# --- the vm marker ---------------------------------------------------------------------------------------

# Fixtures that boot VMs or start `capsa serve` (tests/conftest.py and tests/integration/conftest.py): a test
# using one must carry the `vm` marker, which scripts/test.sh uses to run it after the templates are built.
# While the others run, QEMU refuses to boot (tests/support/novm): that catches VMs booted any other way.
_VM_FIXTURES = frozenset({"runtime", "sandbox", "pool", "server"})
_VM_FIXTURE_MODULES = frozenset({"tests.conftest", "tests.integration.conftest"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = []
    for item in items:
        if item.get_closest_marker("vm") is not None or not isinstance(item, pytest.Function):
            continue
        for name, defs in item._fixtureinfo.name2fixturedefs.items():
            if name in _VM_FIXTURES and defs and defs[-1].func.__module__ in _VM_FIXTURE_MODULES:
                unmarked.append(f"{item.nodeid} (fixture {name})")
                break
    if unmarked:
        raise pytest.UsageError("tests that use VM fixtures without the `vm` marker (add pytest.mark.vm to "
                                "the module's pytestmark):\n  " + "\n  ".join(unmarked))


# --- skips under CI ------------------------------------------------------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under CI (``CAPSA_CI=1``) a skip outside tests/support/skips.py is a failure, whatever skipped it
    (a marker, a fixture, the test itself), so a missing service or a non-root run cannot pass quietly."""
    outcome = yield
    if os.environ.get("CAPSA_CI") != "1":
        return
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not allowed_skip(item.nodeid, reason):
            report.outcome = "failed"
            report.longrepr = f"skipped outside the CI allowlist (tests/support/skips.py): {reason}"


_module_skips: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A whole module skipped while it is collected (``allow_module_level``) fails the session under CI
    (a failed collection would stop every other test, so it is reported at the end instead)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if os.environ.get("CAPSA_CI") == "1" and report.skipped:
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not allowed_skip(collector.nodeid, reason):
            _module_skips.append(f"{collector.nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _module_skips:
        print("\nmodules skipped outside the CI allowlist (tests/support/skips.py):")
        for line in _module_skips:
            print(f"  {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# --- the control plane's database -------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster | None]:
    """One throwaway PostgreSQL 15 cluster for the session, or ``None`` where it is not installed."""
    with optional_postgres() as cluster:
        yield cluster


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test using ``db_url`` runs on SQLite; in a module marked ``postgresql`` (the database's semantics
    under test: the store, the audit chain, quotas, snapshots, nodes, migrations, the hot path) also on
    PostgreSQL."""
    defs = metafunc._arg2fixturedefs.get("db_url")  # a module may define a db_url of its own
    if defs and defs[-1].func.__module__ == __name__:
        kinds = DATABASES if metafunc.definition.get_closest_marker("postgresql") else DATABASES[:1]
        metafunc.parametrize("db_url", kinds, indirect=True, ids=list(kinds))


@pytest.fixture
def db_url(request: pytest.FixtureRequest, tmp_path: Path, pg_cluster: PgCluster | None) -> str:
    """An empty control-plane database of the kind ``pytest_generate_tests`` chose."""
    return database_url(request.param, tmp_path, pg_cluster)


# --- the fleet's store ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One real S3 server (Swift with s3api) for the session; each user makes a bucket of its own. Without
    Swift installed (``scripts/install.sh --dev`` installs it) the tests that need it fail, never skip."""
    reason = s3_missing_reason()
    if reason:
        pytest.fail(f"no S3 server for the store tests: {reason}")
    with temporary_s3() as server:
        yield server


# --- real microVMs (integration and security suites) ------------------------------------------------


@pytest.fixture(scope="module")
def state_dir() -> Iterator[Path]:
    """A node state directory shared by the test module's VMs: short (QEMU socket paths) and searchable
    (QEMU runs as another uid), under /var/tmp; removed afterwards."""
    with searchable_dir("capsa-vm-", parent="/var/tmp") as path:
        yield path


@pytest.fixture
def fresh_state_dir() -> Iterator[Path]:
    """Like ``state_dir``, but one per test."""
    with searchable_dir("capsa-vm1-", parent="/var/tmp") as path:
        yield path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(state_dir: Path) -> AsyncIterator[QemuRuntime]:
    """The plain QEMU runtime on ``state_dir`` (accelerator probed, not cached), closed afterwards; modules
    that need another runtime override it."""
    from capsa.node.runtime.qemu import QemuRuntime

    runtime = QemuRuntime(Settings(state_dir=state_dir), accel="auto", accel_cache=False)
    try:
        yield runtime
    finally:
        await runtime.close()


# --- rate limits ---------------------------------------------------------------------------------------


@pytest.fixture
def pinned_rate_window(monkeypatch: pytest.MonkeyPatch) -> float:
    """Stop the rate limiter's clock at this instant, so a test that counts up to a limit never sees its
    requests split across two fixed windows (with a 60 s window that happened in about 1 run in 100: the
    request after the limit fell into a fresh window and was admitted). The reaper's pruning keeps the real
    clock; it drops counters two windows old, and the pinned one is current. Returns the pinned time."""
    import time
    from types import SimpleNamespace

    from capsa.control import ratelimit

    pinned = time.time()
    monkeypatch.setattr(ratelimit, "time", SimpleNamespace(time=lambda: pinned))
    return pinned
