"""Concurrency keys as pure rules: which keys a site declares, how many runs each allows at once.

``submit(..., concurrency_key="tenant:42")`` puts a job under a key; ``DURABLE["CONCURRENCY"]``
says how many jobs of a key may be active at once, by pattern::

    "CONCURRENCY": {
        "tenant:*": 5,          # at most five of a tenant's jobs at once
        "conversation:*": 1,    # one writer per conversation
    }

A key matches the first pattern (in the order declared) that covers it. A job of a key is
*active* from its first step until it is finished (done, cancelled, or failed and parked:
``SETTLED_KINDS``), waits included: a conversation's run awaiting an approval still holds
its conversation. Jobs of one key start in the order they were submitted.

What a second job does while a key is full is its workflow's policy, ``when_busy``:

- ``"queue"`` (the default): it waits its turn, throttled, on no thread;
- ``"reject"``: ``submit`` raises ``durable.KeyBusy`` and writes nothing;
- ``"interrupt"``: it waits its turn, and the active runs of the key stop at their next
  model call (cancelled, their memos kept: what they did is on record, and a requeue
  resumes them from there), so the new message goes next.

``durable.store.concurrency`` keeps the keys' rows; this module only reads the setting.
"""

import fnmatch

from ..exceptions import PayloadInvalid

QUEUE, REJECT, INTERRUPT = "queue", "reject", "interrupt"
POLICIES = (QUEUE, REJECT, INTERRUPT)
MAX_KEY_LENGTH = 200


class Interrupted(Exception):  # noqa: N818 - a signal, not an error
    """A job submitted later under the run's key interrupts it, before its next model call."""

    def __init__(self, by):
        super().__init__(f"interrupted by job {by}")
        self.by = by


class ConcurrencyConfigError(ValueError):
    """``DURABLE["CONCURRENCY"]`` is not what it must be; the message says which pattern and why."""


def parse(setting):
    """The declared patterns as ``((pattern, limit), ...)`` in their order, or ``ConcurrencyConfigError``."""
    if setting in (None, {}):
        return ()
    if not isinstance(setting, dict):
        raise ConcurrencyConfigError(f"CONCURRENCY must be a dict of limits by key pattern, not"
                                     f" {type(setting).__name__}")
    declared = []
    for pattern, limit in setting.items():
        if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_KEY_LENGTH:
            raise ConcurrencyConfigError(f"a concurrency key pattern must be a string of 1 to"
                                         f" {MAX_KEY_LENGTH} characters, not {pattern!r}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConcurrencyConfigError(f"CONCURRENCY[{pattern!r}] must be a whole number of jobs at once,"
                                         f" 1 or more, not {limit!r}")
        declared.append((pattern, limit))
    return tuple(declared)


def check_key(key):
    """PayloadInvalid unless ``key`` is a concurrency key a job may carry (None: no key)."""
    if key is None:
        return
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH or "\x00" in key:
        raise PayloadInvalid(f"The concurrency key must be a string of 1 to {MAX_KEY_LENGTH} characters"
                             f" with no NUL, not {key!r}")


def covering(key, patterns):
    """The first of the declared ``(pattern, limit)`` that covers ``key``, or None."""
    for pattern, limit in patterns:
        if fnmatch.fnmatchcase(key, pattern):
            return pattern, limit
    return None


def limit_for(key, setting):
    """How many jobs of ``key`` may be active at once: the first declared pattern that covers it."""
    covered = covering(key, parse(setting))
    if covered is not None:
        return covered[1]
    raise ConcurrencyConfigError(
        f"the concurrency key {key!r} matches no pattern of DURABLE['CONCURRENCY']"
        f" ({', '.join(p for p, _ in parse(setting)) or 'none declared'}); declare how many of its jobs"
        " may run at once, e.g. {'conversation:*': 1}")


def check_policy(workflow, policy):
    """ValueError unless ``policy`` is a workflow's ``when_busy`` we know."""
    if policy not in POLICIES:
        raise ValueError(f"Workflow {workflow!r}: when_busy must be one of {', '.join(POLICIES)},"
                         f" not {policy!r}")
