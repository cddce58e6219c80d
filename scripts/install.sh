#!/usr/bin/env bash
# Install what is missing: torch (the CPU build on a machine without NVIDIA GPUs), then this
# package and its dependencies. `--test` adds the test tools. Safe to run again.
#   TORCH_SPEC   torch requirement to install (default: torch==2.13.0 on CPU, torch>=2.7 on GPU)
#   PIP_ARGS     extra pip arguments (e.g. --index-url https://download.pytorch.org/whl/cpu)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras=""
[[ "${1:-}" == "--test" ]] && extras="[test]"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  torch_spec="${TORCH_SPEC:-torch>=2.7}"
else
  torch_spec="${TORCH_SPEC:-torch==2.13.0}"  # resolves to the CPU build on our CPU machines
fi
if ! python3 -c 'import torch' >/dev/null 2>&1; then
  python3 -m pip install -q ${PIP_ARGS:-} "${torch_spec}"
fi
python3 -m pip install -q ${PIP_ARGS:-} -e "${here}${extras}"
