"""The controller's side of the preflight (issue 41): what each node is told to check against,
and how a node's preflight record is said.

:func:`preflight_env` is part of every node's environment (:func:`sftctl.controller.submit.node_env`,
so ``run --dry-run`` shows it): the level (``health.preflight``, :mod:`sftctl.health.preflight`),
the predicted seconds of the node's matmul and their source, the fraction below which the node is
slow, ``dcgmi diag``'s level and whether checkpoints are checked too (a long job). The predicted
GEMM time of a GPU node is the compiler's (:func:`sftctl.compiler.gemm_table.gemm_gpu_time_s` of
:data:`sftctl.preflight.GPU_GEMM` on the offering's accelerator); a CPU node's is the same CPU
matmul measured on this machine (local nodes run here), kept a day in
``$SFTCTL_HOME/preflight-cpu.json``.

:func:`report` turns a node's preflight record (read with its GPU samples) into a ``preflight``
event with its figures and time. Imports no other controller module.
"""

from __future__ import annotations

import functools
import json
import socket
import subprocess
import time

from sftctl import settings
from sftctl.catalog.accelerators import find_accelerator
from sftctl.health import preflight as cost
from sftctl.health.detectors.preflight import judge
from sftctl.health.registry import kind_order
from sftctl.paths import sftctl_home
from sftctl.preflight import ALLREDUCE_BYTES, GPU_GEMM
from sftctl.procs import module_argv
from sftctl.providers.base import Quarantines
from sftctl.spec import JobSpec
from sftctl.types import Plan

#: seconds a measured CPU reference is kept
CPU_REFERENCE_TTL_S = 24 * 3600.0
CPU_REFERENCE_FILE = "preflight-cpu.json"


def level_of(spec: JobSpec, plan: Plan) -> str:
    """The job's preflight level on the plan's offering (``off``, ``quick``, ``full``)."""
    return cost.level(spec.health.preflight, plan.offering.accelerator, spec.health.enabled)


@functools.lru_cache(maxsize=32)
def gpu_gemm_s(accelerator: str) -> float | None:
    """The compiler's seconds of :data:`~sftctl.preflight.GPU_GEMM` on ``accelerator``; None
    where the catalog or the compiler knows no GEMM rate for it."""
    hw = find_accelerator(accelerator)
    if hw is None:
        return None
    from sftctl.compiler.gemm_table import gemm_gpu_time_s  # numpy

    m, n, k, dtype = GPU_GEMM
    try:
        return gemm_gpu_time_s(1, m, n, k, hw, dtype)
    except Exception:  # noqa: BLE001 an accelerator the GEMM tables do not cover (a TPU): recorded, not judged
        return None


_cpu_reference: dict[str, dict] = {}


def cpu_reference() -> dict | None:
    """This machine's CPU matmul time and loopback all-reduce (:func:`sftctl.preflight.reference`:
    ``{"measured_s", "bus_gbps"}``), measured in a child process the first time and kept
    :data:`CPU_REFERENCE_TTL_S` in ``$SFTCTL_HOME``; None when it cannot be measured (the nodes'
    figures are then recorded, not judged)."""
    host = socket.gethostname()
    if host in _cpu_reference:
        return _cpu_reference[host]
    path = sftctl_home() / CPU_REFERENCE_FILE
    try:
        doc = json.loads(path.read_text())
        if doc.get("host") == host and time.time() - float(doc["at"]) < CPU_REFERENCE_TTL_S and "bus_gbps" in doc:
            _cpu_reference[host] = {"measured_s": float(doc["measured_s"]), "bus_gbps": doc["bus_gbps"]}
            return _cpu_reference[host]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        out = subprocess.run(module_argv("sftctl.preflight", "--reference"), capture_output=True, text=True,
                             timeout=300, check=True).stdout
        got = json.loads(out)
        ref = {"measured_s": float(got["measured_s"]),
               "bus_gbps": float(got["bus_gbps"]) if got.get("bus_gbps") else None}
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError):
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"host": host, "at": time.time(), **ref}))
        tmp.replace(path)
    except OSError:
        pass
    _cpu_reference[host] = ref
    return ref


def cpu_reference_s() -> float | None:
    """This machine's CPU matmul seconds (:func:`cpu_reference`), or None."""
    ref = cpu_reference()
    return ref["measured_s"] if ref else None


def gpu_bus_gbps(plan: Plan) -> float | None:
    """The compiler's bus bandwidth (GB/s) of the preflight's all-reduce on ``plan``'s offering:
    :data:`sftctl.preflight.ALLREDUCE_BYTES` on one GPU per node across the plan's nodes, over the
    offering's network at one GPU's share of its line rate (``inter_node_bytes_per_s / count``,
    :func:`sftctl.compiler.collectives.time_s`); None on one node or where it cannot say."""
    nodes = int(plan.chosen.nodes or 1)
    if nodes < 2:
        return None
    off = plan.offering
    try:
        from sftctl.compiler.collectives import time_s

        inter = off.inter_node_bytes_per_s / max(1, off.count) if off.inter_node_bytes_per_s else None
        nbytes = ALLREDUCE_BYTES["cuda"]
        t = time_s("all-reduce", nbytes, off.accelerator, 1, nodes, None, inter, off.provider, off.instance_type)
    except Exception:  # noqa: BLE001 an accelerator or network the tables do not cover: recorded, not judged
        return None
    return 2 * (nodes - 1) / nodes * nbytes / t / 1e9 if t > 0 else None


