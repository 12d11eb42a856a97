#!/usr/bin/env bash
# The two commands of the README:
#   bash run.sh demo   plan + estimate + simulate + a short CPU training run on the embedded default
#   bash run.sh test   the whole test suite
# Both create (once) and reuse a local virtual environment in .venv; run either as often as you like.
set -euo pipefail
cd "$(dirname "$0")"

VENV=.venv
STAMP="$VENV/.fivefold-installed"

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating virtual environment in $VENV"
    python3 -m venv "$VENV"
  fi
  # Reinstall only when the dependency list changed since the last install.
  local want
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    echo "==> installing fivefold and its dependencies (torch==2.13.0) into $VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install --quiet -e ".[dev]"
    echo "$want" > "$STAMP"
  fi
}

case "${1:-}" in
  demo)
    setup
    shift
    exec "$VENV/bin/python" -m fivefold.demo "$@"
    ;;
  test)
    setup
    shift
    # pytest exits 5 when no test ran; that is a failure here too.
    exec "$VENV/bin/python" -m pytest -q "$@"
    ;;
  *)
    echo "usage: bash run.sh demo | bash run.sh test [pytest args]" >&2
    exit 2
    ;;
esac
