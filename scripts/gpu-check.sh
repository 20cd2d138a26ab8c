#!/usr/bin/env bash
# The prepared GPU check (docs/devices.md), in one call on a machine with one NVIDIA GPU whose
# only network is the package registry:
#   scripts/gpu-check.sh                 # install the CUDA pieces, run the check (<= 8 min),
#                                        # write docs/results/gpu-check.json
#   scripts/gpu-check.sh --dry-run       # here, on the CPU: check the plan, install nothing
#   scripts/gpu-check.sh --device cpu    # every stage on the CPU with a scaled-down model
# Environment: VENV (default .venv), PYTHON (to create it), TORCH_SPEC (default torch==2.13.0:
# PyPI's Linux wheel is the CUDA build), TORCH_INDEX (an extra index for torch, if the registry
# is a PyTorch index), LAMINAR_EXTRAS (default dev,vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
LAMINAR_EXTRAS=${LAMINAR_EXTRAS:-dev,vllm}

on_cpu=0
for arg in "$@"; do
  case "$arg" in --dry-run|cpu|--device=cpu) on_cpu=1 ;; esac
done

if [ "$on_cpu" = 1 ]; then
  # the plan check installs nothing: it runs in the environment that is there
  test -x "$VENV/bin/python" || { echo "gpu-check: no $VENV; run 'make install' first" >&2; exit 2; }
  exec "$VENV/bin/python" -m laminar.bench.gpu_check "$@"
fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU here (nvidia-smi finds none); run 'scripts/gpu-check.sh --dry-run'" \
       "to check the plan on the CPU, or '--device cpu' to run it there" >&2
  exit 2
fi
nvidia-smi -L

t0=$(date +%s)
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  # a CPU torch in the venv is replaced by the CUDA build of the same version
  "${PIP[@]}" --force-reinstall ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$TORCH_SPEC"
fi
"${PIP[@]}" ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} -e ".[${LAMINAR_EXTRAS}]" "$TORCH_SPEC"
"$VENV/bin/python" -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; \
print('gpu-check: torch', torch.__version__, 'on', torch.cuda.get_device_name(0))"
echo "gpu-check: installed in $(( $(date +%s) - t0 )) s"
exec "$VENV/bin/python" -m laminar.bench.gpu_check "$@"
