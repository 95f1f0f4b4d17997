"""The dispatcher's sending slots: how many actions it has in flight, and for whom.

A dispatcher process sends up to ``threads`` actions at once, one per slot. A slot that
frees is filled with the next due action at once; nothing waits for a batch to finish.
Each destination holds at most its share:

- its ``CONCURRENCY`` option in ``DURABLE["DESTINATIONS"]`` (default: every slot);
- while it is *slow*, ``DURABLE["DISPATCH_SLOW_CONCURRENCY"]`` (default 1). A destination
  is slow until a send to it has come back with a reply (a result or a refusal), and
  again from the moment one ends without a reply (timed out, cut, not reachable).

So a destination that never answers holds one slot, waiting out its read timeout with
one trial send at a time (a circuit breaker's half-open state), and every other
destination keeps the rest. A destination that answered
before and then stops answering holds up to its ``CONCURRENCY`` until its first send
times out: set ``CONCURRENCY`` to bound that. The bookkeeping is per process, in
memory; nothing here touches the database.

A slot frees when its send comes back, before what it learned is written: a confirmed
send is written by ``Batches``, on a thread of its own, together with the others that
came back meanwhile (one commit for them all).
"""

import collections
import logging
import queue
import threading
import time

from django.db import connection

from ...conf import durable_settings
from ..process import keep_connections_healthy, waiting_behind

logger = logging.getLogger("durable.dispatch")


class Slots:
    """The slots of one dispatcher and each destination's share (thread-safe)."""

    def __init__(self, total, limit_of, slow=None):
        self.total = int(total)
        self._limit_of = limit_of  # name -> the most slots it may hold when it answers
        self.slow = int(durable_settings.DISPATCH_SLOW_CONCURRENCY if slow is None else slow)
        self._held = collections.Counter()
        self._answering = set()
        self._lock = threading.Lock()
        self.freed = threading.Event()  # set whenever a slot frees

    @property
    def free(self):
        with self._lock:
            return max(0, self.total - sum(self._held.values()))

    @property
    def busy(self):
        with self._lock:
            return sum(self._held.values())

    def limit(self, name):
        """The most slots ``name`` may hold now: its share, whether it answers or not."""
        share = min(self.total, self._limit_of(name))
        return share if name in self._answering else min(share, self.slow)

    def room(self, name):
        """How many more actions to ``name`` may start now."""
        with self._lock:
            free = self.total - sum(self._held.values())
            return max(0, min(self.limit(name) - self._held[name], free))

    def rooms(self, names):
        """(room per destination, room of any other destination) for a claim."""
        with self._lock:
            names = {*names, *self._held, *self._answering}
        return {name: self.room(name) for name in names}, min(self.slow, self.free)

    def take(self, name):
        with self._lock:
            self._held[name] += 1

    def done(self, name):
        with self._lock:
            self._held[name] -= 1
            if self._held[name] <= 0:
                del self._held[name]
        self.freed.set()

    def answered(self, name, *, replied):
        """Record how a send to ``name`` ended: with a reply, or without one."""
        with self._lock:
            if replied:
                self._answering.add(name)
            else:
                self._answering.discard(name)


class Senders:
    """The dispatcher's threads: each takes a claimed row, settles it, and takes the next.

    A thread keeps its database connection from one row to the next (a reconnect per
    row would cost more than most replies take); a connection that broke is replaced
    before the next row, and every thread closes its own when the senders close.
    """

    def __init__(self, count, settle, name="durable-dispatch", release=None):
        self._settle = settle
        # Gives a thread's connection back between rows (a process whose threads share few).
        self._release = release
        self._queue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=_serve, args=(self._queue, self._one),
                                          name=f"{name}-{i}", daemon=True)
                         for i in range(int(count))]
        self._started = False
        # thread name -> (action id, job, destination, monotonic start): the workers page's
        # view of each slot, kept in memory (see ``activity``).
        self._sending = {}

    def activity(self):
        """What each sending thread does now: read from memory, never the database."""
        sending, now = dict(self._sending), time.monotonic()
        found = []
        for thread in self._threads:
            action, job, destination, began = sending.get(thread.name, (None, "", "", now))
            found.append({"slot": thread.name, "action": action, "job": job,
                          "destination": destination, "for": round(now - began, 1)})
        return found

    def submit(self, row, done):
        """Settle ``row`` on a free thread, then call ``done(row)``."""
        if not self._started:
            self._started = True
            for thread in self._threads:
                thread.start()
        self._queue.put((row, done))

    def close(self):
        """Let every thread finish the row it holds and the rows queued, then stop it."""
        if not self._started:
            return
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()

    def _one(self, item):
        row, done = item
        name = threading.current_thread().name
        self._sending[name] = (row.id, row.job_id, row.destination, time.monotonic())
        try:
            keep_connections_healthy()
            self._settle(row)
        finally:
            self._sending.pop(name, None)
            if self._release is not None:
                self._release()
            done(row)


class Batches:
    """One thread that writes what the senders hand it, as many items per call as are waiting.

    ``write(items)`` is called with every item queued since the last call (at most
    ``most``), in the order they were put; ``close`` waits until every item put before
    it has been written. The thread keeps its database connection between calls.
    """

    def __init__(self, write, most=64, name="durable-dispatch-record", release=None):
        self._write = write
        self._release = release
        self.most = int(most)
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve, args=(self._queue, self._batch), name=name,
                                        daemon=True)
        self._thread.start()

    def put(self, item):
        self._queue.put(item)

    def close(self):
        self._queue.put(None)
        self._thread.join()

    def _batch(self, first):
        """Write ``first`` and what waits behind it; True when the closing mark was among them."""
        batch, last = waiting_behind(self._queue, first, self.most)
        try:
            keep_connections_healthy()
            self._write(batch)
        except Exception:  # noqa: BLE001 - the thread must go on for the next items
            # Their rows stay attempted under their leases and are reconciled after.
            logger.exception("%d confirmed sends could not be written", len(batch))
        if self._release is not None and self._queue.empty():
            self._release()
        return last


def _serve(items, handle):
    """A thread's loop: hand what ``items`` holds to ``handle`` until None (or ``handle`` says
    it saw it), then close the thread's database connection."""
    try:
        while (item := items.get()) is not None:
            if handle(item):
                return
    finally:
        connection.close()
