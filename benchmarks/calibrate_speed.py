"""How long calibrating one plan row takes against a large run history, with BLAS on one thread
(what :func:`sftctl.history._one_blas_thread` does for solves of 64 runs or more) against
OpenBLAS' own threads (the peer: numpy as installed), measured in turns in the same process.

A history of ``--runs`` runs (random kernel mixes, half H100, half A100-80GB, log-normal
residuals) and 20 new steps; each turn calibrates the 20 on H100 both ways. Prints the median
milliseconds per calibration and the ratio, with the machine's load average (the threads' cost
grows with it), and writes benchmarks/results/calibrate_speed.json.

    python benchmarks/calibrate_speed.py [--runs 5000] [--turns 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sftctl import history  # noqa: E402
from sftctl.types import RunRecord  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "calibrate_speed.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5000)
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args(argv)
    rng = random.Random(0)

    def mix() -> dict:
        w = [rng.random() for _ in history.MIX_KEYS]
        return {k: x / sum(w) for k, x in zip(history.MIX_KEYS, w)}

    runs = [RunRecord(accelerator=rng.choice(["H100", "A100-80GB"]), gpus_per_node=8, nodes=1, predicted_step_s=1.0,
                      measured_step_s=math.exp(rng.gauss(0, 0.2)), source="imported", ts=float(i), features=mix(),
                      mode="eager") for i in range(args.runs)]
    steps = [mix() for _ in range(20)]
    prepared = history.Prepared(runs)  # as the planner does, once per plan

    def per_call_ms() -> float:
        t0 = time.perf_counter()
        for f in steps:
            history.calibrate(1.0, "H100", prepared, features=f, mode="eager")
        return (time.perf_counter() - t0) / len(steps) * 1e3

    default = history.BLAS_SINGLE_THREAD_FROM
    per_call_ms()  # warm: the controller, numpy's first solve
    times: dict[str, list[float]] = {"one_thread": [], "blas_threads": []}
    try:
        for _ in range(args.turns):
            history.BLAS_SINGLE_THREAD_FROM = default
            times["one_thread"].append(per_call_ms())
            history.BLAS_SINGLE_THREAD_FROM = 10 ** 9
            times["blas_threads"].append(per_call_ms())
    finally:
        history.BLAS_SINGLE_THREAD_FROM = default
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["blas_threads"] / med["one_thread"]
    load = os.getloadavg()
    print(f"calibrate one plan row, {args.runs} runs in the history ({min(args.runs, history.MAX_RUNS)} solved), "
          f"median of {args.turns} turns, load average {load[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'BLAS on one thread (sftctl)':32s} {med['one_thread']:8.1f} ms")
    print(f"{'OpenBLAS threads (numpy as is)':32s} {med['blas_threads']:8.1f} ms")
    print(f"ratio (threads / one thread): {ratio:.2f}x")
    RESULTS.write_text(json.dumps({"runs": args.runs, "turns": args.turns, "ms_per_calibration": times,
                                   "median_ms": med, "ratio_threads_over_one": ratio, "load_average": load,
                                   "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                  indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
