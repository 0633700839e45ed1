"""Where a test run's time went: print the stages of one run record (scripts/test.sh), its 30 slowest tests,
its skips, and the same figures of the previous runs for comparison.

    python3 scripts/ci_report.py RECORD_DIR

RECORD_DIR holds ``stages.tsv`` (name, status, seconds and, since the lanes, the start in seconds from the
start of scripts/test.sh, per line) and ``junit*.xml``. Standard library only:
it runs with whatever python3 the machine has.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def stages(record: Path) -> list[tuple[str, str, int, int | None]]:
    """(name, status, seconds, start or None) per stage; records before the lanes have no start."""
    path = record / "stages.tsv"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        name, status, seconds, *start = line.split("\t")
        out.append((name, status, int(seconds), int(start[0]) if start else None))
    return out


def wall_time(done: list[tuple[str, str, int, int | None]]) -> int:
    """From the first start to the last end; for an old record (no starts), the sum of the stages but the
    background template build."""
    if done and all(start is not None for _n, _st, _s, start in done):
        return max(s + (start or 0) for _n, _st, s, start in done) - min(start or 0 for *_x, start in done)
    return sum(s for n, _st, s, _start in done if n != "templates")


def testcases(record: Path) -> list[tuple[str, float, str, str]]:
    """(test id, seconds, outcome, message) of every test case in the record's junit files."""
    out = []
    for junit in sorted(record.glob("junit*.xml")):
        try:
            root = ET.parse(junit).getroot()
        except ET.ParseError as exc:
            print(f"(unreadable {junit.name}: {exc})")
            continue
        for case in root.iter("testcase"):
            test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
            outcome, message = "passed", ""
            for kind in ("failure", "error", "skipped"):
                node = case.find(kind)
                if node is not None:
                    outcome, message = kind, node.get("message", "")
                    break
            out.append((test_id, float(case.get("time", 0.0)), outcome, message))
    return out


def _minutes(seconds: float) -> str:
    sign = "-" if seconds < 0 else ""
    return f"{sign}{int(abs(seconds)) // 60}:{int(abs(seconds)) % 60:02d}"


def main(record: Path) -> int:
    done = stages(record)
    # Stages overlap (two lanes, and the template build in the background): each shows when it started.
    print(f"{'stage':<40} {'status':<7} {'time':>7} {'from':>7} {'to':>7}")
    for name, status, seconds, start in sorted(done, key=lambda d: d[3] if d[3] is not None else 0):
        span = f"{_minutes(start):>7} {_minutes(start + seconds):>7}" if start is not None else ""
        print(f"{name:<40} {status:<7} {_minutes(seconds):>7} {span}")
    print(f"{'(wall time)':<40} {'':<7} {_minutes(wall_time(done)):>7}")

    cases = testcases(record)
    if cases:
        counts: dict[str, int] = {}
        for _id, _t, outcome, _m in cases:
            counts[outcome] = counts.get(outcome, 0) + 1
        print("\ntests: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) +
              f"; {_minutes(sum(t for _i, t, _o, _m in cases))} in tests")
        print("\n30 slowest tests (setup + call + teardown):")
        for test_id, seconds, outcome, _m in sorted(cases, key=lambda c: -c[1])[:30]:
            print(f"  {seconds:8.1f} s  {test_id}" + ("" if outcome == "passed" else f"  [{outcome}]"))
        skipped = [c for c in cases if c[2] == "skipped"]
        print(f"\nskipped: {len(skipped)}")
        for test_id, _t, _o, message in skipped:
            print(f"  {test_id}: {message}")

    runs = sorted(p for p in record.parent.iterdir() if p.is_dir() and p.name < record.name)[-5:]
    if runs:
        print("\nearlier runs (total of stages, tests):")
        for run in runs:
            total = wall_time(stages(run))
            print(f"  {run.name}: {_minutes(total)}, {len(testcases(run))} tests")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
