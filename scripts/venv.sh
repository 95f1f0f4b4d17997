# Sourced by scripts/test.sh and scripts/demo.sh: create the virtualenv and install
# the project with its test extra, once per version of pyproject.toml.
#
# Reads DURABLE_PYTHON (interpreter, default python3), DURABLE_VENV (default .venv) and
# DURABLE_PIP_EXTRA (extra requirement specs); sets PYTHON to the venv's interpreter.

PYTHON_FOR_VENV=${DURABLE_PYTHON:-python3}
VENV=${DURABLE_VENV:-.venv}
PIP_EXTRA=${DURABLE_PIP_EXTRA:-}

if [ ! -x "$VENV/bin/python" ]; then
    printf '\n==> Creating %s with %s\n' "$VENV" "$PYTHON_FOR_VENV"
    if ! "$PYTHON_FOR_VENV" -m venv "$VENV"; then
        echo "Could not create a virtualenv. On Debian or Ubuntu: apt-get install python3-venv" >&2
        exit 1
    fi
fi
PYTHON="$VENV/bin/python"

# The stamp names what was installed: a changed pyproject.toml or extra
# requirement installs again, an unchanged one costs nothing.
stamp="$VENV/.installed-$("$PYTHON" -c '
import hashlib, sys
digest = hashlib.sha256(open("pyproject.toml", "rb").read())
digest.update(sys.argv[1].encode())
print(digest.hexdigest()[:16])
' "$PIP_EXTRA")"
if [ ! -f "$stamp" ]; then
    printf '\n==> Installing the project and its test dependencies into %s\n' "$VENV"
    # shellcheck disable=SC2086  # PIP_EXTRA holds zero or more requirement specs
    "$PYTHON" -m pip install --quiet --disable-pip-version-check -e '.[test]' $PIP_EXTRA
    rm -f "$VENV"/.installed-*
    touch "$stamp"
fi
