"""The node's egress audit buffer on disk: events, aggregation and evictions survive a new process on the
same file with the same epoch and numbering; what the reader acknowledged is pruned; the file is 0600
and a torn last line is ignored."""

from __future__ import annotations

from pathlib import Path

from capsa.node.egress.audit import EgressEvent
from capsa.node.egress.audit_log import AuditLog


def _dns(name: str, decision: str = "allow", sandbox: str = "sbx_a") -> EgressEvent:
    return EgressEvent(kind="dns", session_id="ses_a", sandbox_id=sandbox, destination=name,
                       decision=decision)  # type: ignore[arg-type]


def test_events_survive_a_new_process_with_epoch_and_numbering(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    first = AuditLog(path=path)
    for i in range(3):
        first(_dns(f"q{i}.test"))
    first(_dns("denied.test", "deny"))
    first(_dns("denied.test", "deny"))  # aggregated into the previous event
    first(EgressEvent(kind="approval", session_id="ses_a", sandbox_id="sbx_a", decision="allow",
                      detail={"action": "approved", "by": "key_x"}, request_id="req_1"))
    assert path.stat().st_mode & 0o777 == 0o600
    epoch = first.epoch
    first.close()

    second = AuditLog(path=path)
    assert second.epoch == epoch
    page = second.read(0, epoch, 100)
    assert [s for s, _ in page.events] == [1, 2, 3, 4, 5]
    assert page.events[3][1].count == 2
    assert page.events[4][1].detail == {"action": "approved", "by": "key_x"}
    assert page.events[4][1].request_id == "req_1"
    second(_dns("after.test"))
    assert second.read(5, epoch, 10).events[0][0] == 6  # numbering continues


def test_acknowledged_events_are_pruned_and_stay_pruned(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path=path)
    for i in range(5):
        log(_dns(f"q{i}.test"))
    assert log.acknowledge("another-epoch", 3) == 0
    assert log.acknowledge(log.epoch, 3) == 3
    assert len(log) == 2
    log.close()
    again = AuditLog(path=path)
    assert [s for s, _ in again.read(0, "stale", 10).events] == [4, 5]
    assert len(path.read_text().splitlines()) == 3  # rewritten on load: header + the live events


def test_evictions_and_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(capacity=2, path=path)
    for i in range(4):
        log(_dns(f"q{i}.test"))
    log.close()
    with path.open("a") as handle:
        handle.write('{"seq": 9, "event": {"kind"')  # killed mid-write
    again = AuditLog(capacity=2, path=path)
    page = again.read(0, again.epoch, 10)
    assert [s for s, _ in page.events] == [3, 4] and page.lost == 2


def test_compaction_keeps_the_file_small(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path=path)
    for i in range(3000):
        log(_dns(f"q{i}.test"))
        if i % 100 == 99:
            log.acknowledge(log.epoch, i + 1)
    assert len(path.read_text().splitlines()) < 2200
    log.close()
    assert len(AuditLog(path=path)) == 0


def test_hammered_denials_cost_no_disk_write_each(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path=path)
    for _ in range(5000):
        log(_dns("refused.test", "deny"))
    assert len(path.read_text().splitlines()) == 2  # header + the one event
    page = log.read(0, log.epoch, 10)  # the aggregated count reaches the file before it is handed out
    assert page.events[0][1].count == 5000
    log.close()
    assert AuditLog(path=path).read(0, "x", 10).events[0][1].count == 5000
