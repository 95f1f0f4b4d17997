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

. scripts/venv.sh

exec "$PYTHON" manage.py demo "$@"
