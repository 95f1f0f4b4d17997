"""A model call under the provider's limits: it waits its turn, then goes, then settles.

``paced(...)`` wraps one call. With no limit covering the model it only calls. Under
limits (``DURABLE["LIMITS"]``) it reserves the call's share in the database first
(``durable.store.limits``): a call whose turn is now goes at once; one whose turn is a
moment away waits for it in its thread, holding no connection; one that would wait
longer raises :class:`Throttled`, and the run parks until its turn, holding no thread
either (the engine makes it due then; its memos keep what it did). The reply's usage
settles the reservation; a 429 pauses the limit for every worker until its Retry-After
and the run waits throttled again, without spending an attempt.
"""

import contextlib
import contextvars
import datetime
import logging
import time

from ..conf import durable_settings
from ..core import limits as rules
from ..exceptions import RateLimited
from ..store import limits as store

logger = logging.getLogger("durable.limits")

# A call whose turn is at most this far away waits for it in its thread: parking and
# claiming the job again would cost more than the wait.
SHORT_WAIT = 2.5
# A throttled run is due this long before its turn: claimed again and replayed by then, it
# waits the rest in its thread and calls on time. A run that came back late would send
# its call bunched with the next ones, which a provider's window counts together.
LEAD = 2.0
# A 429 without a Retry-After pauses its limit this long.
DEFAULT_PAUSE = 1.0


# The step function running in this thread, while it runs: a model adapter called from it
# paces its calls as an agent's are (``in_step``).
_STEP = contextvars.ContextVar("durable_step", default=None)


class Throttled(Exception):  # noqa: N818 - a signal, not an error
    """The call waits its turn under a limit: the run parks until ``until``, on no thread."""

    def __init__(self, until, why):
        super().__init__(why)
        self.until = until
        self.why = why


def declared():
    """The limits ``DURABLE["LIMITS"]`` declares (the system check has said what is wrong)."""
    return durable_settings.parsed("LIMITS", rules.parse)


def covering(provider, model, names=()):
    """The declared limits a call of ``model`` from ``provider`` counts against."""
    specs = declared()
    unknown = set(names) - {spec.name for spec in specs}
    if unknown:
        raise rules.LimitConfigError(f"the model adapter names limits {sorted(unknown)}, which"
                                     " DURABLE['LIMITS'] does not declare")
    return tuple(spec for spec in specs if spec.name in names or spec.covers(provider, model))


def _unless_paused(decision, specs, booked):
    """A call that waited for its moment goes only if no 429 paused its limits meanwhile.

    Calls booked before the provider refused one would otherwise all go at their moments
    and be refused in turn; this one gives its moment back and waits out the pause.
    """
    now = decision.now.timestamp() + (time.monotonic() - booked)  # the database's clock, read on
    until = store.paused_until([spec.name for spec in specs])
    if until is None or until <= now:
        return
    store.release(decision.ids, specs)
    names = ", ".join(spec.name for spec in specs)
    raise Throttled(decision.now + datetime.timedelta(seconds=until - decision.now.timestamp()),
                    f"limit {names}: paused by the provider's 429 while the call waited for its turn")


def paced(adapter, messages, tools, params, call, *, job_id, lease_token, key, release=None,
          priority=0):
    """``call()`` once the limits covering ``adapter``'s model allow it; its reply settles them."""
    provider = getattr(adapter, "provider", None) or getattr(adapter, "sdk", "")
    model = str(getattr(adapter, "model", "") or "")
    specs = covering(provider, model, getattr(adapter, "limits", ()))
    if not specs:
        return call()
    out = params.get("max_tokens") or params.get("max_completion_tokens") \
        or getattr(adapter, "defaults", {}).get("max_tokens")
    decision = store.reserve(specs, job_id, lease_token, key, rules.estimate_tokens(messages, tools),
                             out if isinstance(out, int) else None, priority, soon=SHORT_WAIT)
    if not decision.go:
        if decision.queued:
            raise Throttled(decision.at, decision.why)
        raise Throttled(decision.at - datetime.timedelta(seconds=LEAD), decision.why)
    if release is not None:
        release()  # the call waits for its turn and on the provider: on no connection
    waited = max(0.0, (decision.at - decision.now).total_seconds())
    if waited > 0:
        booked = time.monotonic()
        time.sleep(waited)
        _unless_paused(decision, specs, booked)
    try:
        reply = call()
    except RateLimited as exc:
        pause = exc.retry_after if exc.retry_after is not None else DEFAULT_PAUSE
        store.refuse(decision.ids, pause, str(exc), specs)
        names = ", ".join(spec.name for spec in specs)
        logger.warning("job=%s key=%s: the provider refused the call (429); limit %s paused for %.1fs",
                       job_id, key, names, pause)
        raise Throttled(store.now_plus_seconds(pause),
                        f"limit {names}: paused {pause:g} s by the provider's 429") from exc
    except BaseException:
        store.release(decision.ids, specs)
        raise
    store.settle(decision.ids, int(getattr(reply, "input_tokens", 0) or 0),
                 int(getattr(reply, "output_tokens", 0) or 0), specs)
    return reply


@contextlib.contextmanager
def step_calls(job_id, lease_token, step, release=None):
    """While a step function of job ``job_id`` runs: its model calls are paced (``in_step``).

    ``release`` gives the thread's connection back before a call waits on the network."""
    token = _STEP.set({"job_id": job_id, "lease_token": lease_token, "step": step, "calls": 0,
                       "release": release})
    try:
        yield
    finally:
        _STEP.reset(token)


def current_step():
    """The context of the step function running in this thread (None outside one)."""
    return _STEP.get()


def step_call_key(here, ahead=0):
    """The key of a step's model call: ``<step>/model/<n>``, by its order in the step."""
    return f"{here['step']}/model/{here['calls'] + ahead}"


def in_step(adapter, messages, tools, params, call):
    """A model adapter's call: from a step function, paced under the limits that cover it.

    Its calls are keyed by their order in the step (``<step>/model/<n>``), so the step run
    again after a throttle finds the turn its call booked. A call whose turn is far hands
    the job back (``Throttled``, which the runner acts on): the step runs again from the
    top at its turn, as after any interruption. ``durable.steps.budgets.in_step`` calls this,
    once the call's worst case is reserved on the job's budgets. An agent's calls are paced
    by its run (``paced``), not here.
    """
    here = _STEP.get()
    if here is None:
        return call()
    here["calls"] += 1
    key = step_call_key(here)
    provider = getattr(adapter, "provider", None) or getattr(adapter, "sdk", "")
    if not covering(provider, str(getattr(adapter, "model", "") or ""), getattr(adapter, "limits", ())):
        return call()
    from ..models import Job

    priority = Job.objects.filter(pk=here["job_id"]).values_list("priority", flat=True).first() or 0
    return paced(adapter, messages, tools, params, call, job_id=here["job_id"], lease_token=here["lease_token"],
                 key=key, priority=priority, release=here.get("release"))
