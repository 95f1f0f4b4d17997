"""A tool's JSON schema from a Python function: ``durable.toolschema.schema_for``.

The code is in ``durable.agents.toolschema``.
"""

from .agents.toolschema import ToolSchemaError, schema_for, validate_arguments

__all__ = ["ToolSchemaError", "schema_for", "validate_arguments"]
