#!/usr/bin/env bash
# Create .venv with the pinned frameworks (CPU) and ft_plugins built and installed from its wheel. Idempotent:
# a second run only rebuilds and re-installs ft_plugins unless scripts/requirements.txt or the pinned megatron-core
# changed (the side directories below are reinstalled each when what it is installed from changed).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
VENV=.venv
# gcc: the launcher tests build stub shared libraries, and TaskD's libtaskd.so is built with cgo; g++: megatron-core
# 0.19's dataset helpers for this interpreter (below)
if ! command -v gcc >/dev/null || ! command -v g++ >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing gcc and g++ (apt-get)..."
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc g++ >/dev/null
  else
    echo "setup.sh: gcc and g++ are needed (launcher tests, TaskD's libtaskd.so, megatron-core's dataset helpers):" \
      "install them, e.g. apt-get install gcc g++" >&2
    exit 1
  fi
fi
STAMP="$VENV/.ft_plugins_setup"
MEGATRON_PIN=megatron-core==0.17.1
want="$( (cat scripts/requirements.txt; echo "$MEGATRON_PIN") | sha256sum | cut -d' ' -f1)"
# The parts below download and build at once, each in a process of its own (their downloads overlap): the releases
# installed beside the pinned environment, the real TaskD, and the pinned environment itself where it changed.
parts=(releases_beside real_taskd)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  echo "setting up $VENV (first run takes a few minutes)..."
  "$PYTHON" -m venv "$VENV"
  parts+=(pinned_environment)
