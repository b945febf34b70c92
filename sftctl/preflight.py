"""The node's active check (issue 41): ``python -m sftctl.preflight``, before an attempt's run.

The node script (``templates/node.sh.j2``) runs it before the training when the controller set
``SFTCTL_PREFLIGHT`` (the spec's ``health.preflight``: ``quick`` or ``full``). In order:

1. a matmul on every device of the node (each GPU, else the CPU on one thread), timed best of
   several batches (a batch that another process interrupted never makes a node slow), against
   ``SFTCTL_PREFLIGHT_GEMM_S``: the compiler's predicted GEMM time for this node's accelerator,
   or, on a CPU node, the same matmul measured on the controller's machine (:func:`reference`);
2. on a GPU node, NVML's state of each GPU (nvidia-ml-py): ECC mode (current vs pending),
   persistence mode, the PCIe link width vs its maximum, NVLink links down, SM clock limits;
3. ``dcgmi diag -r SFTCTL_PREFLIGHT_DCGM_LEVEL -j`` where ``dcgmi`` is installed (level 2 for a
   job predicted longer than ``health.preflight_long_job_h``);
4. an all-reduce across the job's nodes (one process per node: NCCL on GPU 0, gloo on the CPU;
   the rendezvous at ``MASTER_ADDR:MASTER_PORT``, the job's own port, before torchrun takes it),
   its bus bandwidth against ``SFTCTL_PREFLIGHT_BUS_GBPS`` where given, then each node's sends
   to the next node (timed by the receiver), which name the node that slows the collective: every
   node of an all-reduce measures the same time, a node's own sends tell them apart
   (:func:`sftctl.health.detectors.preflight.blame`). The blamed node gets the verdict; the others
   wait for the controller to replace it rather than start training.

It appends one record ``{"ts": ..., "preflight": {...}}`` (the format is
:mod:`sftctl.health.detectors.preflight`'s) to the node's ``health.jsonl``, where the controller
reads it with the agent's samples, and judges it with the detector's :func:`judge`. A verdict
(``preflight_slow``, ``preflight_failed``) is written as the attempt's failure record and the
node exits :data:`EXIT_VERDICT` before the all-reduce and before the training, so the
controller replaces the node (with its machine quarantined) before the job's first step.

:func:`at_checkpoint` is the periodic check of a long job (``SFTCTL_PREFLIGHT_PERIODIC``): the
matmul alone, from the training process right after a checkpoint, into the same file; a slow
one is the detector's verdict at the controller, which replaces the node and resumes from that
checkpoint.

A CPU node is timed by its thread's CPU time, not the wall clock: local nodes share this
machine's cores with everything else on it, and a busy machine is no slow node (a slower or
throttled core is).

Fault injection (tests): ``SFTCTL_PREFLIGHT_SLOW_RANK`` makes that node rank's first node
(``SFTCTL_NODE_GENERATION`` 0) run ``SFTCTL_PREFLIGHT_SLOW_FACTOR`` times the matmuls in each
timed batch: what a device that much slower looks like from outside.
``SFTCTL_PREFLIGHT_SLOW_NET_RANK`` makes that rank's first node a throttled NIC: before each
all-reduce and each send it waits the time its bytes take at ``SFTCTL_PREFLIGHT_SLOW_NET_GBPS``
(the ring all-reduce's ``2(n-1)/n`` x bytes), so the collective waits for it as for a slow link.
Their figures are measured, never written in.

torch is imported inside the functions; ``sftctl status`` never imports this module.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from sftctl import protocol, settings
from sftctl.failure import write_record
from sftctl.procs import module_argv
from sftctl.health.detectors.preflight import blame, judge, slow_allreduce
from sftctl.types import FailureCode, FailureReason

#: the GEMM every GPU node times: (m, n, k, dtype); ~1.1 TFLOP, about 2 ms on an H100
GPU_GEMM = (8192, 8192, 8192, "bfloat16")
#: the GEMM a CPU node times, on one thread: ~0.11 GFLOP, a few ms on a current core
CPU_GEMM = (384, 384, 384, "float32")
#: matmuls per timed batch and batches (best of), per level
BATCHES = {"quick": (8, 5), "full": (40, 10)}
#: bytes of the all-reduce, per device kind
ALLREDUCE_BYTES = {"cuda": 64 << 20, "cpu": 4 << 20}
#: the exit code of a node whose preflight gave a verdict (the failure record says which)
EXIT_VERDICT = 86
#: seconds the all-reduce waits for the other nodes
RENDEZVOUS_TIMEOUT_S = 120.0
#: timed repetitions of the all-reduce and of each node's send (best of)
COLLECTIVE_REPS = 5
#: seconds ``dcgmi diag`` may run (level 1 takes seconds, level 2 about two minutes)
DCGM_TIMEOUT_S = {1: 120.0, 2: 600.0, 3: 1800.0}


def _slow_factor(environ=None) -> float:
    """The fault-injection factor of this node (1.0 unless it is the named rank's first node)."""
    rank = settings.get("SFTCTL_PREFLIGHT_SLOW_RANK", environ)
    if rank is None or rank != settings.get("SFTCTL_NODE_RANK", environ):
        return 1.0
    if settings.get("SFTCTL_NODE_GENERATION", environ) != 0:
        return 1.0  # the replacement of a slow node is healthy
    return float(settings.get("SFTCTL_PREFLIGHT_SLOW_FACTOR", environ))


def _slow_net_gbps(environ=None) -> float | None:
    """The injected send rate cap of this node (GB/s), None unless it is the named rank's first node."""
    rank = settings.get("SFTCTL_PREFLIGHT_SLOW_NET_RANK", environ)
    if rank is None or rank != settings.get("SFTCTL_NODE_RANK", environ):
        return None
    if settings.get("SFTCTL_NODE_GENERATION", environ) != 0:
        return None
    return float(settings.get("SFTCTL_PREFLIGHT_SLOW_NET_GBPS", environ)) or None


def time_matmul(device: str, shape=None, per_batch: int = 8, batches: int = 5, slow_factor: float = 1.0) -> float:
    """Seconds of one ``m x k @ k x n`` matmul on ``device`` (``cpu`` or ``cuda:N``): the best
    batch of ``per_batch`` matmuls (after one warm-up batch), divided by ``per_batch``. On a GPU,
    wall seconds around a synchronize; on the CPU, this thread's CPU seconds (torch on one
    thread), which other processes on the same cores do not inflate. ``slow_factor`` > 1 runs
    that many times the matmuls in each batch (fault injection: the work is real)."""
    import torch

    m, n, k, dtype = shape or (CPU_GEMM if device == "cpu" else GPU_GEMM)
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        return _time(torch, device, m, n, k, getattr(torch, dtype), per_batch, batches, slow_factor)
    finally:
        torch.set_num_threads(threads)  # a training process that checks at a checkpoint keeps its own


def _time(torch, device: str, m: int, n: int, k: int, dt, per_batch: int, batches: int, slow_factor: float) -> float:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, generator=gen).to(dt)
    b = torch.randn(k, n, device=device, generator=gen).to(dt)
    cuda = device.startswith("cuda")
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    # a GPU is timed by the wall clock around a synchronize; the CPU by this thread's CPU time,
    # so that other processes sharing the machine's cores never make a node slow (a slower core does)
    clock = time.perf_counter if cuda else time.thread_time
    work = max(per_batch, round(per_batch * slow_factor))  # fault injection: really more matmuls
    best = float("inf")
    for i in range(batches + 1):
        sync()
        t0 = clock()
        for _ in range(work):
            a @ b
        sync()
        spent = clock() - t0
        if i:  # the first batch warms up (allocator, kernels, clocks)
            best = min(best, spent)
    return best / per_batch


