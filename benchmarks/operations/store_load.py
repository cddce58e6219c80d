"""The failure signal's load on the job's store at 1,024 and 4,096 ranks: polling once a second (the design before
`runtime/failure_channel.py`) against one wait on a key (that module's), side by side in one run.

    python benchmarks/operations/store_load.py [--ranks 1024 4096] [--window 10] [--processes 8]

One `TCPStore` server in a process of its own on loopback, as a launcher hosts it; `--ranks` simulated ranks, each
a thread with a connection of its own, spread over `--processes` processes. `poll`: each rank calls `check` on the
failure key once a second (phases spread over the second). `wait`: each rank blocks in one `wait` on the key (the
failure channel's listener). For `--window` seconds nothing fails; the store's requests a second are counted at
the ranks, and a probe connection times a rank's own store call (`add`, as a barrier or an announcement makes)
every 10 ms. Then the key is set, as a failing rank announces, and each rank notes when it learnt of it.

Figures are this machine's: the server, the ranks and the probe share its cores, as one host's launcher, its
ranks' store clients and a busy node's network do not; the ratio between the designs is the measure.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's warning of each of thousands of connections
# c10d looks up the name of each connection's address; where no name server answers (a sandbox), each lookup
# waits out the resolver's 5 s timeout, in bursts, and connecting thousands of ranks takes many minutes.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

import torch.distributed as dist  # noqa: E402

from nsa_titan.runtime.failure_channel import WAIT_S  # noqa: E402

KEY = "nsa_titan/failure/attempt0"
CONNECT_S = 120.0


def serve(port_out: mp.connection.Connection, stop: mp.synchronize.Event) -> None:
    """The job's store, as a launcher hosts it."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    port_out.send(store.port)
    stop.wait()


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=CONNECT_S))


def ranks(port: int, count: int, mode: str, ready: mp.synchronize.Barrier, report: mp.Queue) -> None:
    """`count` simulated ranks in threads; reports (requests in the quiet window, seconds to learn of the failure)
    of each."""
    threading.stack_size(256 * 1024)
    stores: list[dist.TCPStore] = [None] * count  # type: ignore[list-item]

    def connect(i: int) -> None:
        stores[i] = client(port)

    connecting = [threading.Thread(target=connect, args=(i,)) for i in range(count)]
    for t in connecting:
        t.start()
    for t in connecting:
        t.join()
    results: list[tuple[int, float]] = []
    lock = threading.Lock()
    start_at: list[float] = []

    def poll(store: dist.TCPStore, phase: float) -> None:
        calls, next_call = 0, start_at[0] + phase
        while True:
            time.sleep(max(0.0, next_call - time.time()))
            next_call += 1.0
            calls += 1
            if store.check([KEY]):
                failed_at = float(store.get(KEY))
                learnt = time.time() - failed_at
                quiet = calls - 1  # every call before the one that found the key fell in the quiet window
                break
        with lock:
            results.append((quiet, learnt))

    def wait(store: dist.TCPStore) -> None:
        calls = 0
        while True:
            calls += 1
            try:
                store.wait([KEY], timedelta(seconds=WAIT_S))
                break
            except dist.DistStoreError:
                continue
        learnt = time.time() - float(store.get(KEY))
        with lock:
            results.append((calls - 1, learnt))  # the first wait was issued before the window

    threads = [threading.Thread(target=poll, args=(s, i / count)) if mode == "poll" else
               threading.Thread(target=wait, args=(s,)) for i, s in enumerate(stores)]
    if mode == "wait":  # the listeners wait from the rank's start-up on
        for t in threads:
            t.start()
    ready.wait()  # every process connected
    ready.wait()  # the window starts
    start_at.append(time.time())
    if mode == "poll":
        for t in threads:
            t.start()
    for t in threads:
        t.join()
    report.put(results)


def measure(total: int, mode: str, window: float, processes: int) -> dict[str, float]:
    ctx = mp.get_context("fork")
    stop, (port_in, port_out) = ctx.Event(), ctx.Pipe(duplex=False)
    server = ctx.Process(target=serve, args=(port_out, stop), daemon=True)
    server.start()
    port = port_in.recv()
    ready, report = ctx.Barrier(processes + 1), ctx.Queue()
    workers = [ctx.Process(target=ranks, args=(port, total // processes + (i < total % processes), mode, ready, report),
                           daemon=True) for i in range(processes)]
    for w in workers:
        w.start()
    ready.wait(timeout=CONNECT_S * 2)
    probe = client(port)
    ready.wait()
    began, latencies = time.time(), []
    while time.time() - began < window:
        t = time.perf_counter()
        probe.add("probe", 1)
        latencies.append(time.perf_counter() - t)
        time.sleep(0.01)
    probe.set(KEY, repr(time.time()))  # a rank announces its failure
    results = [r for _ in workers for r in report.get(timeout=CONNECT_S)]
    for w in workers:
        w.join(timeout=30)
    stop.set()
    server.join(timeout=10)
    latencies.sort()
    learnt = sorted(r[1] for r in results)
    return {"requests_per_s": sum(r[0] for r in results) / window,
            "call_p50_ms": 1e3 * statistics.median(latencies), "call_p99_ms": 1e3 * latencies[int(0.99 * len(latencies))],
            "learnt_p50_s": statistics.median(learnt), "learnt_max_s": learnt[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--window", type=float, default=10.0, help="seconds with nothing failing")
    parser.add_argument("--processes", type=int, default=8, help="processes the simulated ranks' threads run in")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; quiet window {args.window:g} s; a listener's wait is re-issued every {WAIT_S:g} s")
    print("| ranks | design | store requests/s, nothing failing | a rank's store call p50 / p99 (ms) | "
          "time to tell the ranks, p50 / max (s) |")
    print("|---|---|---|---|---|")
    for total in args.ranks:
        for mode in ("poll", "wait"):
            r = measure(total, mode, args.window, args.processes)
            print(f"| {total} | {'poll once a second (before)' if mode == 'poll' else 'wait on the key (now)'} | "
                  f"{r['requests_per_s']:.1f} | {r['call_p50_ms']:.2f} / {r['call_p99_ms']:.2f} | "
                  f"{r['learnt_p50_s']:.3f} / {r['learnt_max_s']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
