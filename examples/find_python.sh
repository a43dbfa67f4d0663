# Sourced by the example scripts: sets PY to the Python that runs megadlms: $PYTHON if set, else the repository's
# .venv (what `make demo` / `make test` create), else python3; one that cannot import megadlms is refused in one line.
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x "$_repo/.venv/bin/python" ]]; then
  PY="$_repo/.venv/bin/python"
else
  PY=python3
fi
if ! "$PY" -c "import megadlms" 2>/dev/null; then
  fix="run 'make test' in $_repo (it creates .venv), or set PYTHON to the python of an environment with megadlms"
  echo "$(basename "$0"): $PY cannot import megadlms: $fix" >&2
  exit 1
fi
