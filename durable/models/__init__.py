"""The rows: jobs and their records, approvals, schedules and the processes that run.

``durable.models`` is where Django and every caller find them; each file holds one
family. Nothing here assigns ``Job.state``: the store (``durable.store``) writes it.
"""

from .approvals import Approval, ApprovalQuerySet, ApprovalStatus
from .budgets import Budget, BudgetGrant, BudgetHold, BudgetPeriod, CachedCall, HoldState, WhenOver
from .concurrency import ConcurrencyKey
from .jobs import (
    IN_DOUBT,
    UNSETTLED,
    CostMark,
    CostMinute,
    CostRollup,
    EventKind,
    Job,
    JobEvent,
    JobQuerySet,
    MemoKind,
    MoveMinute,
    Outbox,
    OutboxQuerySet,
    OutboxStatus,
    Pause,
    Signal,
    StepResult,
    Wait,
    WaitKind,
    memo_label,
)
from .limits import Limit, Reservation, ReservationState
from .schedules import ScheduleEvent, ScheduleEventKind, ScheduleState
from .workers import ProcessRole, WorkerProcess

__all__ = [
    "IN_DOUBT", "UNSETTLED", "Approval", "ApprovalQuerySet", "ApprovalStatus", "Budget", "BudgetGrant",
    "BudgetHold", "BudgetPeriod", "CachedCall", "ConcurrencyKey", "HoldState", "WhenOver", "CostMark",
    "CostMinute", "CostRollup", "EventKind", "Job", "JobEvent", "JobQuerySet", "Limit", "MemoKind",
    "MoveMinute", "Outbox", "OutboxQuerySet", "OutboxStatus", "Pause", "ProcessRole", "Reservation",
    "ReservationState", "ScheduleEvent", "ScheduleEventKind", "ScheduleState", "Signal", "StepResult", "Wait",
    "WaitKind", "WorkerProcess", "memo_label",
]