def preflight_env(spec: JobSpec, plan: Plan) -> dict[str, str]:
    """The node settings of the preflight for every node of the job ({} when it is off)."""
    lvl = level_of(spec, plan)
    if lvl == "off":
        return {}
    accelerator = plan.offering.accelerator
    hours = plan.planned("hours")
    long_h = spec.health.thresholds().preflight_long_job_h
    if accelerator.lower() == "cpu":
        cpu = cpu_reference() or {}
        gemm_s, bus, ref = cpu.get("measured_s"), cpu.get("bus_gbps"), "cpu"
    else:
        gemm_s, bus, ref = gpu_gemm_s(accelerator), gpu_bus_gbps(plan), "compiler"
    return settings.node_env(
        preflight=lvl, preflight_gemm_s=gemm_s, preflight_bus_gbps=bus, preflight_reference=ref,
        preflight_min_fraction=spec.health.thresholds().preflight_min_fraction,
        preflight_dcgm_level=cost.dcgm_level(hours, long_h),
        preflight_periodic=cost.periodic(lvl, hours, long_h))


def _rate(m: dict) -> str:
    r = m["flops"] / m["measured_s"] / 1e9
    return f"{r / 1e3:.1f} TFLOP/s" if r >= 1e3 else f"{r:.2f} GFLOP/s"


def summary(node_rank: int, record: dict, passed: bool) -> str:
    """One line: the node, passed or not, its time and figures."""
    pre = record["preflight"]
    parts = []
    for m in pre.get("matmul") or ():
        what = "CPU" if m.get("gpu") is None else f"GPU {m['gpu']}"
        line = f"{what} matmul {_rate(m)}"
        if m.get("predicted_s"):
            ref = "predicted" if m.get("reference") == "compiler" else "this machine's"
            line += f" ({m['predicted_s'] / m['measured_s']:.0%} of {ref} {m['flops'] / m['predicted_s'] / 1e9:.2f} GFLOP/s)"
        parts.append(line)
    ar = pre.get("allreduce")
    if ar:
        line = f"all-reduce over {ar['nodes']} nodes {ar['bus_gbps']:.2f} GB/s bus"
        if ar.get("predicted_bus_gbps"):
            ref = "predicted" if ar.get("reference") == "compiler" else "this machine's"
            line += f" ({ar['bus_gbps'] / ar['predicted_bus_gbps']:.0%} of {ref} {ar['predicted_bus_gbps']:.3g})"
        if ar.get("send_gbps"):
            line += ", sends " + "/".join(f"{g:.3g}" for g in ar["send_gbps"]) + " GB/s by node"
        if ar.get("slow_node") is not None:
            line += f", node {ar['slow_node']} slows it"
        parts.append(line)
    dcgm = pre.get("dcgm") or {}
    if "level" in dcgm:
        parts.append(f"dcgmi diag -r {dcgm['level']} {'failed' if dcgm.get('failed') else 'passed'}")
    when = "at a checkpoint" if pre.get("when") == "checkpoint" else "before training"
    verb = "passed" if passed else "found a fault"
    return (f"preflight {when}: node {node_rank} {verb} in {pre.get('elapsed_s', 0.0):.1f} s ({pre.get('level')}): "
            + "; ".join(parts))


def report(store, job_id: str, reporter, node_rank: int, samples: list[dict], min_fraction: float) -> None:
    """A ``preflight`` event (and a reporter line) for each preflight record in ``samples``."""
    for s in samples:
        if not isinstance(s.get("preflight"), dict):
            continue
        verdicts = judge(s, node_rank, min_fraction)
        message = summary(node_rank, s, not verdicts)
        # the node's own rank and verdict win over the record's keys (the job can write the file)
        store.add_event(job_id, "preflight", message, {**s["preflight"], "node_rank": node_rank,
                                                        "passed": not verdicts})
        reporter.event(message)


# ------------------------------------------------------------- the memory of bad machines (41.3)


def remember_machine(store, job_id: str, provider: str, handle, done: dict, verdict: str) -> None:
    """Record in the state the machine a verdict condemned (``done``: what the provider's
    ``quarantine`` did, its ``machine``; ``verdict``: ``"kind: evidence"``), with its zone, so
    that every later job keeps it out until the mark decays. Nothing where the provider names no
    machine (local nodes: every one is this machine)."""
    machine = (done or {}).get("machine")
    if not machine:
        return
    store.mark_bad_machine(provider, str(machine), verdict_kind(verdict), verdict,
                           zone=getattr(handle, "zone", None) or "", job_id=job_id)


def verdict_kind(verdict: str) -> str:
    """The detector kind a verdict line names: ``"throttle: GPU 3 ..."`` (a verdict's own line)
    or ``"node 1 exited with code 86: preflight_slow: ..."`` (a node's preflight exit); the
    longest registered kind found as a word, else ``verdict``."""
    import re

    for kind in sorted(kind_order(), key=len, reverse=True):
        if re.search(rf"(?<![a-z_]){kind}(?![a-z_])", verdict):
            return kind
    return "verdict"


def keep_out(store, provider, job_id: str, reporter=None) -> list[str]:
    """Add the machines the state still marks bad to ``provider``'s own keep-out list for this
    job (:meth:`~sftctl.providers.base.Quarantines.keep_out`: Slurm's ``--exclude``, Kubernetes'
    node anti-affinity); a ``machines`` event names those newly added. Returns them."""
    marks = {m.machine: m for m in store.bad_machines(provider.name)}
    if not marks:
        return []
    if not isinstance(provider, Quarantines):  # a cloud instance is another machine each time
        return []
    new = sorted(provider.keep_out(job_id, set(marks)))
    if new:
        message = (f"keeping out {len(new)} machine(s) a verdict marked bad (sftctl nodes): "
                   + ", ".join(f"{m} ({marks[m].kind})" for m in new))
        store.add_event(job_id, "machines", message, {"machines": new})
        if reporter is not None:
            reporter.event(message)
    return new
