#!/usr/bin/env bash
# The first GPU any of us gets, in one command: every GPU-only test, the attention benchmark in bf16
# against flash-attn's causal attention, and M7C training throughput and MFU on one GPU; a markdown
# report at the end (default outputs/gpu_check/report.md). Without CUDA it says so and exits 0.
#   scripts/gpu_check.sh [REPORT]
# Each part runs even when an earlier one fails; the exit code is 1 if any part failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
report="${1:-outputs/gpu_check/report.md}"
mkdir -p "$(dirname "$report")"
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA device on this machine (or torch is not installed): nothing to check"
  exit 0
fi
failed=0
section() { printf '\n## %s\n\n```\n' "$1" >>"$report"; echo "gpu_check: $1"; }
run() {  # run a command into the report; remember a failure
  "$@" 2>&1 | tee -a "$report" | tail -n 3
  local rc=${PIPESTATUS[0]}
  printf '```\n(exit code %s)\n' "$rc" >>"$report"
  [[ $rc -eq 0 ]] || failed=1
}

{
  echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || echo "triton: not installed"
  python3 -c 'import flash_attn; print("flash-attn", flash_attn.__version__)' 2>/dev/null || echo "flash-attn: not installed (pip install -e .[gpu])"
  echo '```'
} >"$report"

section "GPU tests (tests/test_gpu.py: Triton sel and flash-attn window on CUDA, kernel choice, NCCL FSDP, bf16 + compile + AC)"
run python3 -m pytest -q -rs tests/test_gpu.py

section "Attention, bf16, forward + backward, M7C shape: fast NSA vs causal SDPA vs flash-attn causal"
run python3 benchmarks/attention_speed.py --T 8192 16384 32768 65536 --repeats 3 --allocators default \
  --variants fast-core dense-core flash-core fast dense

for seq in 2048 8192; do
  section "M7C training throughput and MFU on one GPU, seq $seq (bf16, AC full, compile)"
  run python3 benchmarks/train_throughput.py --config train_configs/m7c.toml --steps 20 \
    --variants nsa-compiled-ac dense-compiled -- --training.seq_len "$seq" \
    --training.local_batch_size "$((16384 / seq))" --data.path data/python_docs --data.name= \
    --checkpoint.enable false
done

echo "gpu_check: report in $report$([[ $failed -eq 0 ]] || echo ' (some parts failed: see the report)')"
exit $failed
