#!/bin/sh
# The first command to run: the lead pipeline, on SQLite, with nothing leaving the machine.
#
#   sh scripts/demo.sh               the site on http://127.0.0.1:8000 and the workers
#   sh scripts/demo.sh --no-server   terminal only, ending with `manage.py durable status`
#   sh scripts/demo.sh --help        every option (batch size, workers, port, ...)
#
# It creates .venv and installs the project if needed, migrates, prints an operator
# login, submits a batch of leads, starts the site and `runworkers`, kills one worker
# mid-step on purpose, and says where to look. Ctrl-C stops everything it started.
#
# Environment:
#   DURABLE_PYTHON  interpreter that creates the virtualenv (default python3)
#   DURABLE_VENV    virtualenv directory (default .venv)
#   DATABASE_URL    another database (default: db.sqlite3 in the project folder)
set -eu

cd "$(dirname "$0")/.."

PYTHON_FOR_VENV=${DURABLE_PYTHON:-python3}
VENV=${DURABLE_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
    echo "==> Creating $VENV with $PYTHON_FOR_VENV"
    if ! "$PYTHON_FOR_VENV" -m venv "$VENV"; then
        echo "Could not create a virtualenv. On Debian or Ubuntu: apt-get install python3-venv" >&2
        exit 1
    fi
fi
PYTHON="$VENV/bin/python"

# The same stamp as scripts/test.sh: an unchanged pyproject.toml installs nothing.
stamp="$VENV/.installed-$("$PYTHON" -c '
import hashlib, sys
digest = hashlib.sha256(open("pyproject.toml", "rb").read())
digest.update(sys.argv[1].encode())
print(digest.hexdigest()[:16])
' "")"
if [ ! -f "$stamp" ]; then
    echo "==> Installing the project into $VENV (once)"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check -e '.[test]'
    rm -f "$VENV"/.installed-*
    touch "$stamp"
fi

exec "$PYTHON" manage.py demo "$@"
