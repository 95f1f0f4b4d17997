"""Filters for the console templates: ages, money and JSON shown the same way everywhere."""

import datetime
from decimal import Decimal, InvalidOperation

from django import template
from django.utils import timezone

register = template.Library()


@register.filter
def age(seconds):
    """Seconds as a short duration: ``42 s``, ``7 min``, ``3 h 12 min``, ``4 d 3 h``."""
    if seconds in (None, ""):
        return "—"
    if isinstance(seconds, datetime.timedelta):
        seconds = seconds.total_seconds()
    seconds = max(int(round(float(seconds))), 0)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    if seconds < 172800:
        hours, minutes = divmod(seconds // 60, 60)
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(seconds // 3600, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


@register.filter
def since(moment):
    """The age of a datetime, measured now."""
    if not moment:
        return "—"
    return age((timezone.now() - moment).total_seconds())


@register.filter
def duration(value):
    """A timedelta (or seconds) as ``12 ms`` / ``1.4 s`` / the age format beyond a minute."""
    if value in (None, ""):
        return "—"
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else float(value)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    return age(seconds)


@register.filter
def money(value, places=4):
    """A Decimal with a fixed number of places (money is never a float)."""
    if value in (None, ""):
        return "—"
    try:
        return f"{Decimal(str(value)):,.{int(places)}f}"
    except (InvalidOperation, ValueError):
        return str(value)


@register.filter
def get(mapping, key):
    """``mapping[key]`` in a template, or an empty string."""
    try:
        return mapping[key]
    except (KeyError, IndexError, TypeError):
        return ""


@register.filter
def age_minutes(minutes):
    """A window in minutes as ``15 min`` or ``6 h``."""
    return age(int(minutes) * 60)


@register.filter
def sub(value, other):
    """``value - other`` (for trends: now minus then)."""
    try:
        return value - other
    except TypeError:
        return ""


@register.filter
def svgnum(value, places=1):
    """A coordinate for SVG: always a dot as decimal separator, whatever the locale."""
    return f"{float(value):.{int(places)}f}"


@register.filter
def divide(value, by):
    """``value / by`` as a Decimal, or None when ``by`` is zero."""
    try:
        return Decimal(str(value)) / Decimal(str(by)) if by else None
    except (InvalidOperation, ValueError):
        return None
