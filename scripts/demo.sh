#!/usr/bin/env bash
# Set up (if needed) and run the demo: a 2-rank Megatron GPT pretrain() on CPU with ft_plugins on.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/megatron_gpt/demo.py "$@"