def reference(level: str = "quick") -> dict:
    """This machine's CPU matmul (:data:`CPU_GEMM`, one thread) and loopback all-reduce
    (:func:`reference_collective`): the references of CPU nodes that run here (local nodes).
    ``{"shape", "dtype", "measured_s", "bus_gbps"}`` (``bus_gbps`` None where the two processes
    could not meet)."""
    per_batch, batches = BATCHES[level]
    m, n, k, dtype = CPU_GEMM
    try:
        bus = reference_collective()["bus_gbps"]
    except Exception:  # noqa: BLE001 no loopback collective here: the all-reduce is recorded, not judged
        bus = None
    return {"shape": [m, n, k], "dtype": dtype, "measured_s": time_matmul("cpu", CPU_GEMM, per_batch, 2 * batches),
            "bus_gbps": bus}


def gpus_visible() -> bool:
    """Whether this machine shows an NVIDIA or AMD GPU device file (no torch, no driver call)."""
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/dri/renderD*") and os.path.exists("/dev/kfd"))


def _devices() -> list[str]:
    try:
        import torch

        if torch.cuda.is_available():
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 a broken CUDA is the CPU's check plus an error line
        pass
    return ["cpu"]


def check_matmul(level: str, environ=None, devices: list[str] | None = None) -> tuple[list[dict], list[str]]:
    """The matmul of every device (``devices``: these only): its records and the errors of those
    that could not run."""
    predicted = settings.get("SFTCTL_PREFLIGHT_GEMM_S", environ)
    ref = settings.get("SFTCTL_PREFLIGHT_REFERENCE", environ)
    factor = _slow_factor(environ)
    per_batch, batches = BATCHES[level]
    out, errors = [], []
    for device in devices or _devices():
        m, n, k, dtype = CPU_GEMM if device == "cpu" else GPU_GEMM
        gpu = None if device == "cpu" else int(device.split(":")[1])
        try:
            measured = time_matmul(device, (m, n, k, dtype), per_batch, batches, factor)
        except Exception as e:  # noqa: BLE001 a device that cannot multiply is a failed preflight
            errors.append(f"{'CPU' if gpu is None else f'GPU {gpu}'} matmul: {type(e).__name__}: {e}")
            continue
        out.append({"gpu": gpu, "shape": [m, n, k], "dtype": dtype, "flops": 2.0 * m * n * k,
                    "measured_s": measured, "predicted_s": predicted,
                    "reference": "cpu" if gpu is None else ref})
    return out, errors


