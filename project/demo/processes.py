"""The demo's own processes: which worker holds a lease, and whether it is one of ours."""

import os


def pid_of(owner):
    """The pid in a worker id ``host:pid:worker0``."""
    try:
        return int(owner.rsplit(":", 2)[-2])
    except (ValueError, IndexError):
        return None


def in_group(pid, group):
    """Whether ``pid`` belongs to the process group we started (never kill anyone else's)."""
    try:
        return os.getpgid(pid) == group
    except ProcessLookupError:
        return False
