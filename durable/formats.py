"""Durations and money as text, written one way for the console, the CLI and the alerts.

Pure functions, no database: the template filters register them, ``manage.py durable
status`` prints with them and the alerts' sentences use them, so "3 h 12 min" means the
same everywhere an operator reads it.
"""

import datetime
from decimal import Decimal, InvalidOperation

BLANK = "—"


def _seconds(value):
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    return float(value)


def age(seconds):
    """Seconds (or a timedelta) as a short duration: ``42 s``, ``7 min``, ``3 h 12 min``, ``4 d 3 h``.

    Rounded to whole seconds; negative durations count as zero; blank input is ``—``.
    """
    if seconds in (None, ""):
        return BLANK
    seconds = max(int(round(_seconds(seconds))), 0)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    if seconds < 172800:
        hours, minutes = divmod(seconds // 60, 60)
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(seconds // 3600, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def duration(value):
    """A timedelta (or seconds) as ``12 ms`` / ``1.4 s``, and as :func:`age` beyond a minute."""
    if value in (None, ""):
        return BLANK
    seconds = _seconds(value)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    return age(seconds)


def money(value, places=4):
    """An amount with a fixed number of places and thousands separators (never via a float).

    Blank input is ``—``; what is not a number is shown as it is.
    """
    if value in (None, ""):
        return BLANK
    try:
        return f"{Decimal(str(value)):,.{int(places)}f}"
    except (InvalidOperation, ValueError):
        return str(value)
