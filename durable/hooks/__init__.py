"""Signals from other systems over HTTP: mount ``durable.hooks.urls`` in the site's urls.

    path("hooks/durable/", include("durable.hooks.urls")),

Each sender is a *source* named in ``DURABLE["WEBHOOKS"]`` with its own credential::

    DURABLE = {"WEBHOOKS": {
        "shop": {"SECRET": env("SHOP_WEBHOOK_SECRET")},   # HMAC-SHA256 signatures
        "crm": {"TOKEN": env("CRM_WEBHOOK_TOKEN")},       # Authorization: Bearer <token>
    }}

A source POSTs JSON ``{"job": key, "name": name, "payload": ..., "dedupe_key": id}`` to
``hooks/durable/<source>/``. A ``SECRET`` source signs each request: the header
``X-Durable-Timestamp`` holds the Unix time in seconds, and ``X-Durable-Signature``
holds ``v1=`` and the hex HMAC-SHA256, keyed with the secret, of the timestamp, a dot
and the raw body. Requests older or newer than ``WEBHOOK_TOLERANCE_SECONDS`` are
refused, so a captured request cannot be replayed later; one replayed within the
window is the same signal (its dedupe key), answered as a duplicate.
"""
