"""An operator's grant of more action calls to an agent's job: ``durable.agent_actions.grant``.

The code is in ``durable.agents.tools``.
"""

from .agents.tools import grant

__all__ = ["grant"]
