"""`CompileLock`: compiled forwards run together, a compilation alone; a compilation waiting for the forwards in
flight holds off those that would start after it. Threads and events; the waits only bound how long a blocked thread
is given to (wrongly) get in."""

import threading
import time

import pytest

from hf_budgetdraft.generation.compile_lock import CompileLock

TIMEOUT = 30  # seconds a thread waits before the test fails instead of hanging


def _hold(lock_side, entered: threading.Event, leave: threading.Event) -> threading.Thread:
    """A thread that enters `lock_side()`, sets `entered`, and leaves once `leave` is set."""

    def run():
        with lock_side():
            entered.set()
            assert leave.wait(TIMEOUT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _until_waiting(lock: CompileLock) -> None:
    """Return once a compilation waits on `lock` (fail after `TIMEOUT`)."""
    deadline = time.monotonic() + TIMEOUT
    while not lock._waiting:
        assert time.monotonic() < deadline, "no compilation ever waited"
        time.sleep(0.001)


def test_compiled_forwards_run_together():
    lock = CompileLock()
    leave = threading.Event()
    entered = [threading.Event() for _ in range(3)]
    threads = [_hold(lock.shared, event, leave) for event in entered]
    assert all(event.wait(TIMEOUT) for event in entered)  # all three inside at once
    leave.set()
    for thread in threads:
        thread.join(TIMEOUT)


def test_a_compilation_waits_for_the_forwards_in_flight_and_holds_off_later_ones():
    lock = CompileLock()
    forward_in, forward_out = threading.Event(), threading.Event()
    forward = _hold(lock.shared, forward_in, forward_out)
    assert forward_in.wait(TIMEOUT)
    compile_in, compile_out = threading.Event(), threading.Event()
    compilation = _hold(lock.alone, compile_in, compile_out)
    later_in, later_out = threading.Event(), threading.Event()
    _until_waiting(lock)  # the compilation is queued behind the forward in flight
    later = _hold(lock.shared, later_in, later_out)
    assert not later_in.wait(0.2)  # held off: the compilation waits (a forward let in could starve it)
    assert not compile_in.is_set()
    forward_out.set()  # the forward in flight ends: the compilation, not the later forward, goes next
    assert compile_in.wait(TIMEOUT)
    assert not later_in.is_set()
    compile_out.set()
    assert later_in.wait(TIMEOUT)
    later_out.set()
    for thread in (forward, compilation, later):
        thread.join(TIMEOUT)


def test_compilations_run_one_at_a_time():
    lock = CompileLock()
    first_in, first_out = threading.Event(), threading.Event()
    first = _hold(lock.alone, first_in, first_out)
    assert first_in.wait(TIMEOUT)
    second_in, second_out = threading.Event(), threading.Event()
    second = _hold(lock.alone, second_in, second_out)
    _until_waiting(lock)
    assert not second_in.is_set()
    first_out.set()
    assert second_in.wait(TIMEOUT)
    second_out.set()
    for thread in (first, second):
        thread.join(TIMEOUT)


def test_a_side_taken_again_in_the_same_thread_takes_nothing_more():
    """A compiled step's forward, or the forward a compilation runs, inside the region its thread already holds."""
    lock = CompileLock()
    with lock.shared(), lock.shared():
        assert lock._running == 1
    with lock.alone(), lock.shared(), lock.alone():
        assert lock._compiling and lock._running == 0
    assert not lock._compiling and lock._running == 0
    with pytest.raises(RuntimeError, match="inside a forward"), lock.shared(), lock.alone():
        pass
    assert lock._running == 0  # released on the way out
