"""Declaring schedules: ``durable.cron.Schedule`` and ``tick_of``.

The schedules live in ``durable.schedules.firing``.
"""

from .schedules.cron import Schedule, tick_of

__all__ = ["Schedule", "tick_of"]
