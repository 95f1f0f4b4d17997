"""Memo commits grouped across the runs of one worker process.

A process with hundreds of runs in flight finishes a model or tool call every few
milliseconds, and each call's memo is a fenced commit of its own: a WAL flush on
PostgreSQL, a take of the one write lock on SQLite. ``MemoCommits`` is one thread that
writes every memo waiting when it is free in one transaction, so a crowd pays that
once. There is no timer: a lone commit goes at once, and the commits that arrive while
one transaction is written share the next.

Each row stays fenced by its own job's lease token (``locking.commit_memos``): a run whose
lease is gone is told False and the others commit. When the transaction fails as a
whole, every row is tried again on its own, so one bad row fails only its own run.
"""

import logging
import queue
import threading
import time

from django.db import connection

from ..signals import memos_committed
from ..store import locking
from .process import keep_connections_healthy, waiting_behind

logger = logging.getLogger("durable.worker")


class _Pending:
    __slots__ = ("args", "done", "error", "put", "result")

    def __init__(self, args):
        self.args = args
        self.put = time.monotonic()
        self.done = threading.Event()
        self.result = None
        self.error = None


class MemoCommits:
    """The process's memo committer: ``commit_memo`` has ``locking.commit_memo``'s meaning."""

    def __init__(self, most=256, release=None, name="durable-memo-commits"):
        self.most = int(most)
        # Gives the calling thread's connection back while it waits (connections.release).
        self.release = release
        self.name = name
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()
        self.transactions = 0  # group transactions written so far

    def commit_memo(self, claimed, state, lease_seconds, progress_json, c):
        """Commit one memo with the rows that wait beside it; True, or False when fenced out."""
        args = (claimed, state, lease_seconds, progress_json, c)
        if connection.in_atomic_block:
            # The caller's transaction must hold the memo (it commits or rolls back with it).
            return locking.commit_memo(*args)
        if self.release is not None:
            self.release()
        pending = _Pending(args)
        self._start()
        self._queue.put(pending)
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        return pending.result

    def close(self):
        """Write what was handed over, then stop the thread (a later commit starts it again)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _start(self):
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                    self._thread.start()

    def _serve(self):
        try:
            while (first := self._queue.get()) is not None:
                batch, last = waiting_behind(self._queue, first, self.most)
                self._write(batch)
                if last:
                    return
        finally:
            connection.close()

    def _write(self, batch):
        began = time.monotonic()
        try:
            keep_connections_healthy()
            results = locking.commit_memos([p.args for p in batch])
        except Exception as exc:  # noqa: BLE001 - each row is tried alone; its run sees its own error
            if len(batch) == 1:
                self._answer(batch[0], error=exc)
            else:
                logger.warning("a group of %d memo commits failed (%s); committing them one by one",
                               len(batch), exc)
                for pending in batch:
                    self._alone(pending)
        else:
            for pending, result in zip(batch, results, strict=True):
                self._answer(pending, result=result)
        self.transactions += 1
        if memos_committed.receivers:
            now = time.monotonic()
            memos_committed.send(None, rows=len(batch), seconds=now - began,
                                 refused=sum(1 for p in batch if p.result is False),
                                 waited=[now - p.put for p in batch])

    def _alone(self, pending):
        try:
            keep_connections_healthy()
            self._answer(pending, result=locking.commit_memos([pending.args])[0])
        except Exception as exc:  # noqa: BLE001 - this row's run raises it
            self._answer(pending, error=exc)

    @staticmethod
    def _answer(pending, result=None, error=None):
        pending.result, pending.error = result, error
        pending.done.set()


__all__ = ["MemoCommits"]
