#!/usr/bin/env bash
# Install what is missing: torch (the CPU build on a machine without NVIDIA GPUs), then this
# package and its dependencies, then build NSA's C++ attention kernel for CPUs (cached; if it cannot
# be built, CPU runs keep the PyTorch kernels). `--test` adds the test tools and the `[hf]` extra
# (transformers, lm-eval), which the tests use. Safe to run again.
#   TORCH_SPEC   torch requirement to install (default: torch==2.13.0 on CPU, torch>=2.13 on GPU: the floor pyproject.toml declares)
#   PIP_ARGS     extra pip arguments (e.g. --index-url https://download.pytorch.org/whl/cpu)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras=""
[[ "${1:-}" == "--test" ]] && extras="[test,hf]"
say() { echo "nsa_titan install: $*"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  torch_spec="${TORCH_SPEC:-torch>=2.13}"
else
  torch_spec="${TORCH_SPEC:-torch==2.13.0}"  # resolves to the CPU build on our CPU machines
fi
if python3 -c 'import torch' >/dev/null 2>&1; then
  say "[1/3] torch $(python3 -c 'import torch; print(torch.__version__)') is installed"
else
  say "[1/3] installing ${torch_spec} (a large download: a few minutes on a fresh machine)"
  python3 -m pip install --progress-bar on ${PIP_ARGS:-} "${torch_spec}" | grep -v -E "^(Requirement already|  )" || true
fi
say "[2/3] installing nsa_titan${extras} and its dependencies"
python3 -m pip install --progress-bar on ${PIP_ARGS:-} -e "${here}${extras}" \
  | grep -v -E "^(Requirement already satisfied|  )" || true
python3 -c "import nsa_titan, torch, torchdata, datasets, sentencepiece, tokenizers, tensorboard${extras:+, pytest, transformers, lm_eval}" \
  || { say "the install did not complete (see pip's messages above)"; exit 1; }
say "[3/3] building NSA's C++ attention kernel for CPUs (about a minute the first time, then cached)"
python3 -c "
import torch
from nsa_titan.models.attention import NSASpec
from nsa_titan.models.attention.families.cpp import cpu_attention
why = cpu_attention.problem(torch.device('cpu'), torch.float32, NSASpec(), 6, 64)
print('nsa_titan install:', why + ': CPU runs keep the PyTorch kernels' if why else 'built')"
say "done"