fi
pinned_environment() {
  "$VENV/bin/pip" install -q --disable-pip-version-check -r scripts/requirements.txt
  # megatron-core 0.17.x is the release that ships megatron/training; PyPI marks it Python >= 3.12,
  # but its files run on 3.11, so it is installed without its metadata check.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --ignore-requires-python \
    --python-version 3.12 --only-binary=:all: --upgrade \
    --target "$VENV/lib/python3.11/site-packages" "$MEGATRON_PIN"
  echo "$want" > "$STAMP"
  echo "installed the pinned environment (scripts/requirements.txt, $MEGATRON_PIN) in $VENV"
}
# install_beside DIR PIP_ARGS...: a newer release installed into DIR beside the pinned one, never on sys.path
# unless a test puts it there, its dependencies the pinned environment's (--no-deps); again only when what it is
# installed from changed (the arguments, or the requirements file's content), which DIR's marker holds.
install_beside() {
  local side=$1 started=$SECONDS
  shift
  local want="$*"
  if [ "$1" = -r ]; then want="$(sha256sum < "$2" | cut -d' ' -f1)"; fi
  if [ "$(cat "$side/.installed" 2>/dev/null)" != "$want" ]; then
    rm -rf "$side"
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --only-binary=:all: --target "$side" "$@"
    echo "$want" > "$side/.installed"
    echo "installed $* in $side: $((SECONDS - started)) s"
  fi
}
# A newer megatron-core beside it (never on sys.path unless a test puts it there): its torch_dist
# checkpoints differ (no common.pt since 0.19). Python >= 3.12 by metadata; on 3.11 it needs triton
# and typing.override, which the directory's sitecustomize takes from typing_extensions.
NEWER_MEGATRON="$VENV/megatron-core-0.19"
NEWER_MEGATRON_PIN="megatron-core==0.19.2"
releases_beside() {
  local started requirements side archive unpacked
  if [ "$(cat "$NEWER_MEGATRON/.installed" 2>/dev/null)" != "$NEWER_MEGATRON_PIN" ]; then
    started=$SECONDS
    rm -rf "$NEWER_MEGATRON"
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --ignore-requires-python \
      --python-version 3.12 --only-binary=:all: --target "$NEWER_MEGATRON" "$NEWER_MEGATRON_PIN"
    # triton has compiled parts: this interpreter's own build, not the 3.12 one
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --target "$NEWER_MEGATRON/triton-build" triton==3.8.0
    mv "$NEWER_MEGATRON"/triton-build/* "$NEWER_MEGATRON"/ && rmdir "$NEWER_MEGATRON/triton-build"
    printf '%s\n' '# megatron-core >= 0.18 imports typing.override (Python 3.12); typing_extensions has it.' \
      'import typing' 'if not hasattr(typing, "override"):' \
      '    from typing_extensions import override' '    typing.override = override' \
      > "$NEWER_MEGATRON/sitecustomize.py"
    echo "$NEWER_MEGATRON_PIN" > "$NEWER_MEGATRON/.installed"
    echo "installed $NEWER_MEGATRON_PIN + triton in $NEWER_MEGATRON: $((SECONDS - started)) s," \
      "$(du -sh "$NEWER_MEGATRON" | cut -f1)"
  fi
  # The newest transformers beside the pinned 4.57, which the Trainer tests of the 5.x line run against
  # (tests/hf/test_transformers_5.py); and the oldest supported, which the Trainer tests of the 4.x line run against
  # (tests/hf/test_transformers_oldest.py).
  for requirements in scripts/requirements-transformers-5.txt scripts/requirements-transformers-4.40.txt; do
    side="$VENV/$(basename "$requirements" .txt)"
    install_beside "${side/requirements-/}" -r "$requirements"
  done
  # The newest MindSpore beside the pinned 2.7.2: the MindSpore tests of tests/mindspore/test_mindspore_newer.py run
  # against it. The MindFormers that asks for it (2.0) needs hyper-parallel, which no package registry holds.
  install_beside "$VENV/mindspore-2.10" mindspore==2.10.0
  # The newest MindFormers that installs beside a MindSpore the registry has, with that MindSpore: MindFormers 1.9.0
  # asks for MindSpore ~= 2.9.0 (2.0 needs hyper-parallel, which no registry holds; 2.1.0 asks for MindSpore 2.11,
  # which the registry does not have). The MindFormers tests run against it
  # (tests/mindspore/test_mindformers_releases.py).
  install_beside "$VENV/mindformers-1.9" mindspore==2.9.0 mindformers==1.9.0
  # The oldest supported MindFormers, with the pinned MindSpore 2.7.2: 1.6.0, the first that asks for a MindSpore
  # ft_plugins supports (~=2.7.0rc1; 1.3.2, the release before it on the registry, asks for 2.4). The same tests.
  install_beside "$VENV/mindformers-1.6" mindformers==1.6.0
  # The oldest supported megatron-core, MindSpeed-LLM's base: its wheel holds megatron/core only (megatron/training
  # came with Megatron-LM's source then); tests/torch_megatron/test_megatron_names.py checks the names the glue reaches
  # in megatron.core against it. It imports pkg_resources, which setuptools 81 dropped.
  install_beside "$VENV/megatron-core-0.8" megatron-core==0.8.0 setuptools==80.9.0
  # The release MindSpeed-LLM 26.0 builds on, megatron/core only too (tests/torch_megatron/test_megatron_lm_refs.py).
  install_beside "$VENV/megatron-core-0.12" megatron-core==0.12.1 setuptools==80.9.0
  # Megatron-LM's training side (pretrain_gpt.py, megatron/training) at four refs, vendored beside the repository as
  # `git archive` tarballs: each unpacked into .venv/megatron-lm-<ref>/ (the archive's own top folder), laid over the
  # megatron-core wheel of its release by tests/torch_megatron/test_megatron_lm_refs.py; again only when the archive
  # changed (its sha256 in the folder's marker).
  MEGATRON_LM_VENDOR=../shared/vendor/megatron-lm
  for archive in "$MEGATRON_LM_VENDOR"/megatron-lm-*.tar.gz; do
    [ -f "$archive" ] || { echo "setup.sh: no Megatron-LM archive in $MEGATRON_LM_VENDOR" >&2; exit 1; }
    side="$VENV/$(basename "$archive" .tar.gz)"
    unpacked="$(sha256sum < "$archive" | cut -d' ' -f1)"
    if [ "$(cat "$side/.unpacked" 2>/dev/null)" != "$unpacked" ]; then
      rm -rf "$side"
      tar -xzf "$archive" -C "$VENV"  # one folder, megatron-lm-<ref>/, the archive's name without .tar.gz
      [ -d "$side" ] || { echo "setup.sh: $archive did not unpack into $side" >&2; exit 1; }
      echo "$unpacked" > "$side/.unpacked"
      echo "unpacked $(basename "$archive") into $side"
    fi
  done
}
# The real MindCluster TaskD (its Python package and libtaskd.so), built offline from the vendored source
# beside the repository; rebuilt only when that tarball or its build script changes. Never on sys.path:
# under FT_PLUGINS=auto an importable taskd switches the taskd feature on everywhere, so only the tests
# that want the real TaskD put $REAL_TASKD/pythonpath's directory on PYTHONPATH.
TASKD_VENDOR="${FT_PLUGINS_TASKD_VENDOR:-../shared/vendor/taskd}"
REAL_TASKD="$VENV/taskd"
if [ ! -f "$TASKD_VENDOR/build.sh" ]; then
  echo "setup.sh: $TASKD_VENDOR/build.sh is missing (the vendored TaskD; set FT_PLUGINS_TASKD_VENDOR to its directory)" >&2
  exit 1
fi
taskd_want="$(cat "$TASKD_VENDOR/build.sh" "$TASKD_VENDOR"/mind-cluster-taskd-*-vendored.tar.gz | sha256sum | cut -d' ' -f1)"
real_taskd() {
  local started
  if [ "$(cat "$REAL_TASKD/.built" 2>/dev/null)" != "$taskd_want" ]; then
    started=$SECONDS
    rm -rf "$REAL_TASKD"
    bash "$TASKD_VENDOR/build.sh" "$REAL_TASKD" "$VENV/bin/python" > "$REAL_TASKD.pythonpath"
    mv "$REAL_TASKD.pythonpath" "$REAL_TASKD/pythonpath"
    rm -rf "$REAL_TASKD/go" "$REAL_TASKD/gocache" "$REAL_TASKD/gopath"  # the toolchain: ~400 MB, not needed once built
    echo "$taskd_want" > "$REAL_TASKD/.built"
    echo "built the real TaskD (libtaskd.so) in $REAL_TASKD: $((SECONDS - started)) s"
  fi
}
pids=()
for part in "${parts[@]}"; do
  ( set -euo pipefail; "$part" ) > "$VENV/setup-$part.log" 2>&1 &
  pids+=($!)
done
failed=()
for i in "${!parts[@]}"; do
  status=0
  wait "${pids[$i]}" || status=$?
  grep -v "^WARNING: Location '" "$VENV/setup-${parts[$i]}.log" || true  # pip's notes on absent local indexes
  if [ "$status" != 0 ]; then failed+=("${parts[$i]}"); fi
done
if [ "${#failed[@]}" != 0 ]; then
  echo "setup.sh: ${failed[*]} failed (the output above; whole in $VENV/setup-<part>.log)" >&2
  exit 1
fi
# Megatron-LM's own pretrain_gpt.py with --mock-data indexes its samples with megatron/core/datasets/helpers_cpp,
# which the wheel holds built for Python 3.12 only: built for this interpreter, once.
helpers="$NEWER_MEGATRON/megatron/core/datasets"
suffix="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
if [ ! -f "$helpers/helpers_cpp$suffix" ]; then
  # shellcheck disable=SC2046  # pybind11's include flags, one word each
  g++ -O1 -shared -std=c++17 -fPIC $("$VENV/bin/python" -m pybind11 --includes) "$helpers/helpers.cpp" \
    -o "$helpers/helpers_cpp$suffix"
  echo "built $helpers/helpers_cpp$suffix"
fi
# ft_plugins itself as users get it: an sdist built from the tree, the wheel built from that sdist, and the
# wheel installed (never editable), so that the tests and the demo run what `pip install` gives; the tests
# refuse to run against the tree itself (tests/conftest.py).
DIST="$VENV/dist"
rm -rf "$DIST" build ./*.egg-info  # an earlier build's file list would feed the sdist
if ! "$VENV/bin/python" -m build --no-isolation --outdir "$DIST" . > "$VENV/build.log" 2>&1; then
  cat "$VENV/build.log" >&2
  echo "setup.sh: building ft_plugins' sdist and wheel failed (above)" >&2
  exit 1
fi
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$DIST"/ft_plugins-*.whl
