"""`CompileLock`: compiled forwards run together, a compilation alone; a compilation waiting for the forwards in
flight holds off those that would start after it. Threads and events; the waits only bound how long a blocked thread
is given to (wrongly) get in."""

import threading
import time

import pytest

from hf_budgetdraft.generation.compile_lock import CompileLock

TIMEOUT = 30  # seconds a thread waits before the test fails instead of hanging


class _Holder:
    """A thread that enters `lock_side()`, sets `entered`, and leaves once released."""

    def __init__(self, lock_side):
        self.entered, self._leave = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(lock_side,), daemon=True)
        self.thread.start()

    def _run(self, lock_side):
        with lock_side():
            self.entered.set()
            assert self._leave.wait(TIMEOUT)

    def release(self) -> None:
        self._leave.set()


def _join(*holders: _Holder) -> None:
    for holder in holders:
        holder.thread.join(TIMEOUT)
        assert not holder.thread.is_alive()


def _until_waiting(lock: CompileLock) -> None:
    """Return once a compilation waits on `lock` (fail after `TIMEOUT`)."""
    deadline = time.monotonic() + TIMEOUT
    while not lock._waiting:
        assert time.monotonic() < deadline, "no compilation ever waited"
        time.sleep(0.001)


def test_compiled_forwards_run_together():
    lock = CompileLock()
    forwards = [_Holder(lock.shared) for _ in range(3)]
    assert all(forward.entered.wait(TIMEOUT) for forward in forwards)  # all three inside at once
    for forward in forwards:
        forward.release()
    _join(*forwards)


def test_a_compilation_waits_for_the_forwards_in_flight_and_holds_off_later_ones():
    lock = CompileLock()
    forward = _Holder(lock.shared)
    assert forward.entered.wait(TIMEOUT)
    compilation = _Holder(lock.alone)
    _until_waiting(lock)  # the compilation is queued behind the forward in flight
    later = _Holder(lock.shared)
    assert not later.entered.wait(0.2)  # held off: the compilation waits (a forward let in could starve it)
    assert not compilation.entered.is_set()
    forward.release()  # the forward in flight ends: the compilation, not the later forward, goes next
    assert compilation.entered.wait(TIMEOUT)
    assert not later.entered.is_set()
    compilation.release()
    assert later.entered.wait(TIMEOUT)
    later.release()
    _join(forward, compilation, later)


def test_compilations_run_one_at_a_time():
    lock = CompileLock()
    first = _Holder(lock.alone)
    assert first.entered.wait(TIMEOUT)
    second = _Holder(lock.alone)
    _until_waiting(lock)
    assert not second.entered.is_set()
    first.release()
    assert second.entered.wait(TIMEOUT)
    second.release()
    _join(first, second)


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
