"""capsa.guest.foreground.Deadlines: one thread runs every command's timeout callback in deadline order; a
cancelled one never runs; a failing callback does not stop the ones after it."""

from __future__ import annotations

import threading

from capsa.guest.foreground import Deadlines


def test_callbacks_run_in_deadline_order_and_cancelled_ones_never() -> None:
    deadlines = Deadlines()
    ran: list[str] = []
    done = threading.Event()

    def boom() -> None:
        ran.append("boom")
        raise RuntimeError("a broken callback")

    def late() -> None:
        ran.append("late")
        done.set()

    deadlines.call_later(0.3, late)
    cancelled = deadlines.call_later(0.1, lambda: ran.append("cancelled"))
    deadlines.call_later(0.2, lambda: ran.append("second"))
    deadlines.call_later(0.05, boom)
    deadlines.cancel(cancelled)
    deadlines.cancel(cancelled)  # twice is harmless
    assert done.wait(10)
    assert ran == ["boom", "second", "late"]


def test_an_earlier_deadline_added_later_wakes_the_thread() -> None:
    deadlines = Deadlines()
    fired = threading.Event()
    deadlines.call_later(3600, lambda: None)  # the thread now sleeps for an hour
    deadlines.call_later(0.05, fired.set)
    assert fired.wait(10)
