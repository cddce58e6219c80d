#!/usr/bin/env bash
# The first GPU any of us gets, in one command: every GPU-only test, the attention benchmark in bf16
# against the fastest dense kernels (benchmarks/gpu/gpu_attention.py, with where NSA's time goes at 32k),
# and M7C training throughput and MFU on one GPU at seq 8k and 32k; a markdown report at the end
# (default outputs/gpu_check/report.md). Without CUDA it says so and exits 0. Not yet timed whole on
# one H100 (the tests took 1.7 minutes, the attention about 1.5); PARTS="tests attention", then
# PARTS="train", splits it.
#   scripts/gpu_check.sh [REPORT]
#   PARTS="tests attention" scripts/gpu_check.sh REPORT   # some of the parts: tests, attention, train
#                                                        # (each appends to REPORT)
# Each part runs even when an earlier one fails; the exit code is 1 if any part failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
report="${1:-outputs/gpu_check/report.md}"
mkdir -p "$(dirname "$report")"
if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA device on this machine (or torch is not installed): nothing to check"
  exit 0
fi
parts="${PARTS:-tests attention train}"
want() { [[ " $parts " == *" $1 "* ]]; }
failed=0
section() { printf '\n## %s\n\n```\n' "$1" >>"$report"; echo "gpu_check: $1"; }
run() {  # run a command into the report; remember a failure
  "$@" 2>&1 | tee -a "$report" | tail -n 3
  local rc=${PIPESTATUS[0]}
  printf '```\n(exit code %s)\n' "$rc" >>"$report"
  [[ $rc -eq 0 ]] || failed=1
}

[[ -s "$report" && "$parts" != "tests attention train" ]] || {
  echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || echo "triton: not installed"
  python3 -c 'import flash_attn; print("flash-attn", flash_attn.__version__)' 2>/dev/null || echo "flash-attn: not installed (pip install -e .[gpu])"
  for m in torchdata datasets tomli sentencepiece tensorboard pytest; do
    python3 -c "import $m" 2>/dev/null || echo "$m: not installed (scripts/install.sh --test): the parts that need it fail"
  done
  echo '```'
} >"$report"
echo "gpu_check: parts: $parts" | tee -a "$report"

if want tests; then
  section "GPU tests (tests/test_gpu.py: Triton sel and flash-attn window on CUDA, kernel choice, NCCL FSDP, bf16 + compile + AC)"
  run python3 -m pytest -q -rs --durations 5 tests/test_gpu.py
fi

if want attention; then
  section "Attention, bf16, M7C shape: NSA vs SDPA's flash and cuDNN kernels (and flash-attn), forward and backward apart, with documents; where NSA's time goes at 32k"
  run python3 benchmarks/gpu/gpu_attention.py --T 8192 32768 65536 --profile 32768
fi

if want train; then
  # seq 8k and 32k, otherwise as m7c.toml ships: bf16, compile, AC full, document masking on (dense
  # SDPA then takes a T x T mask)
  for seq in 8192 32768; do
    section "M7C training throughput and MFU on one GPU, seq $seq (bf16, compile, AC full, document masking as m7c.toml)"
    run python3 benchmarks/training/train_throughput.py --config train_configs/m7c.toml --steps 20 \
      --variants nsa-compiled-ac dense-compiled-ac -- --training.seq_len "$seq" \
      --training.local_batch_size "$(( seq < 16384 ? 16384 / seq : 1 ))" --data.path data/python_docs --data.name= \
      --data.tokenizer sentencepiece --data.tokenizer_path data/python_docs/tokenizer.model --validation.enable false --eval.enable false \
      --checkpoint.enable false
  done
fi

echo "gpu_check: report in $report$([[ $failed -eq 0 ]] || echo ' (some parts failed: see the report)')"
exit $failed
