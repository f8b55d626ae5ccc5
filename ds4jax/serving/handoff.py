"""Items from the engine thread to the event loop, with one wake-up per burst instead of one per item.

`loop.call_soon_threadsafe` writes to the loop's self-pipe on every call (a syscall that also lets the loop thread
take the GIL); the driver hands over one item per job and engine iteration, so 32 streams would cost 32 of them
per engine call, all on the engine thread. `Handoff.put` queues the item and schedules a drain only when none is
pending, and not at all inside `batch()` (the driver hands an iteration's tokens of all jobs over inside one), so
the items reach their asyncio queues in one loop callback, each queue's in the order they were put.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading


class Handoff:
    def __init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._items: collections.deque = collections.deque()
        self._scheduled = False
        self._batching = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop that serves the requests (one per server)."""
        self.loop = loop

    def put(self, queue: asyncio.Queue, item) -> None:
        """From any thread. Raises RuntimeError once the loop is closed (nobody will read `queue`)."""
        with self._lock:
            self._items.append((queue, item))
            if self._batching:
                return
        self._wake()

    @contextlib.contextmanager
    def batch(self):
        """Puts inside wake the loop once, at the end (on the thread that puts)."""
        with self._lock:
            self._batching += 1
        try:
            yield
        finally:
            with self._lock:
                self._batching -= 1
                last = not self._batching
            if last:
                self._wake()

    def _wake(self) -> None:
        with self._lock:
            if self._scheduled or not self._items:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            with self._lock:
                self._scheduled = False
            raise

    def _drain(self) -> None:  # on the loop
        with self._lock:
            items, self._items = self._items, collections.deque()
            self._scheduled = False
        for queue, item in items:
            queue.put_nowait(item)
