"""Which database class serves a connection: the one test of the database vendor.

``of(connection)`` returns the store's instance for that connection's database
(``PostgresStore``, ``SqliteStore``, or the ORM's ``Database`` for any other), one per
vendor, made once. Everything else asks it (``database.of(connection).notifies``,
``database.current().claim_job(...)``) and never names a vendor.
"""

from django.db import DEFAULT_DB_ALIAS, connections

from .base import Database
from .postgres import PostgresStore
from .sqlite import SqliteStore

CLASSES = {"postgresql": PostgresStore, "sqlite": SqliteStore}

_instances = {}


def of(connection):
    """The store's class for ``connection``'s database, as its one instance."""
    try:
        return _instances[connection.vendor]
    except KeyError:
        return _instances.setdefault(connection.vendor, CLASSES.get(connection.vendor, Database)())


def for_alias(alias):
    """The store's class for the database ``alias`` names."""
    return of(connections[alias])


def current():
    """The store's class for the default database, where durable's rows are."""
    return of(connections[DEFAULT_DB_ALIAS])


__all__ = ["Database", "PostgresStore", "SqliteStore", "current", "for_alias", "of"]
