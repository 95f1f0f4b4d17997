"""Errors raised by durable, all under one base class.

Each docstring says what happened and whether retrying is safe.
"""

from django.core.exceptions import ValidationError


class DurableError(Exception):
    """Base class of every error durable raises.

    ``event_data``, when an error raised by a step carries it (a dict of JSON values),
    is added to the retry or failed event the runner writes for it, in the same
    transaction.
    """

    event_data = None


class UnknownWorkflow(DurableError, LookupError):
    """No workflow is registered under this name. Nothing was written; fix the name."""


class IdempotencyConflict(DurableError):
    """A job with this key exists with another workflow or payload.

    Nothing was written. Retrying with the same key cannot succeed: use a new key
    for a new piece of work, or the original payload to get the existing job.
    """


class KeyBusy(DurableError):
    """The job's concurrency key is full and its workflow rejects a second job (``when_busy = "reject"``).

    Nothing was written. ``active`` are the keys of the jobs that hold it; submit again once
    they have finished.
    """

    def __init__(self, key, active):
        self.key = key
        self.active = tuple(active)
        super().__init__(f"The concurrency key {key!r} is busy: job {', '.join(map(repr, self.active))} is"
                         " active, and this workflow rejects another job meanwhile (when_busy='reject')")


class PayloadInvalid(DurableError, ValidationError):
    """The payload is not JSON-serialisable or is over the size limit. Nothing was written."""

    def __init__(self, message):
        ValidationError.__init__(self, message, code="invalid_payload")

    def __str__(self):
        return self.message


class IllegalTransition(DurableError):
    """A state change not in the workflow's transition table was attempted.

    This is a bug at the call site, not a transient condition: retrying will fail again.
    """


class LeaseLost(DurableError):
    """The worker no longer holds the job's lease; its write was refused (fenced).

    Raised inside a running step by what writes under the lease (``ctx.wait_for``,
    ``ctx.spawn`` and ``ctx.join``, an agent's calls and actions) when the lease token
    moved on; the runner catches it and records nothing. Safe: another worker (or an
    operator) owns the job now; the caller must stop.
    """


class OperatorError(DurableError):
    """An operator verb was refused (wrong state, live lease, stale form). Nothing changed."""


class UnknownDestination(DurableError, LookupError):
    """No action destination is registered or configured under this name.

    Nothing was sent. Retrying cannot help until the destination is added to
    DURABLE["DESTINATIONS"] or registered in code; then requeue the job.
    """


class ActionChanged(OperatorError):
    """The action changed since the operator looked at it (its version moved on).

    Nothing changed. Reload the action and decide again on what it says now.
    """


# Errors a step raises to steer retry decisions.


class RetryableError(DurableError):
    """A transient failure: the step is retried with backoff (or after ``retry_after`` seconds)."""

    def __init__(self, message="", *, retry_after=None):
        super().__init__(message)
        self.retry_after = retry_after


class RateLimited(RetryableError):
    """The provider refused the call for its rate limit (HTTP 429): nothing was charged.

    Safe to retry after ``retry_after`` seconds. Under a declared limit
    (``DURABLE["LIMITS"]``) the limit pauses for every worker until then, and the run
    waits throttled instead of spending an attempt.
    """

    billed = False  # a budget gives the call's reservation back (durable.store.budgets)


class PermanentError(DurableError):
    """A deterministic failure (poison): retrying cannot help, the job goes to its failed state."""

    # From a model call: the provider refused the request (4xx), so it billed nothing.
    billed = False


class StepTimeout(RetryableError):
    """The step ran past its timeout. Retryable: the step is re-run in a fresh process."""


class DecisionRefused(OperatorError):
    """A decision on a proposal was refused: it changed, expired or was already decided.

    Nothing changed. Reload the proposal and decide again on what it says now.
    """


class DecisionForbidden(DecisionRefused):
    """The user may not decide this proposal (no permission, or four-eyes). Nothing changed."""


# Tasks run through durable.tasks.DurableBackend.


class TaskAttemptFailed(RetryableError):
    """One attempt of a task raised; its backoff chose to run it again after ``retry_after``."""


class TaskFailed(PermanentError):
    """A task failed for good: its backoff refused a retry, or it ran out of attempts.

    The job stays in its failed state; an operator may requeue it once the cause is fixed.
    """


class TaskNotFound(DurableError, LookupError):
    """A task job names a function that cannot be imported. The job is kept; deploy, then requeue."""


class TaskCancelled(DurableError):
    """An operator cancelled the task's job before it succeeded; it will not run again."""


class SignalRefused(DurableError):
    """A signal was refused (no such job, or the job finished). Nothing was written.

    Retrying the same signal cannot succeed: a finished job has no wait left to read it.
    """


class UnknownJob(SignalRefused, LookupError):
    """There is no job with this key. Nothing was written."""


class JobFinished(SignalRefused):
    """The job already reached a terminal state. Nothing was written."""


class SignalConflict(IdempotencyConflict):
    """A signal with this dedupe key exists with another payload. Nothing was written.

    The first delivery stands; send a new dedupe key for a new message.
    """
