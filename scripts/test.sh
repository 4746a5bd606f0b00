#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite (what CI runs), in two pytest workers: a module's tests,
# and modules sharing a run, stay in one worker, so that each run is made once; the longest start first
# (tests/conftest.py).
# `--fast`: unit and single-process tests only (no multi-rank training run, no launcher job, none that
# imports a whole framework tree), for working. Any further arguments go to pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
FAST=(
  tests/core tests/test_packaging.py tests/test_docs.py tests/test_claims.py tests/hf/test_resume_claims.py
  tests/checkpoint/test_core.py tests/checkpoint/test_hostile.py tests/checkpoint/test_fuzz.py
  tests/torch_megatron/test_dump.py tests/torch_megatron/test_engine_choice.py tests/torch_megatron/test_regroup.py
  tests/torch_megatron/test_failure_kind.py tests/torch_megatron/test_enable_disable.py
  tests/hf/test_rng.py tests/hf/test_rng_files.py tests/mindspore/test_step_hook.py tests/checkpoint/test_verdicts.py
  tests/launch/test_k8s.py tests/launch/test_k8s_fuzz.py tests/launch/test_doctor.py tests/launch/test_manager_env.py
  tests/launch/test_spares.py tests/launch/test_replacement_logs.py tests/launch/test_capture_race.py
  tests/patch/test_codemod.py tests/patch/test_patch_engine.py
  tests/patch/test_patch_revert_safety.py
)
if [ "${1:-}" = "--fast" ]; then
  shift
  set -- "${FAST[@]}" "$@"
fi
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n 2 "$@"
