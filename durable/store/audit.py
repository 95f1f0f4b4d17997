"""Who did it, and the entry in Django's admin log: one place for every verb.

``actor(user)`` is the name stored on events, pauses and approvals (``"system"`` for the
engine, a username for a person, the string itself for the CLI's ``--by``).
``admin_log(user, obj, message, flag)`` records a person's action in the admin's
``LogEntry`` table; CLI strings and the engine are not logged there, and nothing is logged
when ``django.contrib.admin`` is not installed.
"""

# Django's LogEntry action flags (``django.contrib.admin.models``), repeated here so that a
# verb can name one without importing the admin's models (they may not be installed).
ADDITION, CHANGE, DELETION = 1, 2, 3


def actor(user):
    """The name an event records for ``user`` (None is the engine itself)."""
    if user is None:
        return "system"
    if isinstance(user, str):
        return user
    return user.get_username()


def admin_log(user, obj, message, flag=CHANGE):
    """Record a person's action on ``obj`` in Django's admin log."""
    if user is None or isinstance(user, str) or not getattr(user, "pk", None):
        return
    # Imported here: the admin app is optional, and its models exist only when installed.
    from django.apps import apps

    if not apps.is_installed("django.contrib.admin"):
        return
    from django.contrib.admin.models import LogEntry

    LogEntry.objects.log_actions(
        user_id=user.pk, queryset=[obj], action_flag=flag, change_message=message,
        single_object=True,
    )