def check_nvml() -> dict | None:
    """NVML's state of every GPU: ``problems`` (faults) and ``notes``; None without NVML/GPUs."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    problems, notes = [], []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)

            def ask(fn, *args, h=h):
                try:
                    return fn(h, *args)
                except pynvml.NVMLError:
                    return None

            ecc = ask(pynvml.nvmlDeviceGetEccMode)
            if ecc is not None and ecc[0] != ecc[1]:
                problems.append(f"GPU {i}: ECC mode {ecc[0]} pending a change to {ecc[1]} (needs a reset)")
            elif ecc is not None and not ecc[0]:
                notes.append(f"GPU {i}: ECC off")
            if ask(pynvml.nvmlDeviceGetPersistenceMode) == 0:
                notes.append(f"GPU {i}: persistence mode off")
            width, max_width = ask(pynvml.nvmlDeviceGetCurrPcieLinkWidth), ask(pynvml.nvmlDeviceGetMaxPcieLinkWidth)
            if width and max_width and width < max_width:
                problems.append(f"GPU {i}: PCIe link x{width} of x{max_width}")
            links = {x: ask(pynvml.nvmlDeviceGetNvLinkState, x)
                     for x in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18))}
            down = [x for x, state in links.items() if state == 0]
            if down and any(state == 1 for state in links.values()):  # some up, some down: degraded (none up: PCIe)
                problems.append(f"GPU {i}: NVLink link(s) {', '.join(map(str, down))} down")
            clock, max_clock = (ask(pynvml.nvmlDeviceGetApplicationsClock, pynvml.NVML_CLOCK_SM),
                                ask(pynvml.nvmlDeviceGetMaxClockInfo, pynvml.NVML_CLOCK_SM))
            if clock and max_clock and clock < 0.5 * max_clock:
                notes.append(f"GPU {i}: applications SM clock {clock} MHz of max {max_clock}")
    finally:
        pynvml.nvmlShutdown()
    return {"problems": problems, "notes": notes}


def check_dcgm(level: int) -> dict:
    """``dcgmi diag -r LEVEL -j``: the tests that failed (name: message), or why it was skipped."""
    exe = shutil.which("dcgmi")
    if exe is None:
        return {"skipped": "dcgmi not installed"}
    try:
        proc = subprocess.run([exe, "diag", "-r", str(level), "-j"], capture_output=True, text=True,
                              timeout=DCGM_TIMEOUT_S.get(level, 600.0))
    except subprocess.TimeoutExpired:
        return {"level": level, "failed": [f"no answer within {DCGM_TIMEOUT_S.get(level, 600.0):.0f} s"]}
    failed: list[str] = []
    try:
        _failures(json.loads(proc.stdout), failed, "")
    except json.JSONDecodeError:
        if proc.returncode != 0:
            failed.append(f"exit code {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-200:]}")
    if proc.returncode != 0 and not failed:
        failed.append(f"exit code {proc.returncode}")
    return {"level": level, "rc": proc.returncode, "failed": failed}


def _failures(doc, out: list[str], name: str) -> None:
    """Collect ``name (GPU n): message`` of every result whose status is Fail in dcgmi's JSON.

    DCGM 3's layout (NVIDIA/DCGM ``nvvs/src/JsonOutput.cpp``): ``{"DCGM GPU Diagnostic":
    {"test_categories": [{"category", "tests": [{"name", "results": [{"gpu_ids", "status":
    PASS|FAIL|WARN|SKIPPED, "warnings": [{"warning", "error_id", "error_category",
    "error_severity"}], "info": [...]}]}]}], "version"}}``; DCGM 4 moves ``tests`` up and names
    entities: any object with a ``status`` of ``Fail`` (any case) counts, its ``warnings``
    (else ``info``) the message."""
    if isinstance(doc, dict):
        name = str(doc.get("name") or doc.get("test_name") or name)
        status = str(doc.get("status") or doc.get("result") or "")
        if status.lower() == "fail":
            info = doc.get("warnings") or doc.get("warning") or doc.get("info") or ""
            if isinstance(info, list):
                info = "; ".join(str(x.get("warning", x.get("message", x)) if isinstance(x, dict) else x)
                                 for x in info)
            gpu = doc.get("gpu_ids", doc.get("gpu_id", doc.get("entity_id")))
            line = f"{name}" + (f" (GPU {gpu})" if gpu is not None else "") + (f": {info}" if info else "")
            if line not in out:
                out.append(line)
        for v in doc.values():
            if isinstance(v, (dict, list)):
                _failures(v, out, name)
    elif isinstance(doc, list):
        for v in doc:
            _failures(v, out, name)


def check_allreduce(environ=None) -> dict | None:
    """The all-reduce across the job's nodes (one process each), or None on a one-node job:
    :func:`measure_collective` at ``MASTER_ADDR:MASTER_PORT``, with the predicted bus bandwidth
    (``SFTCTL_PREFLIGHT_BUS_GBPS``) and the node it blames, if any."""
    nodes = settings.get("SFTCTL_NUM_NODES", environ)
    if nodes < 2:
        return None
    import torch

    env = os.environ if environ is None else environ
    out = measure_collective(settings.get("SFTCTL_NODE_RANK", environ), nodes, env.get("MASTER_ADDR", "127.0.0.1"),
                             int(env["MASTER_PORT"]), torch.cuda.is_available(), _slow_net_gbps(environ))
    predicted = settings.get("SFTCTL_PREFLIGHT_BUS_GBPS", environ)
    fraction = settings.get("SFTCTL_PREFLIGHT_MIN_FRACTION", environ)
    out["predicted_bus_gbps"] = predicted
    out["reference"] = settings.get("SFTCTL_PREFLIGHT_REFERENCE", environ)
    out["slow_node"] = (blame(out["send_gbps"], predicted, fraction)
                        if predicted and out["bus_gbps"] < fraction * predicted else None)
    return out


def measure_collective(rank: int, nodes: int, addr: str, port: int, cuda: bool = False,
                       cap_gbps: float | None = None) -> dict:
    """Time an all-reduce of :data:`ALLREDUCE_BYTES` (float32) across ``nodes`` processes (this
    one is ``rank``; the TCPStore at ``addr:port``, served by rank 0), best of
    :data:`COLLECTIVE_REPS`, then each rank's send of the same buffer to the next rank, timed by
    the receiver (best of as many). ``cap_gbps``: this rank waits its bytes' time at that rate
    before each all-reduce and send (fault injection). NCCL on ``cuda:0`` when ``cuda``, else gloo.

    Returns ``{"nodes", "bytes", "measured_s", "bus_gbps", "send_gbps"}``: bus bandwidth in GB/s
    as nccl-tests defines it (``2(n-1)/n x bytes / seconds``), ``send_gbps[r]`` rank r's sends
    in GB/s (every rank returns the same list).

    Raises:
        torch's DistStoreError / RuntimeError: a rank that never came within
        :data:`RENDEZVOUS_TIMEOUT_S`.
    """
    import datetime

    import torch
    import torch.distributed as dist

    kind = "cuda" if cuda else "cpu"
    nbytes = ALLREDUCE_BYTES[kind]
    device = "cuda:0" if cuda else "cpu"
    timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    store = dist.TCPStore(addr, port, nodes, rank == 0, timeout=timeout)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=nodes, timeout=timeout)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    def pace(n: float) -> None:  # a NIC capped at cap_gbps: the bytes' time at that rate
        if cap_gbps:
            time.sleep(n / (cap_gbps * 1e9))

    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(x)  # warm-up: connections, buffers
        sync()
        wire = 2 * (nodes - 1) / nodes * nbytes
        best = float("inf")
        for _ in range(COLLECTIVE_REPS):
            dist.barrier()
            t0 = time.perf_counter()
            pace(wire)
            dist.all_reduce(x)
            sync()
            best = min(best, time.perf_counter() - t0)
        received = torch.zeros(nodes, dtype=torch.float64, device=device)  # seconds of rank r's send, by its receiver
        for r in range(nodes):
            dst = (r + 1) % nodes
            got = float("inf")
            for _ in range(COLLECTIVE_REPS):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == r:
                    pace(nbytes)
                    dist.send(x, dst)
                elif rank == dst:
                    dist.recv(x, r)
                    sync()
                    got = min(got, time.perf_counter() - t0)
            if rank == dst:
                received[r] = got
        dist.all_reduce(received)  # each entry set by exactly one rank (its receiver)
        sync()
        dist.barrier()  # every node done before node 0's store goes (torchrun takes its port next)
    finally:
        dist.destroy_process_group()
    return {"nodes": nodes, "bytes": nbytes, "measured_s": best,
            "bus_gbps": 2 * (nodes - 1) / nodes * nbytes / best / 1e9,
            "send_gbps": [nbytes / t / 1e9 for t in received.cpu().tolist()]}


def reference_collective(timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> dict:
    """This machine's loopback all-reduce (gloo, two processes: this one and a child): the
    reference of local CPU nodes' all-reduce, as :func:`measure_collective` returns it."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    injected = ("SFTCTL_PREFLIGHT_SLOW_RANK", "SFTCTL_PREFLIGHT_SLOW_NET_RANK")  # the reference is never throttled
    env = {k: v for k, v in os.environ.items() if k not in injected}
    peer = subprocess.Popen(module_argv("sftctl.preflight", "--peer", str(port)), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        out = measure_collective(0, 2, "127.0.0.1", port)
        peer.wait(timeout=timeout_s)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    return out


def _write(record: dict, environ=None) -> None:
    path = protocol.NodeDir(Path(settings.get("SFTCTL_NODE_DIR", environ))).health
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def run(level: str, when: str = "start", environ=None, devices: list[str] | None = None) -> tuple[dict, list]:
    """Run the checks of ``level`` and return ``(record, verdicts)``; the record is appended to
    the node's ``health.jsonl``. The all-reduce runs only when no verdict came before it.
    ``when="checkpoint"``: the matmul alone (of ``devices``, default every device)."""
    t0 = time.monotonic()
    rank = settings.get("SFTCTL_NODE_RANK", environ)
    fraction = settings.get("SFTCTL_PREFLIGHT_MIN_FRACTION", environ)
    pre: dict = {"when": when, "level": level}
    pre["matmul"], errors = check_matmul(level, environ, devices)
    if when == "start":
        nvml = check_nvml()
        if nvml is not None:
            pre["nvml"] = nvml
        if any(m["gpu"] is not None for m in pre["matmul"]) or shutil.which("dcgmi"):
            pre["dcgm"] = check_dcgm(settings.get("SFTCTL_PREFLIGHT_DCGM_LEVEL", environ))
    pre["errors"] = errors
    verdicts = judge({"preflight": pre}, rank, fraction)
    if when == "start" and not verdicts:
        try:
            allreduce = check_allreduce(environ)
        except Exception as e:  # noqa: BLE001 a peer that never came (its own verdict) blames no one here
            pre["notes"] = [f"all-reduce: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
        else:
            if allreduce is not None:
                pre["allreduce"] = allreduce
                verdicts += slow_allreduce({"preflight": pre}, rank, fraction)
    pre["elapsed_s"] = time.monotonic() - t0
    record = {"ts": time.time(), "preflight": pre}
    _write(record, environ)
    return record, verdicts


def at_checkpoint(step: int, device: str | None = None, environ=None) -> list:
    """The periodic check of a long job, from a training process right after its checkpoint at
    ``step``: the quick matmul of ``device`` (``cpu``, ``cuda:N``; default the process's current
    one) into ``health.jsonl`` (the controller's detector judges it; a slow node is replaced and
    the job resumes from that checkpoint). Nothing unless ``SFTCTL_PREFLIGHT_PERIODIC`` is set;
    never raises (the training goes on). Returns the verdicts."""
    try:
        if not settings.get("SFTCTL_PREFLIGHT_PERIODIC", environ) or settings.get("SFTCTL_NODE_DIR", environ) is None:
            return []
        if device is None:
            import torch

            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        record, verdicts = run("quick", when="checkpoint", environ=environ, devices=[device])
        return verdicts
    except Exception as e:  # noqa: BLE001
        import logging  # a training process: logging's last resort prints a warning on stderr

        logging.getLogger("sftctl.preflight").warning("sftctl preflight: the check at step %d did not run: %s: %s",
                                                      step, type(e).__name__, e)
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sftctl.preflight",
                                 description="Check this node against its predicted speed before training.")
    ap.add_argument("--level", choices=("quick", "full"), default=None,
                    help="default: $SFTCTL_PREFLIGHT (nothing to do when off)")
    ap.add_argument("--reference", action="store_true",
                    help="print this machine's CPU matmul reference as JSON and exit")
    ap.add_argument("--peer", type=int, metavar="PORT", help=argparse.SUPPRESS)  # reference_collective's rank 1
    args = ap.parse_args(argv)
    if args.peer:
        measure_collective(1, 2, "127.0.0.1", args.peer)
        return 0
    if args.reference:
        print(json.dumps(reference(args.level or "quick")))
        return 0
    level = args.level or settings.get("SFTCTL_PREFLIGHT")
    if level == "off":
        return 0
    rank = settings.get("SFTCTL_NODE_RANK")
    if settings.get("SFTCTL_PREFLIGHT_REFERENCE") == "compiler" and not gpus_visible():
        print(f"[sftctl] node {rank}: preflight skipped: no GPU visible on a GPU offering", flush=True)
        return 0
    record, verdicts = run(level)
    pre = record["preflight"]
    summary = ", ".join(f"{'CPU' if m['gpu'] is None else 'GPU %d' % m['gpu']} matmul "
                        f"{m['flops'] / m['measured_s'] / 1e9:.1f} GFLOP/s" for m in pre["matmul"])
    if "allreduce" in pre:
        summary += f", all-reduce {pre['allreduce']['bus_gbps']:.2f} GB/s bus"
    if not verdicts:
        print(f"[sftctl] node {rank}: preflight passed in {pre['elapsed_s']:.1f} s: {summary}", flush=True)
        slow_node = (pre.get("allreduce") or {}).get("slow_node")
        if slow_node is not None:  # its verdict replaces it: no training starts with it
            print(f"[sftctl] node {rank}: node {slow_node} slows the all-reduce; waiting for its replacement",
                  flush=True)
            time.sleep(RENDEZVOUS_TIMEOUT_S)
        return 0
    v = verdicts[0]
    code = FailureCode.PREFLIGHT_FAILED if v.kind == "preflight_failed" else FailureCode.PREFLIGHT_SLOW
    attempt = settings.get("SFTCTL_ATTEMPT")
    node_dir = protocol.NodeDir(Path(settings.get("SFTCTL_NODE_DIR")))
    write_record(FailureReason(code, f"{v.kind}: {v.evidence}", {"verdict": v.kind.value, "gpu": v.gpu}),
                 node_dir.path(protocol.failure_name(attempt)))
    print(f"[sftctl] node {rank}: preflight: {v.kind}: {v.evidence}", flush=True)
    return EXIT_VERDICT


if __name__ == "__main__":
    sys.exit(main())
