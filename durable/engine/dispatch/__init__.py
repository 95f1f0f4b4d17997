"""The dispatcher: its loop, the slots it sends on, and one row's send from claim to recorded outcome."""
