"""Deciding on proposals: ``durable.approvals.approve`` and ``reject``, as the README shows them.

The decisions live in ``durable.actions.approvals``.
"""

from .actions.approvals import approve, can_decide, prepare_again, reject

__all__ = ["approve", "can_decide", "prepare_again", "reject"]
