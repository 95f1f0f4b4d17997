"""What a job waits for, in words: the signal's name and deadline, its children, a timer.

A parked step's wait is stored under a key (``ask/wait/customer.replied``); the
operator needs the signal's *name* (what a sender must send) and when the wait gives
up. The job page shows these, prefills its Deliver form with the name, and warns when
a signal is delivered under a name no open wait of the job reads.
"""

from ..core.states import StateKind
from ..models import Wait, WaitKind


def open_waits(job_id):
    """The job ``job_id``'s unresolved waits, oldest first, each ``{kind, name, key, deadline}``."""
    return [
        {"kind": w.kind, "name": w.name, "key": w.key, "deadline": w.deadline,
         "children": len((w.data or {}).get("children", [])) if w.kind == WaitKind.JOIN else 0}
        for w in Wait.objects.filter(job_id=job_id, resolved__isnull=True).order_by("id")
    ]


def signal_names(waits):
    """The signal names the open waits read, in order, each once."""
    return list(dict.fromkeys(w["name"] for w in waits if w["kind"] == WaitKind.SIGNAL))


def waiting_on(job, kind, waits):
    """What the job waits for now, for its page: ``{what, name, deadline}`` or None.

    ``what`` is "signal", "children", "timer"; ``name`` the signal's name; ``deadline``
    when the wait gives up (None: never). A job parked on a wait key without a row (an
    older version) shows the key.
    """
    if kind == StateKind.TIMER:
        return {"what": "timer", "name": "", "deadline": job.next_run_at}
    if kind not in (StateKind.SIGNAL, StateKind.JOIN):
        return None
    current = next((w for w in waits if w["key"] == job.awaiting), None)
    if current is None:
        return {"what": "key", "name": job.awaiting, "deadline": None} if job.awaiting else None
    if current["kind"] == WaitKind.SIGNAL:
        return {"what": "signal", "name": current["name"], "deadline": current["deadline"]}
    return {"what": "children", "name": "", "deadline": current["deadline"],
            "children": current["children"]}


def unread_warning(name, names):
    """The warning for delivering ``name`` when the open waits read ``names`` ("" when one does)."""
    if name in names:
        return ""
    if names:
        waited = ", ".join(f"“{n}”" for n in names)
        return (f"No wait of this job reads a signal named “{name}”: it waits for {waited}. "
                f"The signal stays unread in the inbox unless a later wait asks for “{name}”.")
    return (f"This job waits for no signal now: the signal “{name}” stays unread in the "
            "inbox unless a later wait of the job asks for it by that name.")
