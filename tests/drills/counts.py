"""The vocabulary of every drill, counted from the database, the executions log and the receiver.

- lost: submitted, but neither terminal nor visibly waiting for a person (failed, needs
  a human, awaiting approval, unknown result). Stuck jobs are lost too.
- stuck: in a working state with an expired lease.
- duplicate memo / outbox row: more than one per (job, step) / (job, kind).
- duplicate execution: a step body that ran again after a run that did not commit
  (retries after a recorded failure are not duplicates). Each one must be allowed by
  a hit: the earlier run's process was killed or paused, or its lease was reclaimed.
- duplicate effect: the receiver applied one (job, kind) more than once.
- stale write: a write committed by a worker that did not hold the job's lease at
  that point of the job's history (see ``stale_writes``), or a memo that no run of
  the step produced.
"""

import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from django.db.models import Count

from durable.core.states import StateKind
from durable.core.workflows import registry
from durable.models import EventKind, Job, JobEvent, Outbox, StepResult

from . import lab as lab_module

WORKER_ACTOR = re.compile(r":(\d+):worker\d+(?:\.\d+)?$")  # .<slot>: a thread of it
PID_IN_TEXT = re.compile(r":(\d+):worker\d+")
CLAIM_KINDS = frozenset({EventKind.CLAIMED, EventKind.RECLAIMED})
LOGGING_WORKFLOWS = frozenset({"drill", "drill_hold"})


@dataclass
class Counts:
    """One row of the drill table."""

    drill: str
    database: str
    jobs: int = 0
    kills: int = 0
    lost: int = 0
    stuck: int = 0
    parked: int = 0
    dup_memo: int = 0
    dup_outbox: int = 0
    dup_exec: int = 0
    dup_exec_hits: int = 0
    dup_effect: int = 0
    stale: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    duplicates: list = field(default_factory=list)  # each re-run step and what allowed it

    @property
    def unexplained(self):
        """Duplicate executions no kill or lease loss accounts for."""
        return self.dup_exec - self.dup_exec_hits

    def problems(self, *, parked_ok=False):
        """The targets this row misses, as sentences (empty when it meets them all)."""
        out = []
        for name in ("lost", "stuck", "dup_memo", "dup_outbox", "dup_effect", "stale"):
            if getattr(self, name):
                out.append(f"{name} = {getattr(self, name)}")
        if self.unexplained:
            out.append(f"{self.unexplained} duplicate executions without a kill or lease loss")
        if self.parked and not parked_ok:
            out.append(f"{self.parked} jobs parked for a person")
        return out


COLUMNS = [
    ("drill", "drill"), ("db", "database"), ("jobs", "jobs"), ("kills", "kills"),
    ("lost", "lost"), ("stuck", "stuck"), ("parked", "parked"), ("dup memo", "dup_memo"),
    ("dup outbox", "dup_outbox"), ("dup exec (hits)", None), ("dup effect", "dup_effect"),
    ("stale write", "stale"), ("seconds", "seconds"),
]


def table(rows):
    """Render rows as a plain-text table (also valid Markdown)."""
    header = [title for title, _ in COLUMNS]
    lines = []
    for row in rows:
        cells = []
        for _, attr in COLUMNS:
            if attr is None:
                cells.append(f"{row.dup_exec} ({row.dup_exec_hits})")
            elif attr == "seconds":
                cells.append(f"{row.seconds:.1f}")
            else:
                cells.append(str(getattr(row, attr)))
        lines.append(cells)
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
              for i, h in enumerate(header)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for line in lines:
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |")
    return "\n".join(out)


def actor_pid(actor):
    m = WORKER_ACTOR.search(actor or "")
    return int(m.group(1)) if m else None


def read_executions(path):
    """(job, step, attempt, pid) of every started step body, and the set of bodies that returned."""
    started, returned = [], set()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return started, returned
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 5:
            continue  # a torn last line of a killed process: it never ran further
        kind, job, step, attempt, pid = parts
        record = (job, step, int(attempt), int(pid))
        if kind == "exec":
            started.append(record)
        elif kind == "done":
            returned.add(record)
    return started, returned


def _kinds_of(workflow):
    try:
        return registry.get(workflow).table.kinds
    except LookupError:
        return {}


