"""The no-op ``@task`` both task backends drain in the task figure.

Imported by durable's workers (``django_task`` jobs name it by path) and by the peer's
``db_worker`` in its own virtualenv (see bench/peers.py): the same function, the same
module path, on the same database.
"""

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the django-tasks backport
    from django_tasks import task


@task
def noop():
    return None
