"""Preflight (issue 41): what it costs a node and how slow a node must be to be caught.

1. Cost: ``python -m sftctl.preflight`` at ``quick`` on one CPU node of this machine (the
   process's wall time, torch's import included), ``--repeat`` times.
2. Noise: the healthy CPU matmul against this machine's reference (:func:`sftctl.preflight.reference`),
   as a fraction of it, ``--repeat`` times: how far a healthy node lands from 1.0.
3. Detection: the same matmul made ``factor`` x slower (``SFTCTL_PREFLIGHT_SLOW_FACTOR``: really
   that many matmuls) for factors 1.25 .. 8, each judged with the default
   ``health.preflight_min_fraction`` (0.6): the smallest slowdown caught every time.

4. Cost on two nodes: two ``python -m sftctl.preflight`` processes of one local two-node job
   (matmul, then the gloo all-reduce and each node's sends), the pair's wall time: what a healthy
   local run pays before its first step.
5. The all-reduce (two local gloo processes, 4 MiB): healthy rounds against this machine's
   loopback reference (:func:`sftctl.preflight.reference_collective`), then node 1's sends
   capped at ``CAPS`` GB/s (``SFTCTL_PREFLIGHT_SLOW_NET_GBPS``' mechanism), each judged as the
   node judges it: the all-reduce below the threshold and node 1 blamed
   (:func:`sftctl.health.detectors.preflight.blame`). Healthy rounds must blame no one.

On a GPU (``--gpu``) parts 2-3 time the 8192^3 bfloat16 GEMM against the compiler's prediction
for ``--accelerator`` instead (``sftctl.controller.preflight.gpu_gemm_s``).

Prints a table and writes benchmarks/results/preflight.json.

    python benchmarks/preflight.py [--repeat 5]
    python benchmarks/preflight.py --gpu --accelerator H100 [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sftctl import preflight  # noqa: E402
from sftctl.health.detectors.preflight import MIN_FRACTION, blame  # noqa: E402

FACTORS = (1.0, 1.25, 1.5, 1.67, 2.0, 3.0, 8.0)
#: node 1's send caps (GB/s) of part 5; None is healthy
CAPS = (None, 2.0, 1.0, 0.5, 0.25, 0.1, 0.05)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cost_two_nodes(repeat: int) -> list[float]:
    """Wall seconds of a two-node local preflight (both processes, started together)."""
    out = []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(repeat):
            port = free_port()
            procs = []
            t0 = time.perf_counter()
            for rank in (0, 1):
                node = Path(d) / f"node{rank}"
                node.mkdir(exist_ok=True)
                env = {**os.environ, "SFTCTL_NODE_DIR": str(node), "SFTCTL_PREFLIGHT": "quick",
                       "SFTCTL_PREFLIGHT_REFERENCE": "cpu", "SFTCTL_PREFLIGHT_GEMM_S": "1.0",
                       "SFTCTL_NUM_NODES": "2", "SFTCTL_NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
                procs.append(subprocess.Popen([sys.executable, "-m", "sftctl.preflight"], env=env, cwd=REPO,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            if any(p.wait(timeout=600) for p in procs):
                raise SystemExit("a two-node preflight failed")
            out.append(time.perf_counter() - t0)
    return out


def collective_rounds(repeat: int) -> list[dict]:
    """Part 5: both ranks in child processes (this script with ``--collective-rank``), every
    round on its own port; rank 0's results."""
    plan = [cap for cap in CAPS for _ in range(repeat)]
    base = free_port()
    argv = [sys.executable, __file__, "--collective-plan", json.dumps(plan), "--port", str(base)]
    peer = subprocess.Popen([*argv, "--collective-rank", "1"], stdout=subprocess.DEVNULL)
    out = subprocess.run([*argv, "--collective-rank", "0"], capture_output=True, text=True, check=True).stdout
    peer.wait(timeout=600)
    return json.loads(out)


def collective_child(rank: int, plan: list, base: int) -> None:
    results = []
    for i, cap in enumerate(plan):
        r = preflight.measure_collective(rank, 2, "127.0.0.1", base + 1 + i, cap_gbps=cap if rank == 1 else None)
        results.append({"cap_gbps": cap, **r})
    if rank == 0:
        print(json.dumps(results))


