"""The JSON schema a model API wants for a tool, built from a Python function.

A tool is declared once, as a function with type hints and a docstring; the model
sees the schema built from them, and the model's arguments are checked against the
same schema before the function runs (or before an action tool's proposal is
written). Arguments that fail are the model's mistake, returned to it as the tool's
error result, never a crash of the job.

Supported annotations: ``str``, ``int``, ``float``, ``bool``, ``list[X]``,
``dict``/``dict[str, X]``, ``Literal[...]``, ``enum.Enum`` subclasses, ``X | None``
(optional), and parameters with defaults (not required). A first parameter named
``ctx`` is the run's context, not a model argument. Parameter descriptions come from
a Google-style ``Args:`` section or Sphinx ``:param name:`` lines of the docstring.
"""

import enum
import inspect
import re
import types
import typing

__all__ = ["schema_for", "validate_arguments", "ToolSchemaError"]

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


class ToolSchemaError(TypeError):
    """A tool function's signature cannot be described to a model (a programming error)."""


def _describe(annotation, where):
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    if annotation is dict or origin is dict:
        schema = {"type": "object"}
        if len(args) == 2 and args[1] is not typing.Any:
            schema["additionalProperties"] = _describe(args[1], where)
        return schema
    if annotation is list or origin in (list, tuple, set, frozenset):
        schema = {"type": "array"}
        if args and args[0] is not Ellipsis:
            schema["items"] = _describe(args[0], where)
        return schema
    if origin is typing.Literal:
        kinds = {type(value) for value in args}
        schema = {"enum": list(args)}
        if len(kinds) == 1 and next(iter(kinds)) in _SCALARS:
            schema["type"] = _SCALARS[next(iter(kinds))]
        return schema
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _describe(typing.Literal[tuple(member.value for member in annotation)], where)
    if origin in (typing.Union, types.UnionType):
        rest = [arg for arg in args if arg is not type(None)]
        if len(rest) == 1:
            schema = _describe(rest[0], where)
            return {**schema, "nullable": True} if len(rest) < len(args) else schema
        return {"anyOf": [_describe(arg, where) for arg in args]}
    if annotation is typing.Any:
        return {}
    raise ToolSchemaError(f"{where}: cannot describe {annotation!r} to a model; use str, int, float, bool, "
                          f"list, dict, Literal, an Enum or X | None")


def _param_docs(doc):
    """``{name: description}`` from an ``Args:`` section or ``:param name:`` lines."""
    found = {}
    for name, text in re.findall(r"^\s*:param\s+(?:\w+\s+)?(\w+):\s*(.+)$", doc, re.M):
        found[name] = text.strip()
    section = re.search(r"^\s*(?:Args|Arguments|Parameters):\s*\n(.*?)(?:\n\s*\n|\Z)", doc, re.S | re.M)
    if section:
        current = None
        for line in section.group(1).splitlines():
            match = re.match(r"^\s*(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
            if match:
                current = match.group(1)
                found[current] = match.group(2).strip()
            elif current and line.strip():
                found[current] = f"{found[current]} {line.strip()}".strip()
    return found


def _summary(doc):
    paragraphs = re.split(r"\n\s*\n", doc.strip(), maxsplit=1) if doc else [""]
    return " ".join(paragraphs[0].split())


def schema_for(func, *, name=None, description=None):
    """The chat-completions ``tools`` entry for ``func``."""
    name = name or func.__name__
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ToolSchemaError(f"tool name {name!r} must be 1-64 letters, digits, '_' or '-'")
    doc = inspect.getdoc(func) or ""
    hints = typing.get_type_hints(func)
    docs = _param_docs(doc)
    properties, required = {}, []
    parameters = list(inspect.signature(func).parameters.values())
    if parameters and parameters[0].name == "ctx":
        parameters = parameters[1:]
    for param in parameters:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolSchemaError(f"tool {name}: *args and **kwargs cannot be described to a model")
        if param.name not in hints:
            raise ToolSchemaError(f"tool {name}: parameter {param.name!r} needs a type hint")
        schema = _describe(hints[param.name], f"tool {name}, parameter {param.name!r}")
        if param.name in docs:
            schema["description"] = docs[param.name]
        if param.default is param.empty:
            required.append(param.name)
        else:
            schema["default"] = param.default.value if isinstance(param.default, enum.Enum) else param.default
        properties[param.name] = schema
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description or _summary(doc),
            "parameters": {"type": "object", "properties": properties, "required": required,
                           "additionalProperties": False},
        },
    }


_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _check(value, schema, path, errors):
    """Append to ``errors`` what keeps ``value`` from fitting ``schema``: null where allowed,
    one of anyOf, the type, the enum, then each item of an array or each key of an object."""
    if value is None and schema.get("nullable"):
        return
    if "anyOf" in schema:
        if not any(not _errors(value, option, path) for option in schema["anyOf"]):
            errors.append(f"{path}: {value!r} matches none of the allowed types")
        return
    kind = schema.get("type")
    if kind and not _TYPES[kind](value):
        errors.append(f"{path}: expected {kind}, got {type(value).__name__} {value!r}"[:200])
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']!r}"[:200])
    if kind == "array" and "items" in schema:
        for index, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{index}]", errors)
    if kind == "object":
        _check_object(value, schema, path, errors)


def _check_object(value, schema, path, errors):
    """An object with properties has the required keys, only those properties (when
    additionalProperties is False) and fitting values; a map's values fit its value schema."""
    properties = schema.get("properties")
    if properties is not None:
        for missing in [key for key in schema.get("required", []) if key not in value]:
            errors.append(f"{path or 'arguments'}: missing required argument {missing!r}")
        for key, item in value.items():
            if key in properties:
                _check(item, properties[key], f"{path}.{key}" if path else key, errors)
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path or 'arguments'}: unexpected argument {key!r}")
    elif isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            _check(item, schema["additionalProperties"], f"{path}.{key}" if path else key, errors)


def _errors(value, schema, path):
    errors = []
    _check(value, schema, path, errors)
    return errors


def validate_arguments(tool_schema, arguments):
    """The problems with the model's ``arguments`` for a tool (an empty list when they fit)."""
    parameters = tool_schema["function"]["parameters"] if "function" in tool_schema else tool_schema
    if not isinstance(arguments, dict):
        return [f"arguments must be a JSON object, got {type(arguments).__name__}"]
    return _errors(arguments, parameters, "")
