"""The store: the rows' every write, each a named move, and the raw statements per database.

Nothing above the store names a lease column or a database vendor; the store imports
nothing above the core.
"""
