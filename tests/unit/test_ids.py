"""Prefixed random ids: format, and every character position uniform over the alphabet."""

from __future__ import annotations

from collections import Counter

from capsa.common.ids import is_id, new_id


def test_ids_have_the_format_and_do_not_repeat() -> None:
    ids = [new_id("ses") for _ in range(5000)]
    assert all(is_id(i, "ses") for i in ids)
    assert not is_id(ids[0], "sbx")
    assert len(set(ids)) == len(ids)


def test_every_position_is_uniform() -> None:
    n = 36 * 400
    ids = [new_id("req")[4:] for _ in range(n)]
    for position in (0, 9, 19):  # the lowest, a middle and the highest base-36 digit of the draw
        counts = Counter(i[position] for i in ids)
        assert len(counts) == 36
        chi2 = sum((c - n / 36) ** 2 / (n / 36) for c in counts.values())
        assert chi2 < 80, (position, chi2)  # 35 degrees of freedom: p < 1e-4 beyond ~75
