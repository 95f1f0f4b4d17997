"""Filters for the console templates: ages, money and JSON shown the same way everywhere.

Durations and money are written by ``durable.core.formats``; the filters are those functions.
"""

from decimal import Decimal, InvalidOperation

from django import template
from django.utils import timezone

from ..core import formats

register = template.Library()

register.filter("age", formats.age)
register.filter("duration", formats.duration)
register.filter("money", formats.money)
register.filter("amount", formats.amount)


@register.filter
def since(moment):
    """The age of a datetime, measured now."""
    if not moment:
        return formats.BLANK
    return formats.age((timezone.now() - moment).total_seconds())


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
    return formats.age(int(minutes) * 60)


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
