"""Durations and money as text: one spelling for the console, the CLI and the alerts."""

import datetime
from decimal import Decimal

import pytest
from django.template import Context, Template

from durable.core import formats


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0 s"), (42.4, "42 s"), (119, "119 s"), (120, "2 min"), (7199, "119 min"),
     (7200, "2 h"), (3 * 3600 + 12 * 60, "3 h 12 min"), (2 * 86400, "2 d"),
     (4 * 86400 + 3 * 3600 + 59, "4 d 3 h"), (-5, "0 s"), (None, "—"), ("", "—"),
     (datetime.timedelta(minutes=7), "7 min")],
)
def test_age(seconds, text):
    assert formats.age(seconds) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.0123, "12 ms"), (1.44, "1.4 s"), (datetime.timedelta(seconds=90), "90 s"),
     (3 * 3600, "3 h"), (None, "—")],
)
def test_duration(value, text):
    assert formats.duration(value) == text


def test_money_keeps_decimals_exact_and_shows_blanks_and_junk_as_they_are():
    assert formats.money(Decimal("1234.5")) == "USD 1,234.50"
    assert formats.money("0.000001") == "USD 0.000001"
    assert formats.amount("0.0000004") == "0.00"
    assert formats.money(None) == "—"
    assert formats.money("n/a") == "n/a"


def test_the_template_filters_are_the_same_functions():
    rendered = Template(
        "{% load durable_console %}{{ s|age }} | {{ d|duration }} | {{ m|money }} | {{ w|age_minutes }}"
    ).render(Context({"s": 4 * 86400 + 3 * 3600, "d": 0.5, "m": "3.14159", "w": 360}))
    assert rendered == "4 d 3 h | 500 ms | USD 3.14159 | 6 h"
