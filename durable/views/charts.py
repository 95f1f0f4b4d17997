"""Chart geometry for the console's SVG charts: numbers in, coordinates out, no HTML.

The templates (``includes/hbars.html``, ``includes/columns.html``) draw what these return.
"""

from decimal import Decimal

PALETTE = ["#417690", "#e7a33e", "#5b8c5a", "#b35c44", "#79aec8", "#8e6c8a", "#c9b458", "#7a7a7a"]
# The colour of the summed "other" series.
OTHER = "#bbb"


def hbar_chart(items, width=520, bar=16, gap=12, label_height=17, value_room=110):
    """Geometry of a horizontal bar chart of ``(label, Decimal)`` items, largest first.

    Each label is written above its bar, from the left edge, so a long step name has the
    chart's whole width and is never cut at the start.
    """
    top = max((v for _, v in items), default=Decimal(0))
    room = width - value_room
    row = label_height + bar + gap
    bars = []
    for i, (label, value) in enumerate(items):
        length = max(float(value / top) * room if top else 0, 1.0)
        y = i * row + label_height
        bars.append({
            "label": label, "value": value, "y": y, "width": length,
            "label_y": i * row + 12, "text_x": length + 6, "text_y": y + bar * 0.8,
            "color": PALETTE[0],
        })
    return {"bars": bars, "width": width, "height": max(len(items) * row - gap, 0), "bar": bar}


def nice_ceiling(value):
    """The smallest round number (1, 1.2, 1.5, 2 … 8 × 10^n) at or above ``value``: an axis top."""
    if value <= 0:
        return Decimal(1)
    exponent = Decimal(10) ** (value.adjusted())
    for step in (1, Decimal("1.2"), Decimal("1.5"), 2, Decimal("2.5"), 3, 4, 5, 6, 8, 10):
        if value <= exponent * step:
            return exponent * step
    return exponent * 10


def columns_chart(days, series, width=880, height=280, most=7):
    """Geometry of a stacked column chart: one column per day, one colour per series.

    Beyond ``most`` series the smallest are summed as "other", so the legend stays short.
    """
    shown = [dict(s) for s in series[:most]]
    rest = series[most:]
    if rest:
        shown.append({"name": f"other ({len(rest)})",
                      "per_day": [sum((s["per_day"][i] for s in rest), Decimal(0))
                                  for i in range(len(days))],
                      "total": sum((s["total"] for s in rest), Decimal(0))})
    for i, s in enumerate(shown):
        s["color"] = PALETTE[i % len(PALETTE)] if not s["name"].startswith("other (") else OTHER
    totals = [sum((s["per_day"][i] for s in shown), Decimal(0)) for i in range(len(days))]
    # Four gridlines at round values: the step is round, the top is four steps.
    top = nice_ceiling(max(totals, default=Decimal(0)) / 4) * 4
    left, bottom, right, top_pad = 64, 28, 8, 10
    plot_w, plot_h = width - left - right, height - bottom - top_pad
    slot = plot_w / max(len(days), 1)
    bar_w = max(min(slot * 0.7, 48), 2)
    columns = []
    label_every = max(1, round(len(days) / 14))
    for i, day in enumerate(days):
        x = left + i * slot + (slot - bar_w) / 2
        y = top_pad + plot_h
        rects = []
        for s in shown:
            value = s["per_day"][i]
            if not value:
                continue
            h = float(value / top) * plot_h
            y -= h
            rects.append({"x": x, "y": y, "h": h, "color": s["color"], "name": s["name"],
                          "value": value})
        columns.append({"day": day, "rects": rects, "total": totals[i],
                        "label": day.strftime("%d %b") if i % label_every == 0 else "",
                        "label_x": x + bar_w / 2})
    ticks = []
    for n in range(5):
        value = top * n / 4
        ticks.append({"value": value, "label": f"{value.normalize():f}",
                      "y": top_pad + plot_h - plot_h * n / 4})
    return {"width": width, "height": height, "left": left, "plot_w": plot_w,
            "baseline": top_pad + plot_h, "bar_w": bar_w, "columns": columns, "ticks": ticks,
            "series": shown, "label_y": height - 8, "axis_x": left - 6}
