"""Provider limits as pure rules: what a limit declares, which calls it covers, when a call may go.

A provider limits requests per minute, tokens per minute and calls at once, per API key
and model. ``DURABLE["LIMITS"]`` declares them by name::

    "LIMITS": {
        "openai": {"models": ["gpt-4o*"], "requests_per_minute": 500,
                   "tokens_per_minute": 200_000, "concurrent": 50},
    }

Every worker on every host paces its calls by the same rows in the database
(``durable.store.limits``); this module only does the arithmetic. The pacing is a
virtual schedule per limit (the generic cell rate algorithm): each call books the next
free moment of the limit's requests and of its tokens, so calls go out evenly spaced at
the declared rate, in the order they asked, and a waiting run knows exactly when its
turn is (it waits throttled, on no thread, until then).
"""

import fnmatch
import json
import math
from dataclasses import dataclass

# Keys a limit may declare, and what each is.
FIELDS = {
    "models": "model names the limit covers (patterns: 'gpt-4o*'); default every model",
    "providers": "adapter providers it covers ('openai', 'anthropic'); default every provider",
    "requests_per_minute": "requests the provider allows per minute",
    "tokens_per_minute": "input and output tokens the provider allows per minute",
    "concurrent": "calls in flight at once",
    "headroom": "the share of each rate kept unused, for the provider's clock and the network (0.03)",
    "window": "seconds over which the provider counts its rates (60: a minute)",
    "default_max_tokens": "output tokens reserved for a call that sets no max_tokens (none, as OpenAI counts)",
}
RATES = ("requests_per_minute", "tokens_per_minute")
DEFAULT_HEADROOM = 0.03
# A call that sets no max_tokens reserves only its request's tokens, as OpenAI's own
# limiter counts it; what it writes is added when its usage settles.
DEFAULT_MAX_TOKENS = 0
# Characters per token when a request's tokens are estimated before the call: a
# tokenizer averages about four per token on English text; three errs on the side of
# reserving too many, which the settlement from the reply's usage gives back.
CHARS_PER_TOKEN = 3


class LimitConfigError(ValueError):
    """``DURABLE["LIMITS"]`` is not what it must be; the message says which limit and why."""


@dataclass(frozen=True)
class LimitSpec:
    """One declared limit."""

    name: str
    models: tuple = ("*",)
    providers: tuple = ()
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    concurrent: int | None = None
    headroom: float = DEFAULT_HEADROOM
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    window: float = 60.0

    def late_allowed(self):
        """How late a call may still use its booked moment: the slack the headroom leaves in
        the provider's window. A call sent later than its moment lands in a window with the
        calls booked after it; up to this late, the window still holds no more than it allows."""
        return self.headroom * self.window

    def covers(self, provider, model):
        if self.providers and provider not in self.providers:
            return False
        return any(fnmatch.fnmatchcase(model or "", pattern) for pattern in self.models)

    def seconds_per_request(self):
        """The spacing between two requests at the paced rate (None: no request limit)."""
        return _spacing(self.requests_per_minute, self.headroom)

    def seconds_per_token(self):
        return _spacing(self.tokens_per_minute, self.headroom)

    def paced(self):
        """Whether the limit has a rate (a schedule its calls book moments on), not only calls at once."""
        return bool(self.requests_per_minute or self.tokens_per_minute)

    def spacing(self, tokens):
        """Seconds of the limit's schedule a call of ``tokens`` takes (its request's or its tokens')."""
        return max(self.seconds_per_request() or 0.0, (self.seconds_per_token() or 0.0) * int(tokens))

    def describe(self):
        parts = []
        if self.requests_per_minute:
            parts.append(f"{self.requests_per_minute:g} requests/min")
        if self.tokens_per_minute:
            parts.append(f"{self.tokens_per_minute:,.0f} tokens/min")
        if self.concurrent:
            parts.append(f"{self.concurrent} at once")
        return ", ".join(parts)


def _spacing(per_minute, headroom):
    if not per_minute:
        return None
    return 60.0 / (float(per_minute) * (1.0 - headroom))


def _number(name, key, value, *, whole=False):
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise LimitConfigError(f"LIMITS[{name!r}][{key!r}] must be a number above 0, not {value!r}")
    if whole and value != int(value):
        raise LimitConfigError(f"LIMITS[{name!r}][{key!r}] must be a whole number, not {value!r}")
    return int(value) if whole else value


def _patterns(name, key, value):
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not value or not all(isinstance(v, str) and v for v in value):
        raise LimitConfigError(f"LIMITS[{name!r}][{key!r}] must be a non-empty list of names or"
                               f" patterns, not {value!r}")
    return tuple(value)


def parse(setting):
    """The declared limits as ``LimitSpec``s, or ``LimitConfigError`` naming what is wrong."""
    if setting in (None, {}):
        return ()
    if not isinstance(setting, dict):
        raise LimitConfigError(f"LIMITS must be a dict of limits by name, not {type(setting).__name__}")
    return tuple(_spec(name, declared) for name, declared in setting.items())


