#!/usr/bin/env bash
# Create .venv with the pinned frameworks (CPU) and ft_plugins installed editable. Idempotent:
# a second run only re-installs ft_plugins unless scripts/requirements.txt or this file changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
VENV=.venv
STAMP="$VENV/.ft_plugins_setup"
want="$(cat scripts/requirements.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  echo "setting up $VENV (first run takes a few minutes)..."
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r scripts/requirements.txt
  # megatron-core 0.17.x is the release that ships megatron/training; PyPI marks it Python >= 3.12,
  # but its files run on 3.11, so it is installed without its metadata check.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --ignore-requires-python \
    --python-version 3.12 --only-binary=:all: --upgrade \
    --target "$VENV/lib/python3.11/site-packages" megatron-core==0.17.1
  echo "$want" > "$STAMP"
fi
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -e .
