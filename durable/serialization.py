"""JSON as durable stores it: what every supported database accepts."""

import json
import re

from django.core.serializers.json import DjangoJSONEncoder

# An escaped NUL that is not itself an escaped backslash followed by "u0000".
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def storable_json(value, **kwargs):
    """JSON text of ``value`` that SQLite and PostgreSQL can both store.

    Raises TypeError for values JSON cannot represent and ValueError for NaN/infinity
    and for NUL characters and lone surrogates, which PostgreSQL's jsonb refuses at
    commit time (SQLite stores them, so development would not notice).
    """
    text = json.dumps(value, cls=DjangoJSONEncoder, allow_nan=False, **kwargs)
    if "\\u0000" in text and _NUL.search(text):
        raise ValueError("it contains a NUL character (\\u0000), which PostgreSQL cannot store")
    if "\\ud" in text:
        try:
            json.dumps(value, cls=DjangoJSONEncoder, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("it contains a lone UTF-16 surrogate, which is not Unicode") from None
    return text