def _spec(name, declared):
    if not isinstance(name, str) or not name or len(name) > 100:
        raise LimitConfigError(f"a limit's name must be a string of 1 to 100 characters, not {name!r}")
    if not isinstance(declared, dict):
        raise LimitConfigError(f"LIMITS[{name!r}] must be a dict, not {type(declared).__name__}")
    unknown = sorted(set(declared) - set(FIELDS))
    if unknown:
        raise LimitConfigError(f"LIMITS[{name!r}] has unknown keys {unknown}; a limit declares "
                               f"{', '.join(FIELDS)}")
    if not any(declared.get(key) is not None for key in (*RATES, "concurrent")):
        raise LimitConfigError(f"LIMITS[{name!r}] limits nothing: declare requests_per_minute,"
                               " tokens_per_minute or concurrent")
    fields = {"name": name}
    for key in (*RATES, "window"):
        if declared.get(key) is not None:
            fields[key] = _number(name, key, declared[key])
    for key in ("concurrent", "default_max_tokens"):
        if declared.get(key) is not None:
            fields[key] = _number(name, key, declared[key], whole=True)
    if declared.get("headroom") is not None:
        headroom = declared["headroom"]
        if isinstance(headroom, bool) or not isinstance(headroom, int | float) or not 0 <= headroom < 0.5:
            raise LimitConfigError(f"LIMITS[{name!r}]['headroom'] must be a share from 0 to below 0.5,"
                                   f" not {headroom!r}")
        fields["headroom"] = float(headroom)
    for key in ("models", "providers"):
        if declared.get(key) is not None:
            fields[key] = _patterns(name, key, declared[key])
    return LimitSpec(**fields)


def estimate_tokens(messages, tools=None):
    """A request's tokens, estimated from its characters before the call (tool schemas count)."""
    text = json.dumps([messages, tools or []], default=str, separators=(",", ":"))
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def tokens_to_reserve(estimate, ratio, max_tokens=None, default_max_tokens=DEFAULT_MAX_TOKENS):
    """What a call reserves: its request's estimate, corrected by the limit's learnt ratio, and
    the most it may write (its ``max_tokens``), as the provider itself counts it on arrival."""
    out = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0 \
        else default_max_tokens
    return math.ceil(estimate * ratio) + int(out)


# How fast the ratio follows the calls settled: each weighs this much against the past.
LEARNING = 0.2
RATIO_BOUNDS = (0.05, 4.0)


def learning(estimate, input_tokens):
    """How a call estimated at ``estimate`` tokens that used ``input_tokens`` moves the ratio:
    ``(keep, add)``, the new ratio being ``ratio * keep + add`` (the store applies it in SQL)."""
    if estimate <= 0 or input_tokens <= 0:
        return 1.0, 0.0
    seen = min(max(input_tokens / estimate, RATIO_BOUNDS[0]), RATIO_BOUNDS[1])
    return 1 - LEARNING, LEARNING * seen


def learn(ratio, estimate, input_tokens):
    """The limit's ratio once a call estimated at ``estimate`` tokens used ``input_tokens``."""
    keep, add = learning(estimate, input_tokens)
    return ratio * keep + add


@dataclass(frozen=True)
class Schedule:
    """A limit's virtual schedule: the next free moment of its requests and of its tokens.

    Moments are seconds on the database clock (an epoch); ``None`` is "free now".
    """

    requests_at: float | None = None
    tokens_at: float | None = None
    paused_until: float | None = None


def book(spec, schedule, now, tokens):
    """When a call of ``tokens`` may start under ``spec``, and the schedule after booking it.

    Each rate is a queue of moments: a request takes ``seconds_per_request`` of the
    limit's time and a token ``seconds_per_token``; a call starts when both its request
    and its tokens are free, and not before a pause (a 429's Retry-After) ends. Booked
    in order, calls go out evenly spaced, never faster than the paced rate, so no window
    of the provider's holds more than it allows (less the headroom).
    """
    start = now
    if schedule.paused_until is not None:
        start = max(start, schedule.paused_until)
    per_request, per_token = spec.seconds_per_request(), spec.seconds_per_token()
    if per_request is not None and schedule.requests_at is not None:
        start = max(start, schedule.requests_at)
    if per_token is not None and schedule.tokens_at is not None:
        start = max(start, schedule.tokens_at)
    requests_at = start + per_request if per_request is not None else None
    tokens_at = start + per_token * tokens if per_token is not None else None
    return start, Schedule(requests_at, tokens_at, schedule.paused_until)


def give_back(spec, tokens_at, reserved, used):
    """The token schedule once a call used ``used`` of the ``reserved`` tokens it booked.

    Tokens booked and not used come back to the calls booked after (the schedule moves
    earlier); tokens used beyond the estimate push it later.
    """
    per_token = spec.seconds_per_token()
    if per_token is None or tokens_at is None:
        return tokens_at
    return tokens_at - per_token * (int(reserved) - int(used))
