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


# Money is stored to six places (StepResult.cost). It is written with at least two and
# at most six, trailing zeros beyond the second dropped: 12.50, 0.0167, 0.000807.
MONEY_PLACES = (2, 6)


def amount(value):
    """An amount of money as text, without its currency: ``1,234.50``, ``0.000807``.

    The one rule: rounded (half even) to six places, at least two shown, thousands
    separated. Blank input is ``—``; what is not a number is shown as it is.
    """
    if value in (None, ""):
        return BLANK
    try:
        number = Decimal(str(value)).quantize(Decimal(1).scaleb(-MONEY_PLACES[1]))
    except (InvalidOperation, ValueError):
        return str(value)
    text = f"{number:,.{MONEY_PLACES[1]}f}"
    whole, _, cents = text.partition(".")
    cents = cents.rstrip("0").ljust(MONEY_PLACES[0], "0")
    return f"{whole}.{cents}"


def currency():
    """The currency costs are recorded in: ``DURABLE["CURRENCY"]`` (default ``USD``)."""
    from ..conf import durable_settings

    return str(durable_settings.CURRENCY or "").strip()


def money(value):
    """An amount with its currency, e.g. ``USD 0.000807``: how every page writes money."""
    text = amount(value)
    if text == BLANK or not _is_number(value):
        return text
    code = currency()
    return f"{code} {text}" if code else text


def _is_number(value):
    try:
        Decimal(str(value))
    except (InvalidOperation, ValueError):
        return False
    return True