def stale_writes(events, workflows):
    """Events a worker committed while another held the job's lease (or nobody did).

    ``events`` are dicts ordered by job, then id. Per job, writes are serialised by the
    job row (every worker write updates it first, fenced by the lease token), so the
    id order of one job's events is its commit order. Walking it, the lease holder is
    the actor of the last claim; a worker's write is stale unless its actor holds the
    lease. A write that leaves the working states releases the lease (the rest of a
    multi-state move committed in the same transaction is recognised as such).
    """
    stale = []
    holder, released_by, last = {}, {}, {}
    for ev in events:
        job, actor, kind = ev["job_id"], ev["actor"], ev["kind"]
        previous = last.get(job)
        last[job] = ev
        if kind in CLAIM_KINDS:
            holder[job], released_by[job] = actor, None
            continue
        if not WORKER_ACTOR.search(actor or ""):
            if kind == EventKind.OPERATOR:
                holder[job] = None  # an operator moved the job: any lease is void
            continue
        if kind == EventKind.FAILED and (
            ev["from_state"] == ev["to_state"] or (ev["message"] or "").startswith("Worker lost")
        ):
            # Written inside the claim transaction itself (a parked job, or a step
            # that lost too many workers): the claim and the write are one commit.
            holder[job], released_by[job] = None, actor
            continue
        continues_move = (
            previous is not None and previous["actor"] == actor and previous["kind"] == kind
            and previous["to_state"] == ev["from_state"] and previous["data"] == ev["data"]
        )
        # A note the releasing commit adds without moving the job (the proposal's
        # "held until approved" event, written after the move to awaiting approval).
        notes_release = (
            previous is not None and previous["actor"] == actor
            and ev["from_state"] == ev["to_state"] == previous["to_state"]
        )
        if holder.get(job) != actor and not (
            (continues_move or notes_release) and released_by.get(job) == actor
        ):
            stale.append(ev)
            continue
        kinds = workflows.get(job) or {}
        if kinds.get(ev["to_state"]) == StateKind.WORKING:
            holder[job], released_by[job] = actor, None  # a worker continues its own job
        else:
            holder[job], released_by[job] = None, actor
    return stale


def duplicate_executions(started, memos, events, hit_pids, log=None):
    """Count re-runs of step bodies and the hits that allowed them.

    Returns ``(duplicates, allowed, phantom_memos, details)``. A started body that did
    not commit is a duplicate unless the engine recorded its failure (a retry). It is
    allowed when its process was killed or paused, or its lease was reclaimed. Each
    uncommitted run is described in ``log`` (a list), when given.
    """
    committed_by = {}
    retried, reclaimed, taken_over = set(), defaultdict(set), set()
    for ev in events:
        data = ev["data"] if isinstance(ev["data"], dict) else {}
        pid = actor_pid(ev["actor"])
        if ev["kind"] == EventKind.STEP_DONE and "attempt" in data:
            committed_by.setdefault((ev["job_id"], ev["step"], data["attempt"]), pid)
        elif ev["kind"] in (EventKind.RETRY, EventKind.FAILED) and "attempt" in data:
            retried.add((ev["job_id"], ev["step"], data["attempt"], pid))
        if ev["kind"] == EventKind.RECLAIMED or (ev["message"] or "").startswith("Worker lost"):
            for m in PID_IN_TEXT.finditer(ev["message"] or ""):
                reclaimed[ev["job_id"]].add(int(m.group(1)))
            # A step taken over mid-run: every earlier holder of it lost its lease (a claim
            # of a working state succeeds only once the lease expired), even one the
            # message does not name because a holder in between committed its claim but
            # lost its connection before its own "reclaimed" event.
            taken_over.add((ev["job_id"], ev["step"]))
    committed = set()
    phantom = []
    for memo in memos:
        pid = committed_by.get((memo["job_id"], memo["step"], memo["attempt"]))
        key = (memo["job_id"], memo["step"], memo["attempt"], pid)
        committed.add(key)
    seen = set(started)
    for key in committed:
        if key not in seen:
            phantom.append(key)
    groups = defaultdict(list)
    for record in started:
        groups[record[:2]].append(record)
    duplicates = allowed = 0
    details = []
    for (job, step_name), records in groups.items():
        unfinished = [r for r in records if r not in committed and r not in retried]
        # A run that did not commit is duplicated only by a later run of the same step.
        dup = len(unfinished) if len(unfinished) < len(records) else len(unfinished) - 1
        if dup <= 0:
            continue
        hit = [r for r in unfinished
               if r[3] in hit_pids or r[3] in reclaimed[job] or (job, step_name) in taken_over]
        duplicates += dup
        allowed += min(dup, len(hit))
        if len(hit) < dup:
            details.extend(r for r in unfinished if r not in hit)
        if log is not None:
            for r in unfinished:
                why = ("process killed or paused" if r[3] in hit_pids else
                       "lease reclaimed" if r in hit else "NO KILL OR LEASE LOSS")
                log.append(f"{r[0]} step {r[1]} attempt {r[2]} by pid {r[3]} did not commit: {why}")
    return duplicates, allowed, phantom, details


