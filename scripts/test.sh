#!/bin/sh
# Run every check the project has, from a fresh clone with only python3 and pip:
# the system packages some tests need (scripts/system.sh: Chromium, libfaketime, PgBouncer),
# ruff, Django's system checks, the migrations check, then the test suite on
# SQLite and on PostgreSQL. Arguments are passed to pytest:
#
#   sh scripts/test.sh
#   sh scripts/test.sh -m "not crash"
#   sh scripts/test.sh -k approval -x
#
# Environment:
#   DURABLE_TEST_POSTGRES_URL  PostgreSQL server for the second leg
#                              (default postgres://postgres@127.0.0.1:5432/test)
#   CI=true                    an unreachable PostgreSQL, or a system package that
#                              could not be installed, fails the run instead of
#                              skipping the tests that need it
#   DURABLE_PYTHON             interpreter that creates the virtualenv (default python3)
#   DURABLE_VENV               virtualenv directory (default .venv)
#   DURABLE_PIP_EXTRA          extra requirements installed with the project
#   DURABLE_TEST_LEGS          databases to test on (default "sqlite postgres")
#   DURABLE_SKIP_BROWSER=1     leave out browser tests on every leg (and Chromium)
#   DURABLE_TEST_PROCESSES     parallel pytest processes (default 4; 1 runs serially)
#
# Every step runs even if an earlier one failed, so one run shows every problem;
# the exit status is non-zero if any step failed.
set -eu
# Requirement specs such as Django>=6,<6.2 are split on spaces, never globbed.
set -f

cd "$(dirname "$0")/.."

LEGS=${DURABLE_TEST_LEGS:-sqlite postgres}
SKIP_BROWSER=${DURABLE_SKIP_BROWSER:-0}
PROCESSES=${DURABLE_TEST_PROCESSES:-4}
CI=${CI:-false}
DURABLE_TEST_POSTGRES_URL=${DURABLE_TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}
export DURABLE_TEST_POSTGRES_URL

heading() {
    printf '\n==> %s\n' "$*"
}

failed=""
fail() {
    failed="$failed
  - $*"
}

# Virtualenv and dependencies

. scripts/venv.sh
"$PYTHON" -c 'import django, sys; print(f"Python {sys.version.split()[0]}, Django {django.__version__}")'

# System packages: installed when missing and possible (root, apt-get). Otherwise the
# tests that need one say how to get it and are skipped, or fail with CI=true.

tools="faketime pgbouncer"
if [ "$SKIP_BROWSER" != 1 ]; then
    tools="chromium $tools"
fi
heading "system packages: $tools"
# shellcheck disable=SC2086  # one word per tool
if ! sh scripts/system.sh $tools && [ "$CI" = true ]; then
    fail "system packages"
fi

# Static checks

lint_dirs=""
for dir in durable tests project bench; do
    if [ -d "$dir" ]; then
        lint_dirs="$lint_dirs $dir"
    fi
done
heading "ruff check$lint_dirs"
# shellcheck disable=SC2086  # one word per directory
"$PYTHON" -m ruff check $lint_dirs || fail "ruff"

# The checks load the test settings (the example site plus the test app) on
# SQLite: they inspect code and models, not a database server.
heading "manage.py check"
DJANGO_SETTINGS_MODULE=tests.settings DURABLE_TEST_DATABASE=sqlite \
    "$PYTHON" manage.py check || fail "manage.py check"

heading "manage.py makemigrations --check"
DJANGO_SETTINGS_MODULE=tests.settings DURABLE_TEST_DATABASE=sqlite \
    "$PYTHON" manage.py makemigrations --check --dry-run || fail "missing migrations"

# Test legs

# Run pytest on one database, adding the leg's marker expression to the caller's
# -m (pytest keeps only the last -m, so the two must become one expression).
run_pytest() {
    database=$1
    leg_marker=$2
    shift 2
    user_marker=""
    marker_follows=0
    for arg do
        shift
        if [ "$marker_follows" = 1 ]; then
            user_marker=$arg
            marker_follows=0
            continue
        fi
        case $arg in
            -m) marker_follows=1; continue ;;
            -m*) user_marker=${arg#-m}; continue ;;
        esac
        set -- "$@" "$arg"
    done
    if [ -n "$user_marker" ] && [ -n "$leg_marker" ]; then
        marker="($user_marker) and ($leg_marker)"
    else
        marker="$user_marker$leg_marker"
    fi
    # Most of the suite's time is spent waiting on real worker processes (leases
    # expiring, receivers replying), not computing: several test processes overlap
    # those waits. Each has its own test database (pytest-django adds a suffix).
    if [ "$PROCESSES" != 0 ] && [ "$PROCESSES" != 1 ]; then
        set -- -n "$PROCESSES" "$@"
    fi
    if [ -n "$marker" ]; then
        DURABLE_TEST_DATABASE=$database "$PYTHON" -m pytest -m "$marker" "$@"
    else
        DURABLE_TEST_DATABASE=$database "$PYTHON" -m pytest "$@"
    fi
}

browser_marker=""
if [ "$SKIP_BROWSER" = 1 ]; then
    browser_marker="not browser"
fi

for leg in $LEGS; do
    case $leg in
        sqlite)
            heading "pytest on SQLite"
            run_pytest sqlite "$browser_marker" "$@" || fail "tests on SQLite"
            ;;
        postgres)
            heading "pytest on PostgreSQL"
            # A two-second probe first: without a server, the leg would only
            # produce a screen of connection errors.
            if problem=$("$PYTHON" -c '
import os, re, psycopg
url = os.environ["DURABLE_TEST_POSTGRES_URL"]
try:
    psycopg.connect(url, connect_timeout=2).close()
except psycopg.Error as exc:
    shown = re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", url)  # never print a password
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    print(f"{shown} ({reason})")
' 2>&1) && [ -z "$problem" ]; then
                # Browser tests drive the web UI, which does not depend on the
                # database: the SQLite leg covers them.
                run_pytest postgres "not browser" "$@" || fail "tests on PostgreSQL"
            elif [ "$CI" = true ]; then
                echo "PostgreSQL not reachable at $problem, and CI=true: failing." >&2
                fail "PostgreSQL not reachable"
            else
                echo "PostgreSQL not reachable at $problem; its tests were skipped." \
                    "Start PostgreSQL or set DURABLE_TEST_POSTGRES_URL to run them."
            fi
            ;;
        *)
            echo "Unknown test leg '$leg' in DURABLE_TEST_LEGS (expected sqlite, postgres)" >&2
            exit 2
            ;;
    esac
done

if [ -n "$failed" ]; then
    heading "FAILED:$failed"
    exit 1
fi
heading "All checks passed"
