#!/bin/sh
# The system packages some tests need, from Debian, installed with apt-get when missing:
#
#   chromium  the browser tests: Playwright drives the system's Chromium (no browser
#             build is ever downloaded)
#   faketime  the clock-skew drills: libfaketime moves one worker's wall clock
#   pgbouncer the PgBouncer tests: workers reach PostgreSQL through a PgBouncer in
#             transaction pooling that the test starts itself (the package's own
#             service is left alone)
#
#   sh scripts/system.sh                 install whichever is missing
#   sh scripts/system.sh faketime        only that one
#   sh scripts/system.sh --check         install nothing; say what is missing
#
# scripts/test.sh runs it first. Installing needs root and apt-get; `apt-get update`
# runs only when an install fails (a fresh container has no package lists). apt-get's
# output is shown only when it fails. Without a tool, the tests that need it are
# skipped saying how to get it (with CI=true they fail instead).
#
# Exit status: 0 when every tool asked for is present at the end, 1 when one is
# missing, 2 for a bad argument. DURABLE_SYSTEM_PREFIX is a directory to look in
# instead of / (the tests of this script use it).
set -eu

ALL_TOOLS="chromium faketime pgbouncer"
PREFIX=${DURABLE_SYSTEM_PREFIX:-}

usage() {
    echo "usage: sh scripts/system.sh [--check] [$(echo "$ALL_TOOLS" | sed 's/ /] [/g')]" >&2
    exit 2
}

# Whether a tool is present, looked for where the tests look for it.
present() {
    case $1 in
        chromium) [ -x "$PREFIX/usr/bin/chromium" ] ;;
        faketime)
            for library in "$PREFIX"/usr/lib/*/faketime/libfaketimeMT.so.1 \
                    "$PREFIX"/usr/lib/faketime/libfaketimeMT.so.1; do
                [ -e "$library" ] && return 0
            done
            return 1
            ;;
        pgbouncer) [ -x "$PREFIX/usr/sbin/pgbouncer" ] ;;
    esac
}

check=0
tools=""
for arg do
    case $arg in
        --check) check=1 ;;
        -h|--help) usage ;;
        chromium|faketime|pgbouncer) tools="$tools $arg" ;;
        *) echo "scripts/system.sh: unknown tool '$arg' (known: $ALL_TOOLS)" >&2; usage ;;
    esac
done
tools=${tools:-$ALL_TOOLS}

missing=""
for tool in $tools; do
    if present "$tool"; then
        echo "$tool: installed"
    else
        missing="$missing $tool"
    fi
done
[ -z "$missing" ] && exit 0

how="apt-get install -y$missing"
if [ "$check" = 1 ]; then
    for tool in $missing; do
        echo "$tool: missing"
    done
    echo "Install with: sh scripts/system.sh (as root), or: $how"
    exit 1
fi

cannot() {
    echo "Could not install$missing: $1." >&2
    echo "Install it as root with: $how" >&2
    echo "Until then the tests that need it are skipped (with CI=true they fail)." >&2
    exit 1
}
command -v apt-get >/dev/null 2>&1 || cannot "apt-get is not available (not Debian or Ubuntu)"
[ "$(id -u)" = 0 ] || cannot "installing needs root"

echo "Installing$missing with apt-get"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
apt() {
    # Waits for a dpkg lock held by anything else rather than failing at once.
    DEBIAN_FRONTEND=noninteractive apt-get -q -y -o DPkg::Lock::Timeout=600 "$@" >>"$log" 2>&1
}
# shellcheck disable=SC2086  # one word per package
if ! apt install $missing; then
    # shellcheck disable=SC2086
    apt update && apt install $missing || {
        tail -n 5 "$log" >&2
        cannot "apt-get failed (its last lines are above)"
    }
fi
for tool in $missing; do
    if present "$tool"; then
        echo "$tool: installed"
    else
        cannot "the $tool package did not provide what the tests use"
    fi
done
