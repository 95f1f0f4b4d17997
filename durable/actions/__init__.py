"""Actions: effects that leave the system, written to the outbox, decided on, sent once, reconciled."""
