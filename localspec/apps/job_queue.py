"""The queue between a server's transport and its slot threads (`serve --parallel N`): jobs start
in arrival order, each on an idle slot, and the slot freed last is served first, so a client
that sends one request after another keeps finding its KV rows in the same slot (the other
slots' rows reach it only through the prompt cache). With one slot it is a plain FIFO.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import Any, Optional


class JobQueue:
    """Jobs waiting for `n_slots` slot threads. Each slot thread loops on take(slot) until it
    returns None (after close(), once the jobs queued before it are handed out)."""

    def __init__(self, n_slots: int, max_waiting: int = 0):
        self.n_slots, self.max_waiting = n_slots, max_waiting     # 0: no bound
        self._jobs: collections.deque = collections.deque()
        self._idle: list = []           # slots waiting in take(), the one freed last at the end
        self._running: dict = {}        # slot -> the job it runs
        self._closed = False
        self._cond = threading.Condition()

    def put(self, job: Any) -> None:
        """Queue `job` behind the others; queue.Full when max_waiting jobs already wait."""
        with self._cond:
            if self.max_waiting and len(self._jobs) >= self.max_waiting:
                raise queue.Full
            self._jobs.append(job)
            self._cond.notify_all()

    def take(self, slot: int) -> Optional[Any]:
        """Slot `slot` is idle (its last job, if any, has ended): block until it is handed the
        next job, or return None once the queue is closed and empty."""
        with self._cond:
            self._running.pop(slot, None)
            self._idle.append(slot)
            try:
                while True:
                    if self._jobs and self._idle[-1] == slot:      # first in line: this slot
                        job = self._jobs.popleft()
                        self._running[slot] = job
                        return job
                    if self._closed and not self._jobs:
                        return None
                    self._cond.wait()
            finally:
                self._idle.remove(slot)
                self._cond.notify_all()     # the next idle slot may be first in line now

    def withdraw(self, job: Any) -> bool:
        """Take `job` out of the queue if it still waits (its client has left, so it must not
        count as waiting any more); False when a slot has it or it was never queued."""
        with self._cond:
            try:
                self._jobs.remove(job)
            except ValueError:
                return False
            return True

    def close(self) -> None:
        """No more jobs: the slots hand out what is queued, then take() returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        """Jobs queued, not started."""
        return len(self._jobs)

    @property
    def busy(self) -> int:
        """Slots running a job now."""
        return len(self._running)
