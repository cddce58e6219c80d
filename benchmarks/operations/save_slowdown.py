"""Why steps run slower after a checkpoint save on CPU: gloo's threads keep OpenMP teams.

    python benchmarks/operations/save_slowdown.py --group plain                          # a plain gloo group
    OMP_WAIT_POLICY=ACTIVE python benchmarks/operations/save_slowdown.py --group plain   # idle workers spin
    python benchmarks/operations/save_slowdown.py --group side       # the checkpoint manager's `side_group`

One process, a gloo group of 1 rank (a plain `new_group`, or `nsa_titan.distributed.parallel.side_group` as
the checkpoint manager makes it), main-thread intra-op threads as the default job has them. Times a loop of small parallel ops (many short OpenMP regions,
like a training step), then runs the collectives a save runs on that group (an object all-gather,
an all-reduce and a broadcast of a large tensor), then times the loop again. Prints the process's
thread count and both timings: the rise in threads is the OpenMP team that a gloo worker thread
created for its own parallel copy, and keeps (none with `side_group`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nsa_titan.distributed.parallel import side_group  # noqa: E402


def loop(x: torch.Tensor, w: torch.Tensor, n: int = 20000) -> float:
    """Seconds for n small matmul + elementwise steps."""
    start = time.perf_counter()
    for _ in range(n):
        torch.relu(x @ w).mul_(0.5)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", choices=("plain", "side"), default="plain")
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    group = side_group() if args.group == "side" else dist.new_group(backend="gloo")
    x, w = torch.randn(64, 4096), torch.randn(4096, 64)
    loop(x, w, 2000)
    threads, before = len(os.listdir("/proc/self/task")), loop(x, w)
    dist.all_gather_object([None], bytes(8_000_000), group=group)
    t = torch.randn(4_000_000)
    dist.all_reduce(t, group=group)
    dist.broadcast(t, 0, group=group)
    after = loop(x, w)
    print(f"{args.group} group, intra-op threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}: "
          f"threads {threads} -> {len(os.listdir('/proc/self/task'))}; loop {before:.2f} s before the collectives, "
          f"{after:.2f} s after ({after / before:.2f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
