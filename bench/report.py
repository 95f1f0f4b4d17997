"""Median, min and max of every figure over the repeats; the table, in text and Markdown."""

import statistics
from collections import defaultdict

TARGETS = {
    "ratio": 0.5,  # steps/s at least half the ceiling with the same process count
    "latency_p50_ms": {"postgres": 5.0, "sqlite": 50.0},
    "claim_growth": 1.5,  # claim at 1M within 1.5x of claim at 10k
}


def stats(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def _by(records, figure, *keys):
    out = defaultdict(list)
    for rec in records:
        if rec["figure"] == figure:
            out[tuple(rec[k] for k in keys)].append(rec)
    return out


def summarise(result):
    records = result["records"]
    for rec in records:
        if rec["figure"] == "ceiling":
            rec.setdefault("shape", "minimal")
    ceilings = {(r["database"], r["processes"], r["repeat"]): r["tx_per_s"]
                for r in records if r["figure"] == "ceiling" and r["shape"] == "minimal"}
    summary = {"ceiling": {}, "drain": {}, "latency": {}, "claim": {}, "actions": {}, "rss": {},
               "io": {}, "tasks": {}, "dispatch": {}}
    for rec in records:
        if rec["figure"] == "drain":
            rec["threads"] = rec.get("threads") or 1
    for (db, p), recs in sorted(_by(records, "ceiling", "database", "processes").items()):
        minimal = [r for r in recs if r["shape"] == "minimal"]
        schema = [r for r in recs if r["shape"] == "durable"]
        summary["ceiling"][f"{db} p={p}"] = {
            "tx_per_s": stats([r["tx_per_s"] for r in minimal]),
            "cpu_us_per_tx": stats([r["cpu_us_per_tx"] for r in minimal]),
            "schema_tx_per_s": stats([r["tx_per_s"] for r in schema]),
            "schema_cpu_us_per_tx": stats([r["cpu_us_per_tx"] for r in schema]),
        }
    for (db, p, t), recs in sorted(_by(records, "drain", "database", "processes", "threads").items()):
        # The ratio pairs each drain with the ceiling measured just before it.
        ratios = [r["steps_per_s"] / ceilings[(db, p, r["repeat"])]
                  for r in recs if (db, p, r["repeat"]) in ceilings]
        summary["drain"][f"{db} p={p}" + (f" t={t}" if t != 1 else "")] = {
            "steps_per_s": stats([r["steps_per_s"] for r in recs]),
            "jobs_per_s": stats([r["jobs_per_s"] for r in recs]),
            "ratio_to_ceiling": stats(ratios),
            "wall_minus_startup_steps_per_s": stats([r["wall_minus_startup_steps_per_s"] for r in recs]),
            "cpu_us_per_step": stats([r["cpu_us_per_step"] for r in recs]),
            "peak_rss_mb": stats([r["peak_rss_mb"] for r in recs]),
        }
    for (db, p), recs in sorted(_by(records, "latency", "database", "processes").items()):
        summary["latency"][f"{db} p={p}"] = {
            "p50_ms": stats([r["p50_ms"] for r in recs]),
            "p99_ms": stats([r["p99_ms"] for r in recs]),
            "p50_from_commit_ms": stats([r["p50_from_commit_ms"] for r in recs]),
        }
    for (db, size), recs in sorted(_by(records, "claim", "database", "finished_jobs").items()):
        summary["claim"].setdefault(db, {})[size] = stats([r["claim_us"] for r in recs])
    for sizes in summary["claim"].values():
        lo, hi = min(sizes), max(sizes)
        if lo != hi:
            sizes["growth"] = {"from": lo, "to": hi,
                               "ratio": sizes[hi]["median"] / sizes[lo]["median"]}
    for (db,), recs in _by(records, "actions", "database").items():
        summary["actions"][db] = {"actions_per_s": stats([r["actions_per_s"] for r in recs])}
    for (db, p, t), recs in sorted(_by(records, "io", "database", "processes", "threads").items()):
        summary["io"][f"{db} p={p} t={t}"] = {
            "jobs": recs[0]["jobs"], "bound": recs[0]["bound_jobs_per_s"],
            "jobs_per_s": stats([r["jobs_per_s"] for r in recs]),
            "ratio_to_bound": stats([r["ratio_to_bound"] for r in recs]),
            "cpu_us_per_step": stats([r["cpu_us_per_step"] for r in recs]),
            "peak_rss_mb": stats([r["peak_rss_mb"] for r in recs]),
        }
    for (db, p), recs in sorted(_by(records, "tasks", "database", "processes").items()):
        ours = {r["repeat"]: r for r in recs if r["backend"] == "durable"}
        peer = {r["repeat"]: r for r in recs if r["backend"] == "django-tasks-db"}
        summary["tasks"][f"{db} p={p}"] = {
            "durable": stats([r["jobs_per_s"] for r in ours.values()]),
            "peer": stats([r["jobs_per_s"] for r in peer.values()]),
            # Each repeat's pair: durable, then the peer, seconds apart.
            "ratio": stats([ours[k]["jobs_per_s"] / peer[k]["jobs_per_s"] for k in ours if k in peer]),
            "durable_commits": stats([r.get("commits_per_job") for r in ours.values()]),
            "peer_commits": stats([r.get("commits_per_job") for r in peer.values()]),
        }
    for (db, stalled), recs in sorted(_by(records, "dispatch", "database", "stalled").items()):
        summary["dispatch"][f"{db} {'beside a stalled destination' if stalled else 'alone'}"] = {
            "bound": recs[0]["bound_per_s"], "slots": recs[0]["slots"],
            "actions_per_s": stats([r["healthy_actions_per_s"] for r in recs]),
            "ratio": stats([r["healthy_actions_per_s"] / r["bound_per_s"] for r in recs]),
        }
    for (db,), recs in _by(records, "rss", "database").items():
        summary["rss"][db] = rss_trend(recs[-1]["samples"])
    return summary


def rss_trend(samples):
    """RSS early, late, and the growth per 10,000 steps over the second half of the run."""
    samples = [s for s in samples if s["steps"] > 0]
    if len(samples) < 4:
        return {"samples": len(samples)}
    half = samples[len(samples) // 2:]
    slope = 0.0
    xs, ys = [s["steps"] for s in half], [s["rss_mb"] for s in half]
    if len(set(xs)) > 1:
        slope = statistics.linear_regression(xs, ys).slope * 10_000
    first = samples[min(len(samples) - 1, len(samples) // 10)]
    return {"samples": len(samples), "steps": samples[-1]["steps"],
            "rss_mb_at_10pct": first["rss_mb"], "rss_mb_at_10pct_steps": first["steps"],
            "rss_mb_end": samples[-1]["rss_mb"], "rss_mb_max": max(ys + [first["rss_mb"]]),
            "growth_mb_per_10k_steps_second_half": slope}


def _fmt(s, digits=0, unit=""):
    if not s:
        return "-"
    f = f"{{:,.{digits}f}}"
    return f"{f.format(s['median'])}{unit} ({f.format(s['min'])}–{f.format(s['max'])})"


def rows(result):
    """(section, header, rows) tuples shared by the text and Markdown renderers."""
    s = result["summary"]
    out = []
    out.append(("Ceiling: raw driver, no Django. minimal = insert + update + commit on two small "
                "tables; durable-shape = durable's per-step statements (CAS update, memo insert, "
                "event insert, commit) on durable's own tables",
                ["database", "minimal tx/s", "CPU µs/tx", "durable-shape tx/s", "CPU µs/tx"],
                [[k, _fmt(v["tx_per_s"]), _fmt(v["cpu_us_per_tx"]), _fmt(v["schema_tx_per_s"]),
                  _fmt(v["schema_cpu_us_per_tx"])] for k, v in s["ceiling"].items()]))
    out.append((f"durable: {result['options']['jobs']} jobs × 3 no-op steps, runworkers --burst "
                "(first claim → last commit, DB timestamps)",
                ["database", "steps/s", "jobs/s", "× ceiling", "steps/s (wall − start-up)",
                 "CPU µs/step", "peak RSS MB"],
                [[k, _fmt(v["steps_per_s"]), _fmt(v["jobs_per_s"]), _fmt(v["ratio_to_ceiling"], 2),
                  _fmt(v["wall_minus_startup_steps_per_s"]), _fmt(v["cpu_us_per_step"]),
                  _fmt(v["peak_rss_mb"], 1)] for k, v in s["drain"].items()]))
    opts = result["options"]
    if s.get("io"):
        out.append((f"Steps that wait: {opts.get('io_jobs')} one-step jobs whose step sleeps "
                    f"{opts.get('io_sleep')} s (a model call's shape, a plain function), "
                    "runworkers --burst, P processes × T threads",
                    ["database", "jobs", "jobs/s", "bound (P × T / sleep)", "× bound", "CPU µs/step",
                     "peak RSS MB"],
                    [[k, f"{v['jobs']:,}", _fmt(v["jobs_per_s"], 1), f"{v['bound']:.0f}",
                      _fmt(v["ratio_to_bound"], 2), _fmt(v["cpu_us_per_step"]), _fmt(v["peak_rss_mb"], 1)]
                     for k, v in s["io"].items()]))
    if s.get("tasks"):
        out.append((f"@task: {opts.get('task_jobs')} no-op calls, durable's runworkers --burst beside "
                    "django-tasks-db's db_worker --batch, same task, same database, same run; "
                    "commits counted by PostgreSQL (xact_commit) per job",
                    ["database", "durable jobs/s", "django-tasks-db jobs/s", "× peer",
                     "durable commits/job", "peer commits/job"],
                    [[k, _fmt(v["durable"]), _fmt(v["peer"]), _fmt(v["ratio"], 2),
                      _fmt(v["durable_commits"], 2), _fmt(v["peer_commits"], 2)]
                     for k, v in s["tasks"].items()]))
    if s.get("dispatch"):
        out.append((f"Dispatcher: {opts.get('dispatch_jobs')} queued actions, one dispatcher process, "
                    f"a receiver that answers after {opts.get('dispatch_latency')} s; beside a "
                    "stalled destination half of the actions go to one that never answers (2 s read "
                    "timeout). Healthy actions/s from the first send to the last healthy success",
                    ["case", "healthy actions/s", "slots for it", "bound (slots / latency)", "× bound"],
                    [[k, _fmt(v["actions_per_s"]), str(v["slots"]), f"{v['bound']:.0f}",
                      _fmt(v["ratio"], 2)] for k, v in s["dispatch"].items()]))
    out.append(("Submit-to-start latency, idle workers, one submit at a time (ms, from the submit call)",
                ["database", "p50", "p99", "p50 from commit"],
                [[k, _fmt(v["p50_ms"], 1), _fmt(v["p99_ms"], 1), _fmt(v["p50_from_commit_ms"], 1)]
                 for k, v in s["latency"].items()]))
    claim_rows = []
    for db, sizes in s["claim"].items():
        for size, v in sizes.items():
            if size == "growth":
                claim_rows.append([db, f"{v['to']:,} vs {v['from']:,}", f"× {v['ratio']:.2f}"])
            else:
                claim_rows.append([db, f"{size:,}", _fmt(v)])
    out.append(("Claim + commit with finished jobs in the table (µs per claim)",
                ["database", "finished jobs", "µs"], claim_rows))
    out.append(("Targets", ["target", "measured (median)", "verdict"], targets(result)))
    if s["actions"]:
        out.append(("Actions through the dispatcher to a local receiver", ["database", "actions/s"],
                    [[k, _fmt(v["actions_per_s"])] for k, v in s["actions"].items()]))
    else:
        import importlib.util

        why = ("pending: durable.dispatch is not in this tree yet"
               if importlib.util.find_spec("durable.dispatch") is None
               else "not measured in this run")
        out.append(("Actions through the dispatcher", ["figure"], [[why]]))
    if s["rss"]:
        out.append(("One worker's RSS over a long drain", ["database", "steps", "RSS at 10 %",
                    "RSS end", "growth MB / 10k steps (2nd half)"],
                    [[k, f"{v.get('steps', 0):,}", f"{v.get('rss_mb_at_10pct', 0):.1f}",
                      f"{v.get('rss_mb_end', 0):.1f}",
                      f"{v.get('growth_mb_per_10k_steps_second_half', 0):+.2f}"]
                     for k, v in s["rss"].items()]))
    return out


def _busy_line(result):
    busy = [r["busy_before"] for r in result["records"] if r.get("busy_before") is not None]
    if not busy:
        return []
    s = stats(busy)
    lines = [f"machine busy (other work) just before each measurement: median {s['median']:.0%}, "
             f"max {s['max']:.0%} of all cores"]
    fsync = stats([r.get("fsync_ms_before") for r in result["records"]])
    if fsync:
        lines.append(f"4 KiB write + fdatasync just before each measurement: median "
                     f"{fsync['median']:.2f} ms ({fsync['min']:.2f}–{fsync['max']:.2f})")
    return lines


def targets(result):
    """Each target of the issue beside the figure that decides it."""
    s, out = result["summary"], []

    def verdict(ok):
        return "met" if ok else "NOT met"

    for key, v in s["drain"].items():
        db, p = key.rsplit(" p=", 1)
        if p in ("1", "4") and db in ("sqlite-full", "postgres") and v["ratio_to_ceiling"]:
            r = v["ratio_to_ceiling"]["median"]
            out.append([f"steps/s ≥ 0.5 × ceiling, {key}", f"× {r:.2f}", verdict(r >= TARGETS["ratio"])])
    for key, v in s["latency"].items():
        db = key.split(" ")[0]
        limit = TARGETS["latency_p50_ms"]["postgres" if db == "postgres" else "sqlite"]
        if v["p50_ms"] and db in ("sqlite-full", "postgres"):
            a, b = v["p50_ms"]["median"], v["p50_from_commit_ms"]["median"]
            out.append([f"submit-to-start p50 < {limit:g} ms, {key}",
                        f"{a:.1f} ms from the call, {b:.1f} ms from the commit",
                        verdict(a < limit) if (a < limit) == (b < limit)
                        else f"{verdict(a < limit)} from the call, {verdict(b < limit)} from the commit"])
    for db, sizes in s["claim"].items():
        g = sizes.get("growth")
        if g:
            out.append([f"claim at {g['to']:,} within 1.5 × of {g['from']:,}, {db}",
                        f"× {g['ratio']:.2f}", verdict(g["ratio"] <= TARGETS["claim_growth"])])
    for db, v in s["rss"].items():
        if "growth_mb_per_10k_steps_second_half" in v:
            slope = v["growth_mb_per_10k_steps_second_half"]
            # Flat: less than 1 MB over the whole second half of the run.
            half = v["steps"] / 2 / 10_000
            out.append([f"worker RSS flat over {v['steps']:,} steps, {db}",
                        f"{v['rss_mb_at_10pct']:.1f} → {v['rss_mb_end']:.1f} MB, "
                        f"{slope:+.2f} MB / 10k steps", verdict(abs(slope * half) < 1.0)])
    return out


def _machine_lines(result):
    m = result["machine"]
    lines = [f"{m['cores']} cores ({m['cpu']}), {m['memory_gb']} GB, Linux {m['kernel']}, "
             f"Python {m['python']}, Django {m['django']}, psycopg {m['psycopg']}, "
             f"SQLite {m['sqlite']}"]
    if "sqlite_pragmas" in m:
        lines.append(f"SQLite on {m.get('sqlite_filesystem')}: {m['sqlite_pragmas']}")
    if "postgres" in m:
        lines.append(f"PostgreSQL: {m['postgres']}")
    return lines + _busy_line(result)


def render_table(result):
    lines = [f"durable benchmark of {result.get('source', '?')}, {result['started']}, "
             f"{result['duration_s']} s",
             *_machine_lines(result),
             "each cell: median (min–max) over the repeats"]
    for title, header, body in rows(result):
        widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=False)]
        lines += ["", title]
        lines.append("  ".join(str(h).ljust(w) for h, w in zip(header, widths, strict=False)))
        for row in body:
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)))
    if result["errors"]:
        lines += ["", "ERRORS:", *[_short(e) for e in result["errors"]]]
    return "\n".join(lines)


def render_markdown(result):
    lines = ["# durable benchmark results", "",
             f"`{result['command']}` on {result.get('source', '?')}, {result['started']},"
             f" {result['duration_s']} s.", ""]
    lines += [f"- {line}" for line in _machine_lines(result)]
    lines += ["- each cell: median (min–max) over the repeats", ""]
    for title, header, body in rows(result):
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
        lines.append("")
    for db, sizes in result.get("plans", {}).items():
        if sizes:
            big = sizes[-1]
            lines += [f"## Claim query plan on {db} with {big['finished_jobs']:,} finished jobs",
                      "", "```", big["plan"], "```", ""]
    if result["errors"]:
        lines += ["## Errors", ""] + [f"- {_short(e)}" for e in result["errors"]]
    return "\n".join(lines) + "\n"


def _short(error):
    """An error's first line and its last (the exception), not the whole traceback."""
    parts = [line.strip() for line in str(error).splitlines() if line.strip()]
    return parts[0] if len(parts) < 2 else f"{parts[0]} … {parts[-1]}"
