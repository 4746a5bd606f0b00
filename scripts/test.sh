#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite (what CI runs) in two lanes, one after the other, each in two
# pytest workers (a module's tests, and modules sharing a run, stay in one worker, so that each run is made once;
# the longest start first, tests/conftest.py):
#   pinned  every test, on the pinned releases, but those of the newest lane
#   newest  the tests of the newest releases, installed beside the pinned ones: framework tests again, and the
#           Megatron modules marked newest_megatron, which run on megatron-core 0.19 only (each Megatron module
#           runs on one release: both lanes fit their 45 minutes on 2 cores)
# Each lane says its time; the run fails when either does; the last lines name every failed test and the
# verdicts again, so that a log's tail says what failed. `--lane pinned|newest`: one lane only.
# `--fast`: unit and single-process tests only (no multi-rank training run, no launcher job, none that
# imports a whole framework tree), for working. Any further arguments go to pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
FAST=(
  tests/core tests/test_packaging.py tests/test_docs.py tests/test_claims.py tests/hf/test_resume_claims.py
  tests/checkpoint/test_core.py tests/checkpoint/test_hostile.py tests/checkpoint/test_fuzz.py
  tests/torch_megatron/test_dump.py tests/torch_megatron/test_engine_choice.py tests/torch_megatron/test_regroup.py
  tests/torch_megatron/test_failure_kind.py tests/torch_megatron/test_enable_disable.py
  tests/torch_megatron/test_recover_store.py
  tests/torch_megatron/test_megatron_releases.py
  tests/hf/test_rng.py tests/hf/test_rng_files.py tests/mindspore/test_step_hook.py tests/checkpoint/test_verdicts.py
  tests/launch/test_k8s.py tests/launch/test_k8s_fuzz.py tests/launch/test_doctor.py tests/launch/test_manager_env.py
  tests/launch/test_spares.py tests/launch/test_replacement_logs.py tests/launch/test_capture_race.py
  tests/launch/test_node_loss.py tests/launch/test_scratch.py
  tests/patch/test_codemod.py tests/patch/test_patch_engine.py
  tests/patch/test_patch_revert_safety.py tests/torch_plugin/test_saving.py tests/torch_plugin/test_backend_note.py
  tests/torch_plugin/test_device_marks.py tests/torch_plugin/test_forks.py
)
NEWEST=(
  tests/hf/test_transformers_5.py tests/hf/test_transformers_oldest.py
  tests/torch_megatron/test_megatron_newest_suite.py
  tests/torch_megatron/test_megatron_lm_refs.py
  tests/checkpoint/test_megatron_newer.py
  tests/mindspore/test_mindspore_newer.py tests/mindspore/test_mindformers_releases.py
)
lanes=(pinned newest)
case "${1:-}" in
  --fast)
    shift
    bash scripts/setup.sh
    exec .venv/bin/python -m pytest -n 2 "${FAST[@]}" "$@" ;;
  --lane)
    case "${2:-}" in
      pinned|newest) lanes=("$2"); shift 2 ;;
      *) echo "test.sh: --lane takes pinned or newest, not '${2:-}'" >&2; exit 2 ;;
    esac ;;
esac
bash scripts/setup.sh
failed=0
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
for lane in "${lanes[@]}"; do
  if [ "$lane" = pinned ]; then
    selection=("${NEWEST[@]/#/--ignore=}" -m "not newest_megatron")
  else
    selection=("${NEWEST[@]}")
  fi
  started=$SECONDS
  status=0
  .venv/bin/python -m pytest -n 2 "${selection[@]}" "$@" 2>&1 | tee "$logs/$lane" || status=$?
  if [ "$status" = 0 ]; then verdict=passed; else verdict="FAILED (pytest exit $status)"; failed=1; fi
  echo "lane $lane: $verdict in $((SECONDS - started)) s" | tee -a "$logs/verdicts"
done
# the verdicts and every failed test's summary line again, last: a log read from its end names them
for lane in "${lanes[@]}"; do
  grep -E '^(FAILED|ERROR) ' "$logs/$lane" | sed "s/^/lane $lane: /" || true
done
cat "$logs/verdicts"
exit "$failed"
