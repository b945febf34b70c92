"""Collective communication times from measured NCCL/RCCL data: ``t = alpha + bus_bytes / beta``.

What one collective of a ``nbytes`` buffer per device (all-gather: the gathered output;
reduce-scatter: the input; the convention of ``calibrations/data/xla/collectives.jsonl``) costs
on a group of ``g`` devices over one link (NVLink/NVSwitch, xGMI, PCIe, EFA, GPUDirect-TCPX,
InfiniBand)::

    t(op, g, S) = (alpha(op, g) + f(op, g) * S / beta(op, g)) * c(op, g, S)
    f: all-reduce 2 (g-1)/g, all-gather / reduce-scatter / all-to-all (g-1)/g, permute 1
       (the bytes each device sends: nccl-tests' "bus bandwidth", PERFORMANCE.md)

``alpha`` is the latency (kernel launch, handshakes, NCCL's LL protocol floor), ``beta`` the bus
bandwidth a large buffer reaches. ``c`` is a correction measured where the link has data:
measured / fitted ratio per buffer size, interpolated in log(size) between the measured sizes and
1 beyond them (NCCL switches protocol and channel count with size, which one line cannot follow).

Every link lives in ``calibrations/collectives.json``: its fits, where they come from (the source
and a quote), and the cross-validated error of the fitted ones. Which link an accelerator's hosts
have is its catalog record's (``accelerators.yaml``: ``collective_link``, and ``pcie_link`` for
its PCIe-only hosts); no accelerator is named here. Links fitted here (``python -m
sftctl.compiler.collectives fit``) come from XLA's measured table (``calibrations/data/xla/
collectives.jsonl``: 8-GPU H100, B200 and MI355X hosts); the others (PCIe-only hosts, A100 and
V100 NVLink, EFA, GPUDirect-TCPX, InfiniBand) carry one (alpha, beta) from published nccl-tests
output, quoted.

Across nodes a collective is hierarchical (NCCL's ring/tree over nodes, PXN): the in-host part
on the in-host link, the across-node part of the ``S / g`` shard each GPU holds over the
network link, then the in-host part again for all-reduce::

    all-reduce  = RS_host(S) + AR_net(S / g, nodes) + AG_host(S)
    all-gather  = AG_net(S / g, nodes) + AG_host(S)      (reduce-scatter the mirror)

The network link's ``beta`` is its measured efficiency times the offering's per-GPU network
bandwidth (``inter_node_bytes_per_s / gpus_per_node``), so a 3200 Gbit/s EFA node and a 400 Gbit/s
one differ as their NICs do.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

DATA = Path(__file__).resolve().parent / "calibrations" / "collectives.json"
MEASURED = Path(__file__).resolve().parent / "calibrations" / "data" / "xla" / "collectives.jsonl"
OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
#: bucket edges of the cross-validation report (bytes): < 1 MiB, 1-64 MiB, >= 64 MiB
BUCKETS = ((0, 2**20, "<1MiB"), (2**20, 2**26, "1-64MiB"), (2**26, math.inf, ">=64MiB"))
#: an offering whose in-host link is at least this fast (bytes/s each way) has NVLink/xGMI; slower
#: is PCIe (PCIe 5.0 x16 is 64 GB/s each way)
NVLINK_MIN_BYTES_PER_S = 100e9


def bus_factor(op: str, group_size: int) -> float:
    """Bytes each device sends per byte of the buffer (nccl-tests PERFORMANCE.md, "bus bandwidth")."""
    g = max(1, int(group_size))
    if op == "all-reduce":
        return 2.0 * (g - 1) / g
    if op in ("all-gather", "reduce-scatter", "all-to-all"):
        return (g - 1) / g
    if op == "collective-permute":
        return 1.0
    raise ValueError(f"unknown collective {op!r}: one of {', '.join(OPS)}")


@dataclass(frozen=True)
class Fit:
    """One (op, group size) of a link: seconds = (alpha_s + f * bytes / bus_bytes_per_s) * c(bytes)."""

    op: str  # one of OPS, or "*" (any op)
    group_size: int  # 0: any
    alpha_s: float
    bus_bytes_per_s: float
    correction: tuple = ()  # ((bytes, measured / fitted), ...) ascending in bytes
    pattern: str = ""  # collective-permute's pattern ("ring", ...), "" any

    def time_s(self, op: str, group_size: int, nbytes: float) -> float:
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        t = self.alpha_s + bus_factor(op, group_size) * nbytes / self.bus_bytes_per_s
        return t * _correction(self.correction, nbytes)


def _correction(table: tuple, nbytes: float) -> float:
    """measured / fitted at ``nbytes``: piecewise linear in log(bytes) over the table, 1 outside."""
    if not table or nbytes < table[0][0] or nbytes > table[-1][0]:
        return 1.0
    xs = [math.log(b) for b, _ in table]
    x = math.log(nbytes)
    i = bisect.bisect_right(xs, x)
    if i >= len(xs):
        return table[-1][1]
    if i == 0:
        return table[0][1]
    x0, x1 = xs[i - 1], xs[i]
    r0, r1 = table[i - 1][1], table[i][1]
    w = (x - x0) / (x1 - x0) if x1 > x0 else 0.0
    return math.exp((1 - w) * math.log(r0) + w * math.log(r1))


@dataclass(frozen=True)
class Link:
    """A link collectives run over, with its fits, where they come from and their error.

    ``kind``: ``in-host`` (NVLink/NVSwitch, xGMI, PCIe) or ``network`` (EFA, TCPX, InfiniBand;
    ``efficiency``: measured bus bandwidth / the NICs' line rate per GPU). ``measured``: fitted
    here to measured collectives (``cv_error``: the cross-validated predicted / measured), else
    one published point (``source`` and ``quote`` say which)."""

    name: str
    kind: str
    source: str
    quote: str
    fits: tuple[Fit, ...]
    measured: bool = False
    efficiency: float = 1.0
    cv_error: dict = field(default_factory=dict, compare=False, hash=False)

    def fit_for(self, op: str, group_size: int, pattern: str = "") -> Fit:
        """The fit of (op, group size): exact, else the same op at the nearest group size, else
        any op at that size (bus bandwidth carries over between ops), else the first."""
        def score(f: Fit):
            return (f.op not in (op, "*"), f.pattern not in (pattern, ""), f.pattern != pattern,
                    abs(math.log(max(f.group_size, 1) / max(group_size, 1))) if f.group_size else 0.5)
        return min(self.fits, key=score)

    def time_s(self, op: str, group_size: int, nbytes: float, pattern: str = "") -> float:
        return self.fit_for(op, group_size, pattern).time_s(op, group_size, nbytes)


@functools.lru_cache(maxsize=1)
def _load() -> dict:
    return json.loads(DATA.read_text())


@functools.lru_cache(maxsize=None)
def link(name: str) -> Link:
    """The link ``name`` of ``calibrations/collectives.json``. Raises KeyError naming the known ones."""
    d = _load()["links"]
    if name not in d:
        raise KeyError(f"unknown collective link {name!r}; known: {', '.join(sorted(d))}")
    e = d[name]
    fits = tuple(Fit(op=f["op"], group_size=int(f["group_size"]), alpha_s=float(f["alpha_s"]),
                     bus_bytes_per_s=float(f["bus_bytes_per_s"]),
                     correction=tuple((float(b), float(r)) for b, r in f.get("correction", ())),
                     pattern=f.get("pattern", "")) for f in e["fits"])
    return Link(name=name, kind=e["kind"], source=e["source"], quote=e["quote"], fits=fits,
                measured=bool(e.get("measured")), efficiency=float(e.get("efficiency", 1.0)),
                cv_error=e.get("cv_error", {}))


def links() -> list[str]:
    return sorted(_load()["links"])


def host_link(accelerator: str, intra_node_bytes_per_s: float | None = None) -> Link:
    """The in-host link of an accelerator's hosts: its catalog record's ``collective_link``
    (NVLink/NVSwitch, xGMI), or its ``pcie_link`` when the offering's in-host bandwidth says
    PCIe (under :data:`NVLINK_MIN_BYTES_PER_S`).

    Raises:
        KeyError: an accelerator the catalog does not know, or one whose entry names no link.
    """
    from sftctl.compiler.hardware import get_accelerator

    acc = get_accelerator(accelerator)
    pcie = intra_node_bytes_per_s is not None and intra_node_bytes_per_s < NVLINK_MIN_BYTES_PER_S
    name = acc.pcie_link if pcie else acc.collective_link
    if not name:
        field = "pcie_link" if pcie else "collective_link"
        raise KeyError(f"{acc.name}: accelerators.yaml names no {field}; add one of {', '.join(links())}")
    return link(name)


def network_link(provider: str | None, instance_type: str | None = None) -> Link:
    """The link between hosts: EFA on AWS, GPUDirect-TCPX on GCP's A3, RDMA (the InfiniBand
    link) on GCP's A3 Ultra / A4 and elsewhere (Slurm, Kubernetes clusters), by
    ``collectives.json`` ``networks``. ``provider`` may carry the instance type:
    ``gcp:a4-highgpu-8g``."""
    nets = {k: v for k, v in _load()["networks"].items() if k != "note"}
    if provider and ":" in provider and instance_type is None:
        provider, instance_type = provider.split(":", 1)
    key = f"{provider}:{instance_type}" if instance_type else ""
    return link(nets.get(key) or nets.get(str(provider)) or nets["default"])


def time_s(op: str, nbytes: float, accelerator: str, gpus_per_node: int, nodes: int = 1,
           intra_node_bytes_per_s: float | None = None, inter_node_bytes_per_s: float | None = None,
           provider: str | None = None, instance_type: str | None = None) -> float:
    """Seconds of one collective ``op`` of ``nbytes`` per device (see the module docstring for
    which buffer) over ``nodes`` x ``gpus_per_node`` devices.

    Args:
        inter_node_bytes_per_s: the node's network line rate (bytes/s, all NICs); None: 10 Gbit/s
            (:data:`sftctl.compiler.step.DEFAULT_INTER_NODE_BYTES_PER_S`).
    Raises:
        ValueError: an unknown op.
    """
    bus_factor(op, 2)  # validates op
    g, n = int(gpus_per_node), int(nodes)
    if g * n <= 1 or nbytes <= 0:
        return 0.0
    host = host_link(accelerator, intra_node_bytes_per_s)
    if n == 1:
        return host.time_s(op, g, nbytes)
    net = network_link(provider, instance_type)
    per_gpu = (inter_node_bytes_per_s or 1.25e9) / g
    nf = net.fit_for(op, n)
    net_fit = Fit(op=nf.op, group_size=nf.group_size, alpha_s=nf.alpha_s,
                  bus_bytes_per_s=min(nf.bus_bytes_per_s, net.efficiency * per_gpu) if nf.bus_bytes_per_s
                  else net.efficiency * per_gpu)
    shard = nbytes / g
    if op == "all-reduce":
        t = net_fit.time_s("all-reduce", n, shard)
        if g > 1:
            t += host.time_s("reduce-scatter", g, nbytes) + host.time_s("all-gather", g, nbytes)
        return t
    if op in ("all-gather", "reduce-scatter"):
        return net_fit.time_s(op, n, nbytes / g * 1.0) + (host.time_s(op, g, nbytes) if g > 1 else 0.0)
    # all-to-all / permute across nodes: the network carries the cross-node share
    return net_fit.time_s(op, g * n, nbytes) + (host.time_s(op, g, nbytes) if g > 1 else 0.0)


def bucketed_time_s(op: str, nbytes: float, bucket_bytes: float, accelerator: str, gpus_per_node: int,
                    nodes: int = 1, intra_node_bytes_per_s: float | None = None,
                    inter_node_bytes_per_s: float | None = None, provider: str | None = None) -> float:
    """``nbytes`` in collectives of ``bucket_bytes`` each (DDP's gradient buckets): the full
    buckets and the remainder, each paying its latency. Seconds."""
    if nbytes <= 0:
        return 0.0
    full, rest = divmod(float(nbytes), float(bucket_bytes))
    args = (accelerator, gpus_per_node, nodes, intra_node_bytes_per_s, inter_node_bytes_per_s, provider)
    t = full * time_s(op, bucket_bytes, *args) if full else 0.0
    return t + (time_s(op, rest, *args) if rest else 0.0)


# ---------------------------------------------------------------------------------------------
# fitting and cross-validation (numpy; only `fit` and the tests import this part)

def record_bytes(rec: dict) -> int:
    """The buffer of a measured record: the larger of input and output per device."""
    return int(max(rec["input_bytes_per_device"], rec["output_bytes_per_device"]))


def record_pattern(rec: dict) -> str:
    return rec.get("permute_pattern", "") if rec["opcode"] == "collective-permute" else ""


def fit_alpha_beta(sizes, times, op: str, group_size: int) -> tuple[float, float]:
    """(alpha_s, bus_bytes_per_s) minimizing the summed |log(predicted / measured)| (robust to the
    odd slow small run); a log grid, refined once around the best point."""
    import numpy as np

    s = np.asarray(sizes, float)
    t = np.asarray(times, float)
    x = bus_factor(op, group_size) * s
    a_lo, a_hi, b_lo, b_hi = 1e-7, 1e-3, 1e8, 1e13
    best = None
    for _ in range(2):
        A = np.geomspace(a_lo, a_hi, 160)
        B = np.geomspace(b_lo, b_hi, 160)
        pred = A[:, None, None] + x[None, None, :] / B[None, :, None]
        err = np.abs(np.log(pred / t)).sum(-1)
        i, j = np.unravel_index(int(err.argmin()), err.shape)
        best = (float(A[i]), float(B[j]))
        a_lo, a_hi = A[max(i - 2, 0)], A[min(i + 2, len(A) - 1)]
        b_lo, b_hi = B[max(j - 2, 0)], B[min(j + 2, len(B) - 1)]
    return best


def fit_group(records: list[dict]) -> Fit:
    """One (op, group size, pattern)'s fit: alpha-beta, then the measured / fitted ratio per size
    (median over repeated sizes) as the correction table."""
    import numpy as np

    op, g = records[0]["opcode"], int(records[0]["group_size"])
    sizes = np.array([record_bytes(r) for r in records], float)
    times = np.array([r["time_s"] for r in records], float)
    alpha, beta = fit_alpha_beta(sizes, times, op, g)
    base = Fit(op=op, group_size=g, alpha_s=alpha, bus_bytes_per_s=beta, pattern=record_pattern(records[0]))
    corr = [(b, float(np.median(times[sizes == b])) / base.time_s(op, g, b)) for b in sorted(set(sizes.tolist()))]
    return Fit(op=op, group_size=g, alpha_s=alpha, bus_bytes_per_s=beta, correction=tuple(corr),
               pattern=base.pattern)


def _groups(records: list[dict]) -> dict:
    out: dict = {}
    for r in records:
        out.setdefault((r["opcode"], int(r["group_size"]), record_pattern(r)), []).append(r)
    return out


def bucket_of(nbytes: float) -> str:
    return next(name for lo, hi, name in BUCKETS if lo <= nbytes < hi)


def _summary(ratios: dict) -> dict:
    import numpy as np

    out = {}
    for name, rs in ratios.items():
        if rs:
            a = np.asarray(rs)
            out[name] = {"median": round(float(np.median(a)), 3), "n": int(a.size),
                         "within_0.8_1.25": round(float(np.mean((a >= 0.8) & (a <= 1.25))), 3)}
    return out


def cross_validate(records: list[dict], ratios: bool = False) -> dict:
    """Predicted / measured on data each fit never saw, per size bucket:

    * ``sizes``: each group's sizes split in two interleaved halves (even / odd positions of the
      sorted sizes); fit on one, predict the other, both ways;
    * ``ops``: each op predicted from the link's other ops at the same group size (alpha and bus
      bandwidth of the op with the nearest bus factor, no correction).

    With ``ratios``, the result also holds every predicted / measured ratio under
    ``"ratios": {"held_out_sizes": {bucket: [...]}, "held_out_ops": {...}}``.
    """
    groups = _groups(records)
    by_size = {name: [] for _, _, name in BUCKETS}
    by_op = {name: [] for _, _, name in BUCKETS}
    for key, rs in groups.items():
        sizes = sorted({record_bytes(r) for r in rs})
        for half in (0, 1):
            keep = set(sizes[half::2])
            train = [r for r in rs if record_bytes(r) in keep]
            test = [r for r in rs if record_bytes(r) not in keep]
            if len({record_bytes(r) for r in train}) < 3 or not test:
                continue
            f = fit_group(train)
            for r in test:
                b = record_bytes(r)
                by_size[bucket_of(b)].append(f.time_s(key[0], key[1], b) / r["time_s"])
    for (op, g, _pat), rs in groups.items():
        others = [fit_group(v) for (o, gg, p), v in groups.items() if o != op and gg == g and o != "collective-permute"]
        if not others or op == "collective-permute":
            continue
        f = min(others, key=lambda f: abs(bus_factor(f.op, g) - bus_factor(op, g)))
        f = Fit(op=op, group_size=g, alpha_s=f.alpha_s, bus_bytes_per_s=f.bus_bytes_per_s)
        for r in rs:
            b = record_bytes(r)
            by_op[bucket_of(b)].append(f.time_s(op, g, b) / r["time_s"])
    out = {"held_out_sizes": _summary(by_size), "held_out_ops": _summary(by_op)}
    if ratios:
        out["ratios"] = {"held_out_sizes": by_size, "held_out_ops": by_op}
    return out


def measured_links(path: Path = MEASURED) -> dict[str, str]:
    """XLA arch (the catalog's ``die``) -> the link its 8-GPU host records fit: the
    ``collective_link`` of the catalog's accelerators of each die with measured records.

    Raises:
        ValueError: two accelerators of one measured die name different links.
    """
    from sftctl.compiler.hardware import load_accelerators

    archs = {r["arch"] for r in measured_records(path=path)}
    out: dict[str, str] = {}
    for acc in load_accelerators().values():
        if acc.die in archs and acc.collective_link:
            if out.setdefault(acc.die, acc.collective_link) != acc.collective_link:
                raise ValueError(f"accelerators.yaml: die {acc.die} is measured on one host, but its accelerators "
                                 f"name links {out[acc.die]} and {acc.collective_link}")
    return dict(sorted(out.items()))


def measured_records(arch: str | None = None, path: Path = MEASURED) -> list[dict]:
    """The shipped measured collectives of 8-GPU hosts (optionally one ``arch``)."""
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("devices_total") == 8 and (arch is None or r["arch"] == arch):
            out.append(r)
    return out


def fit_links(path: Path = MEASURED) -> dict:
    """name -> {fits, cv_error} for each measured link (:func:`measured_links`)."""
    out = {}
    for arch, name in measured_links(path).items():
        recs = measured_records(arch, path)
        fits = [fit_group(rs) for rs in _groups(recs).values()]
        out[name] = {
            "fits": [{"op": f.op, "group_size": f.group_size, "pattern": f.pattern,
                      "alpha_s": float(f"{f.alpha_s:.4g}"), "bus_bytes_per_s": float(f"{f.bus_bytes_per_s:.4g}"),
                      "correction": [[int(b), round(r, 4)] for b, r in f.correction]}
                     for f in sorted(fits, key=lambda f: (f.op, f.group_size, f.pattern))],
            "cv_error": cross_validate(recs),
        }
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sftctl.compiler.collectives",
                                 description="fit the measured links of calibrations/collectives.json")
    ap.add_argument("command", choices=("fit", "show"))
    ap.add_argument("--data", default=str(MEASURED), help="measured collectives (JSON lines)")
    args = ap.parse_args(argv)
    doc = json.loads(DATA.read_text())
    if args.command == "fit":
        for name, fitted in fit_links(Path(args.data)).items():
            doc["links"].setdefault(name, {}).update(fitted, measured=True)
        DATA.write_text(json.dumps(doc, indent=1) + "\n")
    for name, e in doc["links"].items():
        cv = e.get("cv_error", {}).get("held_out_sizes", {})
        med = " ".join(f"{k} {v['median']:.2f}" for k, v in cv.items())
        print(f"{name:16s} {e['kind']:8s} {'measured' if e.get('measured') else 'published':9s} {med}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def predict_record(rec: dict, accelerator: str) -> float:
    """Seconds of one measured-collective record (the format of ``collectives.jsonl``: ``opcode``,
    ``group_size``, ``input_bytes_per_device``, ``output_bytes_per_device``, optional
    ``permute_pattern``) on the 8-GPU host of ``accelerator``; ``time_s`` and throughput fields are
    ignored. Raises ValueError naming the field."""
    op = rec.get("opcode")
    if op not in OPS:
        raise ValueError(f"opcode must be one of {', '.join(OPS)}, got {op!r}")
    g = rec.get("group_size")
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError(f"group_size must be a positive integer, got {g!r}")
    sizes = []
    for key in ("input_bytes_per_device", "output_bytes_per_device"):
        v = rec.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{key} must be a non-negative integer (bytes), got {v!r}")
        sizes.append(v)
    return host_link(accelerator).time_s(op, g, max(sizes), record_pattern(rec))
