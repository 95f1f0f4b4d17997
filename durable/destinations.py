"""Where actions go: ``durable.destinations.Destination``, ``HttpDestination``, ``register``.

Settings name ``durable.destinations.HttpDestination``; the code is in ``durable.actions.destinations``.
"""

from .actions.destinations import (
    CANNOT_TELL,
    FAILED,
    FOUND,
    NOT_FOUND,
    NOT_SENT,
    SUCCEEDED,
    UNKNOWN,
    Destination,
    HttpDestination,
    LookupResult,
    Outcome,
    Request,
    get,
    register,
    registry,
    session,
)

__all__ = [
    "CANNOT_TELL", "FAILED", "FOUND", "NOT_FOUND", "NOT_SENT", "SUCCEEDED", "UNKNOWN", "Destination",
    "HttpDestination", "LookupResult", "Outcome", "Request", "get", "register", "registry", "session",
]
