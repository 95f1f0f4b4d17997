"""The store: the rows' every write, each a named move, and the raw statements per database.

A state move is named (``moves``: ``hand_over``, ``run_again``, ``retry_at``, ...) and the
move owns the lease and due columns it writes. The writes are ``locking``'s (a job's
claim, commit, lease and transition), ``action_rows``'s (an outbox row's claim and the
writes around its send), ``submission``, ``wakeups``, ``ledger`` and ``rollups``.

A move whose statements differ between databases asks the database's class,
``database.of(connection)``: ``postgres.PostgresStore`` and ``sqlite.SqliteStore`` hold
their dialect's statement text and run it; ``base.Database`` makes the same moves with
the ORM, for any other database, and names what the code above may ask of a database
(``notifies``, ``key_prefix``, ``estimated_count``, ...).

Nothing above the store names a lease column or a database vendor (``database.of`` is
the one place that does); the store imports nothing above the models.
"""
