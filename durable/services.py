"""Submitting work and the operator verbs: ``from durable import services``.

One implementation for code, console and CLI, in ``durable.verbs``.
"""

from .verbs.jobs import (
    BulkResult,
    Purged,
    Replay,
    bulk_cancel,
    bulk_requeue,
    bulk_retry_now,
    cancel,
    deliver_signal,
    parse_age,
    pause,
    pause_schedule,
    purge,
    purgeable,
    replay_input,
    replay_step,
    requeue,
    resume,
    resume_schedule,
    retry_now,
    run_schedule_now,
    send_back,
    submit,
    unfinished_children,
)

__all__ = [
    "BulkResult", "Purged", "Replay", "bulk_cancel", "bulk_requeue", "bulk_retry_now", "cancel",
    "deliver_signal", "parse_age", "pause", "pause_schedule", "purge", "purgeable", "replay_input",
    "replay_step", "requeue", "resume", "resume_schedule", "retry_now", "run_schedule_now", "send_back",
    "submit", "unfinished_children",
]
