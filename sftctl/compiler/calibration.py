"""Fit an accelerator's cost-model coefficients from measured kernel records.

    python -m sftctl.compiler.calibration fit --target h200 [--data DIR] [--out FILE]
    python -m sftctl.compiler.calibration check --target h200 [--data DIR]

Data: JSON-lines records (``calibrations/data/h200/train.jsonl``, the format of
``calibrations/data/h200/README.md``: ``kernel``, sizes, ``config``, ``measured_s``) and the peers
file (cuBLAS / torch eager / copy bandwidth on the same device). Records are predicted by
:func:`sftctl.compiler.records.predict_records`, the same path ``python -m
sftctl.compiler.predict`` takes, with ptxas registers and spills of the measured configs.

The fit: few, physical coefficients (:data:`GEMM_PARAMS`, :data:`STREAM_PARAMS`), each within
physical bounds, fitted by a deterministic Nelder-Mead (no scipy) in a bounded transform, on

    loss = mean over (kernel, shape) groups of  mean_i (log pred_i - log meas_i)^2
           + RANK_WEIGHT * mean over pairs (meas_i < meas_j / 1.03) of softplus((lp_i - lp_j) / TAU) * TAU

(log-time error plus a pairwise ranking term). ``hbm_efficiency`` is not fitted: it is the
peers file's measured copy bandwidth over the datasheet peak. Streaming kernels (row,
elementwise) are fitted first; the GEMM fit then keeps their ``launch_multiplier``.

Quality: per (kernel, shape) group, Spearman rho of predicted vs measured times, the measured
time of the model's top pick over the best measured (``pick_over_best``), and the RMS of the
log residuals; in-sample and leave-one-shape-out (each group predicted by a fit that never saw
it). The output JSON (``calibrations/<accelerator>.json``) holds the coefficients, the data's
source and SHA-256, the date, both quality tables and the peers' measured efficiencies; the
compiler's target loads it (:func:`sftctl.compiler.target.load_target`).

H100 and H200 share the GH100 die (132 SMs at the same clocks, 50 MB L2, same SM
microarchitecture: H200 datasheet; H100 whitepaper Table 3): the fitted efficiencies (MMA,
fraction of HBM peak), latency multipliers, spill, block-launch, reduction and issue
coefficients carry over. What does not: HBM3 at 3.35 TB/s (H100 SXM) vs HBM3e at 4.8 TB/s, and 80
vs 141 GB; those come from each accelerator's catalog entry, so the same coefficients predict
H100 from its own bandwidth and memory size (its entry's ``calibration: h200.json`` in
``sftctl/catalog/accelerators.yaml``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from sftctl.compiler.calibrated import (CALIBRATION_DIR, DATA_DIR, _load_json, calibration_for, calibration_path,
                                        carries_over)
from sftctl.compiler.costmodel import Coefficients, GemmProblem, gemm_breakdown
from sftctl.compiler.hardware import get_accelerator
from sftctl.compiler.minimize import nelder_mead
from sftctl.compiler.records import RecordError, normalize, predict_records, resources_for
from sftctl.compiler.target import load_target

#: Fitted GEMM coefficients and their physical bounds (see ``costmodel.Coefficients``).
#: ``k_loop_overhead_cycles`` and ``warp_tile_overhead_elems`` keep their defaults: the records
#: (BLOCK_K 32-128, tiles >= 64x64) do not identify them (fitted, they ran to their bounds with
#: no gain in leave-one-shape-out Spearman), and they are what keeps BLOCK_K = 16 and tiny tiles
#: from looking free outside the measured range.
GEMM_PARAMS = {
    "mma_efficiency": (0.4, 1.0),
    "latency_multiplier": (0.3, 6.0),
    "spill_bytes_per_clk": (2.0, 1024.0),
    "overlap_slack": (0.0, 0.6),
    "tile_overhead_cycles": (50.0, 20000.0),
    "l2_bytes_per_clk_per_sm": (16.0, 128.0),
    "sm_load_bytes_per_clk": (16.0, 128.0),
    "sm_overlap_slack": (0.0, 0.6),
}
#: Fitted streaming-kernel (row, elementwise) coefficients and bounds.
STREAM_PARAMS = {
    "launch_multiplier": (0.05, 3.0),
    "block_launch_cycles": (5.0, 3000.0),
    "stream_latency_multiplier": (0.3, 6.0),
    "row_reduce_cycles": (2.0, 3000.0),
    "warp_ipc": (0.02, 1.0),
    "stream_combine_p": (1.0, 16.0),
    "stream_wave_tail": (0.0, 1.0),
    "icache_fetch_bytes_per_clk": (2.0, 256.0),
}
RANK_WEIGHT = 1.0
STARTS = 4
TAU = 0.05
PAIR_MARGIN = 1.03


# --------------------------------------------------------------------------------------------
# statistics


def rankdata(x):
    """Average ranks (1-based), ties sharing their mean rank (as ``scipy.stats.rankdata``)."""
    import numpy as np

    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(len(x))
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(x, y) -> float:
    """Spearman's rho (Pearson of average ranks); nan below 3 points or without variation."""

    if len(x) < 3:
        return float("nan")
    a, b = rankdata(x), rankdata(y)
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / den) if den else float("nan")


