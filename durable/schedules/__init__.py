"""Schedules: declared in code or settings (``cron``), fired by any worker process, one job per tick (``firing``)."""