def count(lab, drill, *, began, effects=None, extra=None):
    """Count everything for the jobs ``lab`` submitted; ``effects``: (job, kind) per applied action."""
    from durable.store import locking

    row = Counts(drill=drill, database=lab.database, jobs=len(lab.submitted))
    row.seconds = time.monotonic() - began
    row.extra.update(extra or {})
    kills = lab.kills()
    row.kills = len(kills)

    now = locking.db_now()
    jobs = {j["id"]: j for j in Job.objects.values("id", "workflow", "state", "lease_until")}
    workflows = {}
    scheduled = set(Outbox.objects.filter(next_attempt_at__isnull=False)
                    .values_list("job_id", flat=True))
    for key in lab.submitted:
        job = jobs.get(key)
        if job is None:
            row.lost += 1
            row.notes.append(f"job {key} vanished")
            continue
        kinds = _kinds_of(job["workflow"])
        workflows[key] = kinds
        kind = kinds.get(job["state"])
        if kind == StateKind.TERMINAL:
            continue
        if kind in lab_module.SETTLED_KINDS and key not in scheduled:
            row.parked += 1
            continue
        row.lost += 1
        if kind == StateKind.WORKING and (job["lease_until"] is None or job["lease_until"] < now):
            row.stuck += 1
        if len(row.notes) < 20:
            row.notes.append(f"job {key} left in {job['state']}")

    row.dup_memo = sum(
        r["n"] - 1 for r in StepResult.objects.values("job_id", "step").annotate(n=Count("id"))
        .filter(n__gt=1)
    )
    row.dup_outbox = sum(
        r["n"] - 1 for r in Outbox.objects.values("job_id", "kind").annotate(n=Count("id"))
        .filter(n__gt=1)
    )
    if effects is not None:
        row.dup_effect = sum(n - 1 for n in Counter(effects).values() if n > 1)

    mine = set(lab.submitted)
    events = [
        ev for ev in JobEvent.objects.order_by("job_id", "id").values(
            "id", "job_id", "kind", "from_state", "to_state", "step", "actor", "message", "data"
        )
        if ev["job_id"] in mine
    ]
    stale = stale_writes(events, workflows)
    started, _ = read_executions(lab.exec_log)
    # Only the drill workflows write the executions log.
    logged = {key for key in mine if jobs.get(key, {}).get("workflow") in LOGGING_WORKFLOWS}
    memos = [m for m in StepResult.objects.values("job_id", "step", "attempt")
             if m["job_id"] in logged]
    duplicates_log = []
    dup, allowed, phantom, unexplained = duplicate_executions(
        started, memos, events, kills | lab.paused, duplicates_log
    )
    row.duplicates = duplicates_log
    row.dup_exec, row.dup_exec_hits = dup, allowed
    row.stale = len(stale) + len(phantom)
    for ev in stale[:5]:
        row.notes.append(f"stale write: event {ev['id']} {ev['job_id']} {ev['kind']} "
                         f"{ev['from_state']}->{ev['to_state']} by {ev['actor']}")
    for key in phantom[:5]:
        row.notes.append(f"memo without a run that produced it: {key}")
    for key in unexplained[:5]:
        row.notes.append(f"duplicate execution with no kill or lease loss: {key}")
    row.extra["executions"] = len(started)
    return row
