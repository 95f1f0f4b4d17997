"""Crash, concurrency and fault drills that count what happened.

Each drill starts real worker processes against a real database, injects a fault
(a SIGKILL at a named point, a random kill, a paused lease holder, a killed database
connection, a skewed clock, a busy console), waits for a quiet period and counts:
jobs, kills, lost, stuck, duplicate memos, duplicate outbox rows, duplicate step
executions (and the kills or lease losses that allowed them), duplicate effects at
the receiver, and stale writes. ``python -m tests.drills.run`` prints the table;
``tests/drills/test_*.py`` run the small size and assert the targets.
"""
