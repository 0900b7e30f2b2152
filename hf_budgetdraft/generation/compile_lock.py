"""Compilations run alone: while one thread compiles a forward, no other thread runs a forward of this package.

Dynamo builds a new graph's guards from the frame it traces, its graph counters are process-wide, and transformers'
output collector becomes a process-global while dynamo traces (`CompileableContextVar`: a forward on another thread
then resets it under the trace). Two `generate()` calls on shared models, one compiling (its first draft step, a
verification shape new to the process) while the other runs forwards, break each other: the compilation fails
("Expected dict, got NoneType", "Guard failed on the same frame it was created"), the other call counts its graphs
as recompilations of its own, and both fall back to eager steps for the rest of the call. This lock orders them: a
forward runs `shared()` (any number at once), a compilation `alone()` (it waits for the forwards in flight, and the
forwards asked for after it wait for it to end: a thread stepping in a loop cannot starve it). A compilation thus
pauses the package's other calls once per shape and process.

It orders the package's own forwards: transformers' assisted loop runs the target's forward itself, and a
`torch.compile` elsewhere in the process (a user's, or transformers' static-cache `generate()` on another thread)
does not take it.
"""

from __future__ import annotations

import contextlib
import threading


class CompileLock:
    """A readers-writer lock that prefers its writer: `shared()` for forwards, `alone()` for compilations. Within a
    thread, a side taken again inside itself takes nothing more (a compiled step's forward, the forward a compilation
    runs); `alone()` inside `shared()` raises, as it would wait for its own thread."""

    def __init__(self):
        self._changed = threading.Condition(threading.Lock())
        self._running = 0  # threads running forwards
        self._compiling = False
        self._waiting = 0  # compilations waiting for the forwards in flight
        self._held = threading.local()  # `side`: what this thread holds ("shared", "alone" or None)

    @contextlib.contextmanager
    def shared(self):
        if getattr(self._held, "side", None) is not None:
            yield
            return
        with self._changed:
            self._changed.wait_for(lambda: not (self._compiling or self._waiting))
            self._running += 1
        self._held.side = "shared"
        try:
            yield
        finally:
            self._held.side = None
            with self._changed:
                self._running -= 1
                if not self._running:
                    self._changed.notify_all()

    @contextlib.contextmanager
    def alone(self):
        side = getattr(self._held, "side", None)
        if side == "alone":
            yield
            return
        if side == "shared":
            raise RuntimeError("a compilation was asked for inside a forward of the same thread")
        with self._changed:
            self._waiting += 1
            self._changed.wait_for(lambda: not (self._compiling or self._running))
            self._waiting -= 1
            self._compiling = True
        self._held.side = "alone"
        try:
            yield
        finally:
            self._held.side = None
            with self._changed:
                self._compiling = False
                self._changed.notify_all()


COMPILE_LOCK = CompileLock()