def cost(repeat: int) -> list[float]:
    out = []
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "SFTCTL_NODE_DIR": d, "SFTCTL_PREFLIGHT": "quick", "SFTCTL_PREFLIGHT_REFERENCE": "cpu",
               "SFTCTL_PREFLIGHT_GEMM_S": "1.0", "SFTCTL_NUM_NODES": "1", "OMP_NUM_THREADS": "1"}
        for _ in range(repeat):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "sftctl.preflight"], env=env, cwd=REPO, check=True,
                           capture_output=True)
            out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--accelerator", default="H100")
    ap.add_argument("--collective-rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--collective-plan", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.collective_rank is not None:
        collective_child(args.collective_rank, json.loads(args.collective_plan), args.port)
        return 0
    threshold = MIN_FRACTION.default
    if args.gpu:
        from sftctl.controller.preflight import gpu_gemm_s

        device, reference_s, source = "cuda:0", gpu_gemm_s(args.accelerator), f"compiler ({args.accelerator})"
    else:
        device, reference_s, source = "cpu", preflight.reference()["measured_s"], "this machine's CPU reference"
    per, batches = preflight.BATCHES["quick"]
    healthy = [reference_s / preflight.time_matmul(device, None, per, batches) for _ in range(args.repeat)]
    detection = {}
    for f in FACTORS[1:]:
        fr = [reference_s / preflight.time_matmul(device, None, per, batches, f) for _ in range(args.repeat)]
        detection[f] = {"fractions": fr, "caught": sum(x < threshold for x in fr)}
    costs = cost(args.repeat) if not args.gpu else []
    costs2 = cost_two_nodes(args.repeat) if not args.gpu else []
    coll: dict = {}
    if not args.gpu:
        bus_ref = preflight.reference_collective()["bus_gbps"]
        rounds = collective_rounds(args.repeat)
        for cap in CAPS:
            rs = [r for r in rounds if r["cap_gbps"] == cap]
            fr = [r["bus_gbps"] / bus_ref for r in rs]
            blamed = [blame(r["send_gbps"], bus_ref, threshold) if r["bus_gbps"] < threshold * bus_ref else None
                      for r in rs]
            coll[str(cap)] = {"bus_fraction": fr, "send_gbps": [r["send_gbps"] for r in rs], "blamed": blamed,
                              "caught": blamed.count(1), "wrong": sum(b not in (None, 1) for b in blamed)}
    caught = [f for f, d in detection.items() if d["caught"] == args.repeat]
    doc = {
        "machine": platform.node(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(), "device": device,
        "reference": source, "reference_s": reference_s, "threshold": threshold, "repeat": args.repeat,
        "quick_wall_s": costs, "healthy_fraction": healthy,
        "detection": {str(f): d for f, d in detection.items()},
        "smallest_slowdown_always_caught": min(caught) if caught else None,
        "false_verdicts": sum(x < threshold for x in healthy),
        "quick_two_nodes_wall_s": costs2,
        "allreduce": coll,
    }
    if coll:
        doc["allreduce_reference_bus_gbps"] = bus_ref
        doc["allreduce_false_verdicts"] = coll["None"]["caught"] + sum(c["wrong"] for c in coll.values())
        always = [c for c in CAPS[1:] if coll[str(c)]["caught"] == args.repeat]
        doc["largest_send_cap_always_caught_gbps"] = max(always) if always else None
    print(f"reference: {source}, {reference_s * 1e3:.3f} ms per matmul; threshold {threshold:g}")
    if costs:
        print(f"quick preflight, one CPU node: {statistics.median(costs):.2f} s median wall "
              f"({min(costs):.2f}-{max(costs):.2f}), torch's import included")
    print(f"healthy: {min(healthy):.2f}-{max(healthy):.2f} of the reference ({doc['false_verdicts']} false verdicts)")
    for f, d in detection.items():
        print(f"  {f:>5g}x slower: {min(d['fractions']):.2f}-{max(d['fractions']):.2f}, caught {d['caught']}/{args.repeat}")
    print(f"smallest slowdown caught every time: {doc['smallest_slowdown_always_caught']}x")
    if costs2:
        print(f"quick preflight, two CPU nodes with the all-reduce: {statistics.median(costs2):.2f} s median wall "
              f"({min(costs2):.2f}-{max(costs2):.2f})")
    if coll:
        print(f"all-reduce: this machine's loopback reference {bus_ref:.3f} GB/s bus")
        for cap, c in coll.items():
            sends = "; ".join("/".join(f"{g:.2f}" for g in s) for s in c["send_gbps"])
            print(f"  node 1 sends capped at {cap:>5} GB/s: bus {min(c['bus_fraction']):.2f}-"
                  f"{max(c['bus_fraction']):.2f} of the reference, node 1 blamed {c['caught']}/{args.repeat}, "
                  f"another blamed {c['wrong']} (sends by node: {sends})")
        print(f"false all-reduce verdicts: {doc['allreduce_false_verdicts']}; largest cap caught every time: "
              f"{doc['largest_send_cap_always_caught_gbps']} GB/s")
    out = REPO / "benchmarks" / "results" / ("preflight-gpu.json" if args.gpu else "preflight.json")
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
