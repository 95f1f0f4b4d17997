"""Named fault points for crash drills: inert unless a setting names one.

``DURABLE["FAULT_POINT"]`` (or the ``DURABLE_FAULT_POINT`` environment variable, which
the drills set on a worker subprocess) names a point; the process SIGKILLs itself
when it reaches it. ``name@N`` fires on the Nth time the point is reached; ``name~P``
fires with probability P each time. Several specs may be joined with commas.
"""

import os
import random
import signal

from .conf import durable_settings

POINTS = (
    "after_claim",
    "before_step",
    "mid_step",
    "after_step_before_commit",
    "after_commit",
    "after_mark_attempted",
    "after_send_before_record",
    "before_final_transition",
    "after_final_transition",
    "during_backoff",
    "during_approval_wait",
    "during_spawn",
    "agent_model_call",
    "agent_before_memo",
    "agent_after_memo",
)

_specs = None
_hits = {}


def configure(spec=None):
    """Parse the fault spec once per process (the hot path only does a dict lookup)."""
    global _specs
    spec = spec if spec is not None else (
        os.environ.get("DURABLE_FAULT_POINT") or durable_settings.FAULT_POINT or ""
    )
    parsed = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, nth, prob = part, 1, None
        if "@" in part:
            name, n = part.split("@", 1)
            nth = int(n)
        elif "~" in part:
            name, p = part.split("~", 1)
            prob, nth = float(p), None
        if name not in POINTS:
            raise ValueError(f"Unknown fault point {name!r}; known: {', '.join(POINTS)}")
        parsed[name] = (nth, prob)
    _specs = parsed
    _hits.clear()


def point(name):
    """Die here, hard, if the drill asked for it."""
    if _specs is None:
        configure()
    spec = _specs.get(name)
    if spec is None:
        return
    nth, prob = spec
    _hits[name] = _hits.get(name, 0) + 1
    if (prob is not None and random.random() < prob) or (nth is not None and _hits[name] == nth):
        os.kill(os.getpid(), signal.SIGKILL)
