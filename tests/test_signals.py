"""The daemons' signal handlers (cli/_signals.py): they only set events, and may do so at any
point of the main thread, inside ``Event.wait`` included."""

from __future__ import annotations

import signal
import threading

import pytest

from ggufswap._signals import ProcessSignals


@pytest.mark.parametrize("which", ["stop", "reload"])
def test_a_signal_landing_while_the_main_thread_holds_the_events_lock_sets_it(which: str) -> None:
    """A handler runs in the main thread, possibly while that thread holds the event's lock
    inside ``Event.wait``: setting the event from there must not wait for that lock (a plain
    Event's lock is not reentrant: SIGTERM then hung the runtime for good)."""
    signals = ProcessSignals()
    event = getattr(signals, which)
    handler = signals._on_stop if which == "stop" else signals._on_reload
    with event._cond:  # where Event.wait holds it between its checks
        # A lock the handler could not take would leave it blocked forever: ask with a bound.
        assert event._cond.acquire(timeout=1.0), "the handler would wait for its own thread"
        event._cond.release()
        handler(signal.SIGTERM if which == "stop" else signal.SIGHUP, None)
    assert event.is_set()


def test_the_events_still_wake_a_waiting_thread() -> None:
    """Set from another thread, the stop event wakes a thread waiting on it."""
    signals = ProcessSignals()
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: woke.set() if signals.stop.wait(10) else None)
    waiter.start()
    signals._on_stop(signal.SIGTERM, None)
    waiter.join(10)
    assert woke.is_set()
