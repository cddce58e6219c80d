"""What step-timeout detection and the heartbeat cost per step.

    python benchmarks/operations/fault_overhead.py [--calls 20000] [--steps 60]

1. The per-step work they add, timed alone: two `StepWatchdog.beat()` calls (each re-arms
   faulthandler's backstop) and one `Heartbeat.write()` (a JSON line, flushed).
2. The default training run side by side with the heartbeat on and off (the watchdog is
   always on): median tokens/s over the log intervals after warm-up.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.config import Fault  # noqa: E402
from nsa_titan.runtime.watchdog import Heartbeat, StepWatchdog  # noqa: E402


def per_call_us(calls: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as dump:
        hb = Heartbeat(Path(dump) / "heartbeat", 0)
        wd = StepWatchdog(Fault(), Path(dump) / "fault", 0, hb)
        start = time.perf_counter()
        for i in range(calls):
            wd.beat(i, "the training step", first_step_done=True)
        beat = (time.perf_counter() - start) / calls * 1e6
        start = time.perf_counter()
        for i in range(calls):
            hb.write(step=i, loss=1.0, grad_norm=1.0, step_time_s=0.3, tokens_per_s=1000, memory_gib=1.0,
                     data_wait_s=0.001, skipped=False)
        write = (time.perf_counter() - start) / calls * 1e6
        wd.stop()
        hb.close()
    return beat, write


def run_tokens_per_s(steps: int, heartbeat: bool) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as dump:
        out = subprocess.run([str(ROOT / "run_train.sh"), "--training.steps", str(steps), "--metrics.log_freq", "10",
                              "--validation.enable", "false", "--eval.enable", "false", "--metrics.enable_tensorboard", "false",
                              "--fault.heartbeat", str(heartbeat).lower(), "--job.dump_folder", dump],
                             capture_output=True, text=True, check=True).stdout
    tps = statistics.median(float(x.replace(",", "")) for x in re.findall(r"tok/s ([\d,]+)", out)[2:])
    return tps, 8 * 256 / tps  # (tokens/s, seconds per step of 8 x 256 tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    beat, write = per_call_us(args.calls)
    on, step_s = run_tokens_per_s(args.steps, True)
    off, _ = run_tokens_per_s(args.steps, False)
    added = 2 * beat + write
    print(f"watchdog beat: {beat:.1f} us per call; heartbeat write: {write:.1f} us per call")
    print(f"added per step: {added:.1f} us = {added / (step_s * 1e6) * 100:.4f}% of the default run's "
          f"{step_s * 1e3:.0f} ms step")
    print("| default run (1 CPU rank) | tokens/s, median |")
    print("|---|---|")
    print(f"| heartbeat on | {on:,.0f} |")
    print(f"| heartbeat off | {off:,.0f} |")
    print(f"on / off: {on / off:.3f}")


if __name__ == "__main__":
    main()
