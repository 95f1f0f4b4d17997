"""Signals sent by workers (sender: the workflow name)."""

from django.dispatch import Signal

# A worker claimed a job and is about to run a step: job_id, step, attempt, worker.
step_started = Signal()
# A step ended: job_id, step, outcome ("done", "retry", "failed", "needs_human", "waiting",
# "action"), state (the job's new state), worker.
step_finished = Signal()
# A job reached a terminal state: job_id, state.
job_finished = Signal()
# A worker process committed agents' memos in one transaction (sender: None): rows, how many
# were refused (their lease was gone), seconds (the transaction), waited (seconds each row
# waited from its hand-over to its answer). Sent only when something listens.
memos_committed = Signal()
