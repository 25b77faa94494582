"""What a worker's public calls enter through: one caller at a time, and the mark a call leaves
when it is interrupted between two state changes it cannot make as one.

A second thread entering while a call runs gets a RuntimeError at once (the lock is taken without
blocking; the same thread may nest, as step() calls launch_step and finish_step). A call marks
``guard.broken`` with its name where an interrupt (KeyboardInterrupt, a signal handler raising)
between two assignments would leave the batch half changed, and clears it at the window's end;
while it is set every call but the recovery refuses, so no token comes from a broken state.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, Optional, TypeVar

Method = TypeVar("Method", bound=Callable)


class CallGuard:
    """The lock, the call in progress and the interrupted window of one object (``owner``: its
    name in messages, e.g. "EagleWorker"; ``recovery``: the call that clears ``broken``)."""

    def __init__(self, owner: str, recovery: Optional[str] = None) -> None:
        self.owner, self.recovery = owner, recovery
        self.lock = threading.RLock()
        self.call: Optional[str] = None  # the outermost call in progress
        self.broken: Optional[str] = None  # the call interrupted inside a window


def exclusive(method: Method) -> Method:
    """Run ``method`` under ``self._guard`` (a CallGuard): refused while another thread's call
    runs, and while the guard is broken unless it is the guard's recovery call."""
    name = method.__name__

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        guard: CallGuard = self._guard
        if not guard.lock.acquire(blocking=False):
            raise RuntimeError(f"{name}: {guard.owner}.{guard.call or '<a call>'} is running on another thread; "
                               f"{guard.owner} takes one caller at a time: make its calls from one thread, or hold "
                               "one lock around them")
        outer = guard.call is None
        try:
            if outer:
                guard.call = name
            if guard.broken is not None and name != guard.recovery:
                raise RuntimeError(f"{name}: {guard.owner}.{guard.broken} was interrupted between two of its state "
                                   f"changes; call {guard.recovery}() (it aborts every request and returns every "
                                   "page and row) before any other call")
            return method(self, *args, **kwargs)
        finally:
            if outer:
                guard.call = None
            guard.lock.release()

    return guarded  # type: ignore[return-value]
