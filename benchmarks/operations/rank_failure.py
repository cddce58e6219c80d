"""How fast one rank's failure ends the job, and how fast MAX_RESTARTS brings it back.

    python benchmarks/operations/rank_failure.py [--rounds 1]

The shipped settings: 2 gloo ranks, 2 loader workers per rank, async saves every 4 steps, the debug
model (smaller, as the tests run it). Each fault hits one rank after step 8, while the save of step 8
may still be in flight: its data-loader worker killed with SIGKILL (as the kernel's out-of-memory
killer does), a corrupt document in its data (`[debug] fault_raise_where = "data"`), an out-of-memory
error in its forward (`forward`), its heartbeat write finding the disk full (`write`). For each, the
time from the fault (the kill, or the injection's line) to the rank's first error line and to the
job's exit without restarts, and to the first step after the restart with MAX_RESTARTS=1.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nsa_titan.launch import child_pids  # noqa: E402

SMALL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.head_dim", "16",
         "--training.seq_len", "128", "--training.local_batch_size", "4", "--training.steps", "40",
         "--metrics.log_freq", "1", "--validation.enable", "false", "--eval.enable", "false", "--data.shuffle_buffer", "64",
         "--data.num_workers", "2", "--checkpoint.async_mode", "async", "--checkpoint.interval", "4"]
FAULTS = {"loader worker killed (rank 0)": None, "corrupt data (rank 1)": ("data", 1),
          "out of memory (rank 0)": ("forward", 0), "failed write (rank 1)": ("write", 1)}


def rank_pid(launcher: int, rank: int) -> int:
    return next(p for p in child_pids(launcher) if f"\0RANK={rank}\0".encode() in b"\0" + Path(f"/proc/{p}/environ").read_bytes())


def run(fault: tuple[str, int] | None, restarts: int) -> dict[str, float]:
    """One job: seconds from the fault to the first error line, the exit, and (restarts) the next step."""
    with tempfile.TemporaryDirectory() as work:
        keys = [] if fault is None else ["--debug.fault_raise_where", fault[0], "--debug.fault_raise_rank",
                                          str(fault[1]), "--debug.fault_raise_step", "9"]
        proc = subprocess.Popen([str(ROOT / "run_train.sh"), *SMALL, *keys, "--job.dump_folder", f"{work}/out"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env={**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1", "MAX_RESTARTS": str(restarts)})
        at, times, resumed = None, {}, None
        for line in proc.stdout:
            now = time.monotonic()
            if at is None and fault is None and re.search(r"step +8/40 ", line):
                os.kill(child_pids(rank_pid(proc.pid, 0))[0], signal.SIGKILL)
                at = time.monotonic()
            if at is None and "fault injection: " in line:
                at = now
            if at is not None and "first_error" not in times and re.search(r" ERROR rank \d failed", line):
                times["first_error"] = now - at
            if m := re.search(r"restart 1 of 1 .* at step (\d+)", line):
                resumed = int(m.group(1))
            if resumed is not None and "restart" not in times and re.search(rf"step +{resumed + 1}/40 ", line):
                times["restart"] = now - at
        proc.wait()
        times["exit"] = time.monotonic() - at
        expected = 0 if restarts else 1
        if proc.returncode != expected:
            raise SystemExit(f"the job exited {proc.returncode}, not {expected}")
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each fault and mode (the median is shown)")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), platform.machine())
    print(f"# {cpu}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, commit {commit.strip()}, "
          f"{args.rounds} round(s)")
    print("| fault | to its error line | to the job's exit (no restarts) | to the restart's first step |")
    print("|---|---|---|---|")
    for name, fault in FAULTS.items():
        plain = [run(fault, 0) for _ in range(args.rounds)]
        restarted = [run(fault, 1) for _ in range(args.rounds)]
        med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
        print(f"| {name} | {med(plain, 'first_error'):.1f} s | {med(plain, 'exit'):.1f} s | "
              f"{med(restarted, 'restart'):.1f} s |", flush=True)


if __name__ == "__main__":
    main()
