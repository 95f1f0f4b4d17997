"""``async def`` steps: one event loop per worker process, in a thread of its own.

A step thread that gets a coroutine from a step (``Workflow.call_step``) hands it to
the process's loop with ``asyncio.run_coroutine_threadsafe`` and waits for it, so a
step is still one blocking call to the runner: the claim, the fenced commit and the
lease renewal do not change. Many async steps of one process then wait on the same
loop. A step past its timeout is cancelled here by the heartbeat (``cancel()``), which a
plain function cannot be: the step thread records the timeout as a retryable failure
and goes on with its next job; nothing is abandoned.

A coroutine must not block the loop (``time.sleep``, a synchronous HTTP client, the
ORM): that stalls every async step of the process. Django's ORM refuses to run inside
a coroutine; wrap database work in ``asgiref.sync.sync_to_async``.
"""

import asyncio
import concurrent.futures
import os
import threading

from ..exceptions import StepTimeout

_lock = threading.Lock()
_loop = None
_loop_pid = None
_waiting = {}  # step thread ident -> the future it waits on


def event_loop():
    """The process's event loop, started on first use (a forked child starts its own)."""
    global _loop, _loop_pid
    with _lock:
        if _loop is None or _loop_pid != os.getpid():
            _loop = asyncio.new_event_loop()
            _loop_pid = os.getpid()
            threading.Thread(target=_loop.run_forever, name="durable-event-loop",
                             daemon=True).start()
        return _loop


def run(coroutine, what="a step", timeout=None):
    """Run ``coroutine`` on the process's loop; wait for it in the calling thread.

    Raises ``StepTimeout`` when the heartbeat cancelled it past its timeout.
    """
    future = asyncio.run_coroutine_threadsafe(coroutine, event_loop())
    ident = threading.get_ident()
    _waiting[ident] = future
    try:
        return future.result()
    except concurrent.futures.CancelledError:
        limit = f" of {timeout}s" if timeout else ""
        raise StepTimeout(f"{what} ran past its timeout{limit}; its coroutine was cancelled") from None
    finally:
        _waiting.pop(ident, None)


def cancel(ident):
    """Cancel the coroutine thread ``ident`` waits on; False if it waits on none."""
    future = _waiting.get(ident)
    if future is None:
        return False
    # Cancelling the thread's future cancels the task on the loop (run_coroutine_threadsafe
    # chains them); the waiting thread returns at once.
    future.cancel()
    return True
