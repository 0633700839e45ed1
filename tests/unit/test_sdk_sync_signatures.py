"""Every blocking class of the SDK has the signatures of its async twin, so the two APIs cannot drift.

The checker compares, for each public method of a pair (and each overload of it): the parameters' names,
kinds, defaults and annotations, the return annotation and whether it is a class, static or instance method.
Annotations are compared as written, modulo the ``Async`` prefix (``AsyncIterator[bytes]`` and
``Iterator[bytes]``, ``AsyncSession`` and ``Session`` are the same thing on either side).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, get_overloads

import pytest

from capsa.sdk import (
    Approvals,
    AsyncApprovals,
    AsyncClient,
    AsyncCommands,
    AsyncConnectionProviders,
    AsyncConnections,
    AsyncEgress,
    AsyncFiles,
    AsyncKeys,
    AsyncNodes,
    AsyncPortForward,
    AsyncPorts,
    AsyncProcess,
    AsyncPty,
    AsyncSecrets,
    AsyncSession,
    AsyncSnapshots,
    AsyncTerminal,
    AsyncWatch,
    Client,
    Commands,
    ConnectionProviders,
    Connections,
    Egress,
    Files,
    Keys,
    Nodes,
    PortForward,
    Ports,
    Process,
    Pty,
    Secrets,
    Session,
    Snapshots,
    Terminal,
    Watch,
)

_SAME_DUNDERS = {"__enter__": "__aenter__", "__exit__": "__aexit__"}


def _normal(annotation: object) -> str:
    if annotation is inspect.Signature.empty:
        return "<none>"
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    text = text.replace("builtins.", "")
    # One implementation, two spellings: AsyncFoo <-> Foo, AsyncIterator <-> Iterator.
    return re.sub(r"\bAsync(?=[A-Z])", "", text)


def _kind(cls: type, name: str) -> str:
    for klass in cls.__mro__:
        if name in vars(klass):
            raw = vars(klass)[name]
            return type(raw).__name__ if isinstance(raw, classmethod | staticmethod | property) else "method"
    return "missing"


def _describe(func: Callable[..., Any]) -> list[str]:
    sig = inspect.signature(func)
    params = [f"{p.name}:{p.kind.name}:{_normal(p.annotation)}"
              + ("" if p.default is inspect.Parameter.empty else f"={p.default!r}")
              for p in sig.parameters.values()]
    return [*params, f"-> {_normal(sig.return_annotation)}"]


def _public(cls: type) -> dict[str, str]:
    """Public attribute name -> the name of its twin on the async side."""
    names: dict[str, str] = {}
    for klass in cls.__mro__[:-1]:
        for name in vars(klass):
            if not name.startswith("_") or name in _SAME_DUNDERS or name in _SAME_DUNDERS.values():
                names.setdefault(name, name)
    return names


def signature_drift(sync_cls: type, async_cls: type, *, renames: dict[str, str] | None = None,
                    async_only: frozenset[str] = frozenset(), also: tuple[str, ...] = (),
                    async_attributes: frozenset[str] = frozenset()) -> list[str]:
    """Every difference between the public methods of ``sync_cls`` and ``async_cls`` (empty: no drift).

    ``renames`` maps a sync name to its async twin's (``close`` -> ``aclose``); ``async_only`` lists async
    methods that deliberately have no blocking twin; ``also`` adds private names that implement a public
    descriptor (``resume``'s two forms); ``async_attributes`` are sync properties that read an instance
    attribute of the async object (``info``), which has no signature to compare.
    """
    pairs = {**_SAME_DUNDERS, **(renames or {})}
    sync_names = {n for n in _public(sync_cls) if n not in ("__aenter__", "__aexit__")}
    sync_names = (sync_names | set(also)) - async_attributes
    async_names = {n for n in _public(async_cls) if n not in ("__enter__", "__exit__")} | set(also)
    problems: list[str] = []
    twins = {name: pairs.get(name, name) for name in sync_names}
    for name in sorted(async_names - set(twins.values()) - async_only):
        problems.append(f"{async_cls.__name__}.{name} has no twin on {sync_cls.__name__}")
    for name, twin in sorted(twins.items()):
        where = f"{sync_cls.__name__}.{name}"
        if twin not in async_names:
            problems.append(f"{where} has no twin on {async_cls.__name__}")
            continue
        sync_kind, async_kind = _kind(sync_cls, name), _kind(async_cls, twin)
        if sync_kind != async_kind:
            problems.append(f"{where} is a {sync_kind}, its twin a {async_kind}")
            continue
        if sync_kind == "property":
            sync_fn = vars_lookup(sync_cls, name).fget
            async_fn = vars_lookup(async_cls, twin).fget
        else:
            sync_fn, async_fn = getattr(sync_cls, name), getattr(async_cls, twin)
        if not callable(sync_fn) or not callable(async_fn):
            continue
        left, right = _describe(sync_fn), _describe(async_fn)
        if left != right:
            problems.append(f"{where}{tuple(left)} != {async_cls.__name__}.{twin}{tuple(right)}")
        sync_over, async_over = get_overloads(sync_fn), get_overloads(async_fn)
        if [_describe(f) for f in sync_over] != [_describe(f) for f in async_over]:
            problems.append(f"{where}: its overloads differ from those of {async_cls.__name__}.{twin}")
    return problems


def vars_lookup(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    raise AttributeError(name)


# The low-level request methods and per-session record calls of AsyncClient are reached from the blocking
# API through Session (or ``Client.aio``); everything a user calls on Client has an async twin.
_CLIENT_PLUMBING = frozenset({
    "request", "stream", "json", "is_closed", "create_session", "get_session", "iter_sessions",
    "list_sessions", "set_session_timeout", "pause_session", "resume_session", "branch_session",
    "list_snapshots", "create_snapshot", "restore_session", "close_session",
})

PAIRS: list[tuple[type, type, dict[str, Any]]] = [
    (Session, AsyncSession, {"also": ("_resume", "_resume_by_id"), "async_only": frozenset({"client"}),
                             "async_attributes": frozenset({"info"})}),
    (Commands, AsyncCommands, {}),
    (Process, AsyncProcess, {"async_attributes": frozenset({"info", "stdout_offset", "stderr_offset"})}),
    (Files, AsyncFiles, {}),
    (Snapshots, AsyncSnapshots, {}),
    (Egress, AsyncEgress, {}),
    (Secrets, AsyncSecrets, {}),
    (Approvals, AsyncApprovals, {}),
    (Connections, AsyncConnections, {}),
    (ConnectionProviders, AsyncConnectionProviders, {}),
    (Keys, AsyncKeys, {}),
    (Nodes, AsyncNodes, {}),
    # A tunnel's methods are coroutines: blocking code reaches ports through forward() and url().
    (Ports, AsyncPorts, {"async_only": frozenset({"open_tunnel"})}),
    (PortForward, AsyncPortForward, {"async_attributes": frozenset({"port", "connections"})}),
    (Pty, AsyncPty, {}),
    (Terminal, AsyncTerminal, {}),
    (Watch, AsyncWatch, {"renames": {"close": "aclose"}, "async_attributes": frozenset({"closed"})}),
    (Client, AsyncClient, {"renames": {"close": "aclose"}, "async_only": _CLIENT_PLUMBING,
                           "async_attributes": frozenset({"config"})}),
]


@pytest.mark.parametrize(("sync_cls", "async_cls", "options"), PAIRS,
                         ids=[sync.__name__ for sync, _, _ in PAIRS])
def test_blocking_class_matches_its_async_twin(sync_cls: type, async_cls: type,
                                               options: dict[str, Any]) -> None:
    assert signature_drift(sync_cls, async_cls, **options) == []


# -- the checker itself catches drift -------------------------------------------------------------------
class AsyncThing:
    async def read(self, path: str, *, encoding: str = "utf-8") -> str:
        return path

    async def chunks(self, size: int = 4) -> AsyncIterator[bytes]:
        yield b""

    async def gone(self) -> None:
        return None

    @classmethod
    async def make(cls, name: str) -> AsyncThing:
        return cls()


class Thing:  # in step with AsyncThing
    def read(self, path: str, *, encoding: str = "utf-8") -> str:
        return path

    def chunks(self, size: int = 4) -> Iterator[bytes]:
        return iter(())

    def gone(self) -> None:
        return None

    @classmethod
    def make(cls, name: str) -> Thing:
        return cls()


class DriftedThing:
    def read(self, path: str, encoding: str = "latin-1") -> bytes:  # kind, default and return drifted
        return path.encode()

    def chunks(self, size: int = 8) -> Iterator[bytes]:  # default drifted
        return iter(())

    def make(self, name: str) -> Thing:  # an instance method where the twin is a classmethod
        return Thing()

    def extra(self) -> None:  # no async twin
        return None
    # gone(): missing


def test_the_checker_accepts_a_pair_in_step() -> None:
    assert signature_drift(Thing, AsyncThing) == []


def test_the_checker_reports_each_kind_of_drift() -> None:
    problems = "\n".join(signature_drift(DriftedThing, AsyncThing))
    assert "DriftedThing.read" in problems and "KEYWORD_ONLY" in problems and "latin-1" in problems
    assert "-> bytes" in problems
    assert "DriftedThing.chunks" in problems and "size:POSITIONAL_OR_KEYWORD:int=8" in problems
    assert "DriftedThing.make is a method, its twin a classmethod" in problems
    assert "DriftedThing.extra has no twin on AsyncThing" in problems
    assert "AsyncThing.gone has no twin on DriftedThing" in problems
    assert len(signature_drift(DriftedThing, AsyncThing)) == 5
