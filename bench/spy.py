"""Read py-spy's collapsed stacks (``py-spy record -f raw``) and say where the time went.

    python -m bench.spy PROFILE.txt [--steps N]

Inclusive shares for the parts of a step a reader cares about (driver round trips and
commits, ORM query building and compiling, model instantiation, logging, JSON), and
the hottest leaf frames. With --steps, shares are also turned into microseconds per step.
"""

import argparse
import collections
import re
import sys

# (label, regex matched against any frame of a sample); a sample counts once per label.
MARKERS = [
    ("worker loop (everything in the worker)", r"Worker\.run \(durable/process\.py"),
    ("  step commit (complete_step)", r"complete_step \(durable/locking\.py"),
    ("  claim and start (claim_job / _sqlite_claim / _pg_claim)",
     r"(claim_job|_sqlite_claim|_pg_claimed) \(durable/locking\.py"),
    ("  driver execute (sqlite3 / psycopg, incl. server round trip)",
     r"(sqlite_execute|pg_execute) \(durable/(locking|sql)\.py"),
    ("  transaction.atomic (the chained last step on PostgreSQL, rare paths)",
     r"(__exit__|__enter__) \(django/db/transaction\.py"),
    ("  the step's own code (workflow.run_step)", r"run_step \(durable/workflows\.py"),
    ("  logging (logger.info and handlers)", r"\(logging/__init__\.py"),
    ("  JSON encode/decode", r"\(json/"),
    ("  signals / faults / heartbeat watch",
     r"(send \(django/dispatch|has_listeners \(django/dispatch|point \(durable/faults|watch \(durable/worker)"),
    ("ORM: building querysets (filter/Q/resolve)",
     r"(_filter_or_exclude|build_filter|add_q|resolve_expression) \(django"),
    ("ORM: SQL compile (as_sql)", r"as_sql \(django/db/models/sql/compiler\.py"),
    ("idle wait (Waiter.wait)", r"Waiter\.wait \(durable/process\.py"),
]

NATIVE_IO = re.compile(r"(fsync|fdatasync|pwrite|__libc_write|poll|recv|send|epoll|select)", re.I)


def parse(path):
    samples = []
    for line in open(path, encoding="utf-8", errors="replace"):
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        try:
            samples.append((stack.split(";"), int(count)))
        except ValueError:
            continue
    return samples


def summarise(path):
    samples = parse(path)
    # Only the worker loop's thread: the heartbeat thread idles in Event.wait().
    loop = re.compile(MARKERS[0][1])
    worker = [(frames, n) for frames, n in samples if any(loop.search(f) for f in frames)]
    total = sum(n for _, n in worker) or 1
    out = {"samples": total, "markers": {}, "leaves": []}
    for label, pattern in MARKERS:
        rx = re.compile(pattern)
        hit = sum(n for frames, n in worker if any(rx.search(f) for f in frames))
        out["markers"][label] = hit / total
    leaves = collections.Counter()
    for frames, n in worker:
        leaves[frames[-1]] += n
    out["leaves"] = [(f, n / total) for f, n in leaves.most_common(15)]
    io = sum(n for frames, n in worker if NATIVE_IO.search(frames[-1]))
    out["markers"]["native leaf in I/O syscall (fsync, write, poll, recv)"] = io / total
    return out


def render(result, seconds=None, steps=None):
    lines = [f"{result['samples']} samples in the worker process's main thread"]
    per_step = seconds / steps * 1e6 if seconds and steps else None
    for label, share in result["markers"].items():
        extra = f"  ~{share * per_step:6.0f} us/step" if per_step else ""
        lines.append(f"{share * 100:5.1f}%{extra}  {label}")
    lines.append("")
    lines.append("hottest leaf frames:")
    for frame, share in result["leaves"]:
        lines.append(f"{share * 100:5.1f}%  {frame[:160]}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--seconds", type=float, default=None, help="worker busy seconds")
    p.add_argument("--steps", type=int, default=None)
    a = p.parse_args(argv)
    print(render(summarise(a.path), a.seconds, a.steps))


if __name__ == "__main__":
    sys.exit(main())
