"""One worker process with no supervisor, for drills that kill workers thousands of times.

It runs the very entry point a ``runworkers`` child runs; only the replacement of a
dead process is left to the drill, which replaces it at once. (The supervisor slows
down a child that keeps crashing, rightly for a broken deploy, but a drill that
crashes workers on purpose would then measure the backoff, not the engine.)

    python -m tests.drills.worker INDEX [THREADS]
"""

import os
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from durable.engine.supervisor import _run_role

    options = {"threads": int(argv[1])} if len(argv) > 1 else {}
    _run_role("worker", int(argv[0]) if argv else 0, options)


if __name__ == "__main__":
    main()