# --------------------------------------------------------------------------------------------
# data


@dataclasses.dataclass
class Group:
    """The records of one (kernel, shape): normalized records, resources, measured seconds."""

    name: str
    kernel: str
    records: list
    resources: list
    measured: Any  # a list while collected, then a numpy array of seconds


def group_name(rec: dict) -> str:
    shape = f"{rec['M']}x{rec['N']}" + (f"x{rec['K']}" if rec.get("K") else "")
    return f"{rec['kernel']}:{shape}"


def load_records(path: Path) -> list[dict]:
    """Records of a JSON-lines file (blank lines skipped). Raises ValueError naming the line."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
    return out


def prepare(records: list[dict], hw, compile: bool = False) -> list[Group]:
    """Groups of the records with a measured time (records with ``measured_s`` null are left out).
    Resources from the shipped ptxas table (``compile``: else compile with Triton)."""
    import numpy as np

    groups: dict[str, Group] = {}
    for i, rec in enumerate(records, start=1):
        t = rec.get("measured_s")
        if t is None or "peer" in rec:
            continue
        try:
            r = normalize(rec)
        except RecordError as e:
            raise ValueError(f"record {i}: {e}") from None
        name = group_name(r)
        g = groups.setdefault(name, Group(name, r["kernel"], [], [], []))
        g.records.append(r)
        g.resources.append(resources_for(r["kernel"], r["config"], hw, r["dtype"], compile=compile))
        g.measured.append(float(t))
    for g in groups.values():
        g.measured = np.asarray(g.measured)
    return list(groups.values())


def predict_group(g: Group, hw, coeffs):
    """Predicted seconds of a group's records on ``hw`` priced with ``coeffs`` (a fit under
    evaluation), through the same path as ``python -m sftctl.compiler.predict``."""
    import numpy as np

    return np.asarray(predict_records(g.records, load_target(hw).with_coeffs(coeffs), g.resources))


def ptxas_reg_base(groups: list[Group], hw, base) -> float | None:
    """``reg_base`` from ptxas: the median over the records' non-spilling GEMM configs of the
    compiled kernel's registers per thread minus the model's accumulator + fragment estimate
    (what the register estimate of configs never compiled uses). None without GEMM resources."""
    import numpy as np

    c0 = dataclasses.replace(base, reg_base=0)
    diffs, seen = [], set()
    for g in groups:
        if g.kernel != "gemm":
            continue
        for r, res in zip(g.records, g.resources):
            key = tuple(sorted(r["config"].items()))
            if not res or res.get("spill_bytes") or key in seen:
                continue
            seen.add(key)
            p = GemmProblem(batch=1, m=r["M"], n=r["N"], k=r["K"], dtype=r["dtype"])
            est = gemm_breakdown(p, hw, dict(r["config"], split_k=1, layout=0), c0)["regs_per_thread"]
            diffs.append(res["registers"] - est)
    return float(np.median(diffs)) if diffs else None


def peers_hbm_efficiency(peers: list[dict], hw) -> float | None:
    """Measured copy bandwidth (read + write bytes/s) over the datasheet peak, from the peers file."""
    for p in peers:
        if p.get("kernel") == "copy" and p.get("bytes_per_s"):
            return float(p["bytes_per_s"]) / hw.hbm_bytes_per_s
    return None


# --------------------------------------------------------------------------------------------
# objective and optimizer


def _pairs(measured):
    import numpy as np

    m = np.asarray(measured)
    i, j = np.nonzero(m[:, None] * PAIR_MARGIN < m[None, :])
    return i, j


def group_loss(pred, measured) -> float:
    import numpy as np

    pred = np.asarray(pred, dtype=float)
    if not np.all(np.isfinite(pred)) or np.any(pred <= 0):
        return 1e6
    lp, lm = np.log(pred), np.log(measured)
    err = float(np.mean((lp - lm) ** 2))
    i, j = _pairs(measured)
    if len(i):
        z = (lp[i] - lp[j]) / TAU
        rank = float(np.mean(np.logaddexp(0.0, z)) * TAU)
    else:
        rank = 0.0
    return err + RANK_WEIGHT * rank


def _to_unit(v, lo, hi):
    """Bounded value -> unconstrained (logit of the position; log scale for wide positive ranges)."""
    if lo > 0 and hi / lo > 20:
        lo, hi, v = math.log(lo), math.log(hi), math.log(v)
    u = min(max((v - lo) / (hi - lo), 1e-6), 1 - 1e-6)
    return math.log(u / (1 - u))


def _from_unit(z, lo, hi):
    u = 1.0 / (1.0 + math.exp(-max(min(z, 50.0), -50.0)))
    if lo > 0 and hi / lo > 20:
        return math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
    return lo + u * (hi - lo)


def nelder_mead_restarts(f, x0, step: float = 0.6, iters: int = 200, restarts: int = 2):
    """Minimize ``f`` from ``x0`` (:func:`sftctl.compiler.minimize.nelder_mead`, ``iters`` steps),
    then ``restarts`` more times from the best point so far, each with half the step before.
    Returns ``(x, f(x))``; ``x0`` itself when no search beats it."""
    import numpy as np

    best_x = np.asarray(x0, dtype=float)
    best_f = f(best_x)
    for _ in range(restarts + 1):
        x, fx = nelder_mead(f, best_x, step=step, iters=iters)
        if fx < best_f:
            best_x, best_f = x, fx
        step *= 0.5
    return best_x, best_f


def fit_params(groups: list[Group], hw, base, params: dict, iters: int = 200, restarts: int = 2):
    """Coefficients ``base`` with ``params`` (name -> (lo, hi)) fitted on ``groups``."""
    names = list(params)

    def coeffs_of(z):
        return dataclasses.replace(base, **{k: _from_unit(v, *params[k]) for k, v in zip(names, z)})

    def loss(z):
        c = coeffs_of(z)
        return sum(group_loss(predict_group(g, hw, c), g.measured) for g in groups) / max(len(groups), 1)

    z0 = [_to_unit(getattr(base, k), *params[k]) for k in names]
    # multi-start: the defaults and STARTS deterministic points spread over the bounded box
    # (a Halton-like pattern in the transformed space), a short search from each, then the
    # best one polished
    starts = [z0]
    for j in range(STARTS):
        starts.append([1.6 * math.sin(2.3 * (j + 1) * (i + 1) + 0.7 * j) for i in range(len(names))])
    short = [nelder_mead_restarts(loss, z, iters=max(iters // 4, 20), restarts=0) for z in starts]
    z, _ = min(short, key=lambda zf: zf[1])
    z, _ = nelder_mead_restarts(loss, z, iters=iters, restarts=restarts)
    return coeffs_of(z)


def fit(groups: list[Group], hw, base, iters: int = 200, restarts: int = 2):
    """Streaming coefficients on the row/elementwise groups, then GEMM ones on the GEMM groups."""
    stream = [g for g in groups if g.kernel != "gemm"]
    gemm = [g for g in groups if g.kernel == "gemm"]
    c = base
    if stream:
        c = fit_params(stream, hw, c, STREAM_PARAMS, iters, restarts)
    if gemm:
        c = fit_params(gemm, hw, c, GEMM_PARAMS, iters, restarts)
    return c


def quality(g: Group, pred) -> dict:
    import numpy as np

    pred = np.asarray(pred, dtype=float)
    ok = np.isfinite(pred)
    pick = int(np.argmin(np.where(ok, pred, np.inf)))
    r = np.log(pred[ok]) - np.log(g.measured[ok])
    return {"n": len(g.measured), "spearman": round(spearman(pred[ok], g.measured[ok]), 4),
            "pick_over_best": round(float(g.measured[pick] / g.measured.min()), 4),
            "rms_log_error": round(float(np.sqrt(np.mean(r * r))), 4),
            "median_pred_over_meas": round(float(np.exp(np.median(r))), 4),
            "worst_pred_over_meas": [round(float(np.exp(r.min())), 4), round(float(np.exp(r.max())), 4)],
            "n_infeasible": int((~ok).sum())}


def leave_one_shape_out(groups: list[Group], hw, base, iters: int = 200, restarts: int = 2) -> dict:
    """Per group: the quality of a fit on every other group, predicting this one."""
    out = {}
    for g in groups:
        rest = [h for h in groups if h is not g]
        same = [h for h in rest if (h.kernel == "gemm") == (g.kernel == "gemm")]
        params = GEMM_PARAMS if g.kernel == "gemm" else STREAM_PARAMS
        c = base
        if g.kernel == "gemm":  # streaming coefficients (launch) from all streaming records
            c = fit_params([h for h in rest if h.kernel != "gemm"], hw, base, STREAM_PARAMS, iters, restarts)
        c = fit_params(same, hw, c, params, iters, restarts) if same else c
        out[g.name] = quality(g, predict_group(g, hw, c))
    return out


def _shape_of(name: str) -> str:
    return name.split(":", 1)[1]


def leave_shape_out_all_kernels(groups: list[Group], hw, base, iters: int = 200, restarts: int = 2) -> dict:
    """Stricter: per shape (``MxN``), every kernel's group of that shape is left out of the fit
    at once (streaming coefficients then come from the other shape only); the GEMM shapes are
    distinct, so for GEMMs this equals :func:`leave_one_shape_out`."""
    out = {}
    for shape in dict.fromkeys(_shape_of(g.name) for g in groups if g.kernel != "gemm"):
        held = [g for g in groups if g.kernel != "gemm" and _shape_of(g.name) == shape]
        rest = [g for g in groups if g.kernel != "gemm" and _shape_of(g.name) != shape]
        c = fit_params(rest, hw, base, STREAM_PARAMS, iters, restarts) if rest else base
        for g in held:
            out[g.name] = quality(g, predict_group(g, hw, c))
    return out


# --------------------------------------------------------------------------------------------
# the calibration file


def _peers_summary(peers: list[dict], hw) -> dict:
    gemm, rows, copy = {}, {}, None
    for p in peers:
        if p.get("kernel") == "gemm":
            flops = 2.0 * p["M"] * p["N"] * p["K"] / p["measured_s"]
            gemm[p.get("shape_name") or f"{p['M']}x{p['N']}x{p['K']}"] = round(flops / hw.matrix_peak("bfloat16"), 4)
        elif p.get("kernel") in ("layernorm", "softmax", "bias_gelu"):
            moved = 2.0 * p["M"] * p["N"] * 2
            rows.setdefault(p["kernel"], {})[f"{p['M']}x{p['N']}"] = round(moved / p["measured_s"] / hw.hbm_bytes_per_s, 4)
        elif p.get("kernel") == "copy":
            copy = round(p["bytes_per_s"] / hw.hbm_bytes_per_s, 4)
    return {"cublas_bf16_fraction_of_peak": gemm, "eager_row_fraction_of_hbm_peak": rows,
            "copy_fraction_of_hbm_peak": copy,
            "note": "fractions of this accelerator's datasheet peaks (dense bf16 matrix FLOP/s, HBM bytes/s); "
                    "row kernels move 2 x M x N x 2 bytes (bf16 read + write)"}


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_fit(target: str, data: Path, loso: bool = True, iters: int = 200, restarts: int = 2) -> dict:
    """The calibration document for ``target`` from ``data/train.jsonl`` and ``data/peers.jsonl``."""
    hw = get_accelerator(target)
    train = Path(data) / "train.jsonl"
    peers_path = Path(data) / "peers.jsonl"
    peers = load_records(peers_path) if peers_path.exists() else []
    base = Coefficients.uncalibrated(hw)
    hbm = peers_hbm_efficiency(peers, hw)
    if hbm:
        base = dataclasses.replace(base, hbm_efficiency=round(hbm, 4))
    groups = prepare(load_records(train), hw)
    regs = ptxas_reg_base(groups, hw, base)
    if regs is not None:
        base = dataclasses.replace(base, reg_base=int(round(regs)))
    c = fit(groups, hw, base, iters, restarts)
    fitted = {k: round(getattr(c, k), 6) for k in (*STREAM_PARAMS, *GEMM_PARAMS)}
    fitted["hbm_efficiency"] = c.hbm_efficiency
    fitted["reg_base"] = c.reg_base
    c = dataclasses.replace(c, **fitted)
    defaults = {g.name: quality(g, predict_group(g, hw, base)) for g in groups}
    insample = {g.name: quality(g, predict_group(g, hw, c)) for g in groups}
    doc: dict[str, Any] = {
        "kind": "sftctl cost-model calibration", "schema": 1, "accelerator": hw.name,
        "date": _dt.date.today().isoformat(),
        "data": {"train": str(train.relative_to(CALIBRATION_DIR.parent)) if train.is_relative_to(CALIBRATION_DIR.parent) else str(train),
                 "train_sha256": _sha256(train), "records": sum(len(g.records) for g in groups),
                 "source": "H200 SXM measurements (triton.testing.do_bench median), calibrations/data/h200; "
                           "see calibrations/data/h200/SOURCE.json"},
        "method": {"objective": f"mean over (kernel, shape) of mean squared log error + {RANK_WEIGHT} x "
                                f"pairwise softplus ranking term (tau {TAU}, pairs {PAIR_MARGIN}x apart)",
                   "optimizer": f"Nelder-Mead, {iters} iterations x {restarts + 1} starts, bounded transform",
                   "iters": iters, "restarts": restarts,
                   "fixed": {"hbm_efficiency": "peers copy bandwidth / datasheet HBM peak",
                             "reg_base": "median ptxas registers minus the model's estimate over the "
                                         "records' non-spilling GEMM configs (resources_sm90.json)"},
                   "stream_params": STREAM_PARAMS, "gemm_params": GEMM_PARAMS},
        "coefficients": fitted,
        "fit": {"defaults": defaults, "in_sample": insample,
                "note": "defaults: this model with the uncalibrated default coefficients. The model "
                        "before this calibration (no spill, stage-ring or streaming-kernel terms; "
                        "spilling configs infeasible) ranked the GEMM records with Spearman 0.61 "
                        "(4096^3, 11 of 88 configs 'infeasible') and 0.72 (8192x2304x768, 22 of "
                        "142), its picks measuring 1.94x and 1.19x the best; its row and "
                        "elementwise times did not depend on the config."},
        "carries_over": {k: {"from": v, "same": "GH100 die: SMs, clocks, L2, SM microarchitecture -> every "
                                                "fitted coefficient (efficiencies are fractions of the "
                                                "accelerator's own peaks, latencies multiply its own)",
                             "differs": "HBM3 3.35 TB/s vs HBM3e 4.8 TB/s and 80 vs 141 GB: taken from "
                                        "each accelerator's catalog entry"}
                         for k, v in carries_over().items() if v == hw.name},
        "peers": _peers_summary(peers, hw),
    }
    if loso:
        doc["fit"]["leave_one_shape_out"] = leave_one_shape_out(groups, hw, base, iters, restarts)
        doc["fit"]["leave_shape_out_all_kernels"] = leave_shape_out_all_kernels(groups, hw, base, iters, restarts)
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sftctl.compiler.calibration")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit coefficients and write the calibration JSON")
    f.add_argument("--target", default="h200")
    f.add_argument("--data", help="directory with train.jsonl and peers.jsonl (default: the shipped copy)")
    f.add_argument("--out", help="output JSON (default: calibrations/<target>.json in the package)")
    f.add_argument("--no-loso", action="store_true", help="skip the leave-one-shape-out refits")
    f.add_argument("--iters", type=int, default=200)
    ch = sub.add_parser("check", help="print the shipped calibration's quality tables")
    ch.add_argument("--target", default="h200")
    args = ap.parse_args(argv)
    try:
        hw = get_accelerator(args.target)
    except KeyError as e:
        print(f"calibration: --target: {e.args[0]}", file=sys.stderr)
        return 2
    if args.cmd == "check":
        doc = calibration_for(hw.name)
        if doc is None:
            print(f"calibration: no calibration for {hw.name}", file=sys.stderr)
            return 3
        print(json.dumps({"coefficients": doc["coefficients"], "fit": doc["fit"]}, indent=1))
        return 0
    data = Path(args.data) if args.data else DATA_DIR / hw.name.lower()
    if not (data / "train.jsonl").exists():
        print(f"calibration: --data: {data / 'train.jsonl'} does not exist", file=sys.stderr)
        return 2
    try:
        doc = run_fit(hw.name, data, loso=not args.no_loso, iters=args.iters)
    except ValueError as e:
        print(f"calibration: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else calibration_path(hw.name)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    _load_json.cache_clear()
    for part in ("in_sample", "leave_one_shape_out", "leave_shape_out_all_kernels"):
        for name, q in doc["fit"].get(part, {}).items():
            print(f"{part:20s} {name:28s} rho {q['spearman']:+.3f} pick/best {q['pick_over_best']:.3f} "
                  f"rms log {q['rms_log_error']:.3f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
