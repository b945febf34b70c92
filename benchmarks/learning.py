"""Do predictions learn from runs? Issue 35's "Learning" measure on the records we have.

The records are :data:`published_steps.RECORDS` (public figures, none from the five held-out
sources of issue 20; read, not edited, here). Every record is imported once through the real CLI
(``sftctl calibrate import`` of published_steps' own record format, into a fresh
``SFTCTL_HOME``): that predicts each record with the model (``predicted_step_s``) and stores its
kernel-time mix. Then:

* **Halves** (five draws, seeds 0..4): per GPU the records are shuffled and split in two halves;
  each half is imported (``sftctl calibrate import`` of the ``calibrate export`` lines, into a
  fresh ``SFTCTL_HOME``; ``calibrate show --json`` reads the history back) and the other half is
  predicted with that history (:func:`sftctl.history.calibrate`, as ``compile --json`` computes
  ``calibrated_step_s``: the record's model prediction, execution mode and kernel-time mix). Both
  halves take a turn, so each draw predicts every record once from the runs of the other half.
* **Leave one out**: each record predicted from the history of all the others (the rows the CLI
  stored, less that one; the same :func:`sftctl.history.calibrate`).

Reported per GPU, before (the model only, the peer measured in the same run) and after
(calibrated): the median predicted / measured, the spread (largest / smallest ratio), the error
factor of the interval and how often the measured step lies in it; and over matched groups (the
same job on several GPUs, published_steps' ``STRICT`` match) the cost regret of the pick, against
sorting by hourly price. ``after / before`` ratios are printed beside each.

    python benchmarks/learning.py                      # 5 draws + leave-one-out; results/learning.json
    python benchmarks/learning.py --draws 1 --gpus A100-80GB,H100 --no-loo --out /tmp/x.json
    python benchmarks/learning.py --rows FILE.jsonl    # reuse a ``calibrate export`` of the full import
    python benchmarks/learning.py --save-rows FILE.jsonl  # ... saved by this run
    python benchmarks/learning.py --rows FILE.jsonl --sweep  # + each coefficient's other values

The import predicts every record once with the compiler (minutes for the 70B models on a busy
machine; the compiler's disk cache makes a second run fast); the rest takes seconds.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import published_steps as published  # noqa: E402

SEEDS = (0, 1, 2, 3, 4)


def _env(home: Path) -> dict[str, str]:
    """A process environment whose sftctl state is ``home`` alone: no server, no config file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SFTCTL_")}
    return env | {"SFTCTL_HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg")}


def sftctl(home: Path, *args: str, cwd: Path | None = None) -> str:
    """Run the real CLI with state ``home``; stdout. Raises RuntimeError with stderr on failure."""
    exe = Path(sys.executable).with_name("sftctl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "sftctl"]
    p = subprocess.run([*cmd, *args], cwd=cwd, env=_env(home), capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"sftctl {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()[-2000:]}")
    return p.stdout


def import_records(records: list[dict], work: Path) -> list[dict]:
    """Every record through ``sftctl calibrate import`` (published_steps' format) into a fresh
    home, read back with ``calibrate export``: one exported row per record, in the records' order
    (``predicted_step_s``: the model's, ``features``: the kernel-time mix)."""
    (work / "examples").symlink_to(ROOT / "examples")  # entrypoints are relative to the import file
    src = work / "published.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    home = work / "home-all"
    sftctl(home, "calibrate", "import", str(src))
    rows = [json.loads(line) for line in sftctl(home, "calibrate", "export").splitlines() if line.strip()]
    if [(r["name"], r["accelerator"]) for r in rows] != [(r["name"], r["gpu"]) for r in records]:
        raise RuntimeError("calibrate export does not give the records back in their order")
    return rows


def stored_history(rows: list[dict], work: Path, tag: str) -> list:
    """``rows`` (exported lines) imported through the CLI into a fresh home, and read back with
    ``calibrate show --json``: the :class:`~sftctl.types.RunRecord` each plan there learns from."""
    from sftctl.types import RunRecord

    home = work / f"home-{tag}"
    f = work / f"{tag}.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sftctl(home, "calibrate", "import", str(f))
    runs = json.loads(sftctl(home, "calibrate", "show", "--json"))["runs"]
    if len(runs) != len(rows):
        raise RuntimeError(f"{tag}: {len(rows)} rows imported, {len(runs)} stored")
    return [RunRecord.from_dict(r) for r in runs]


def calibrated(row: dict, history: list) -> dict:
    """``row``'s prediction corrected by ``history`` as ``compile --json`` computes it (the row's
    model step, accelerator, execution mode and kernel-time mix; the exposed communication's share
    is the mix's ``collectives``)."""
    from sftctl.history import calibrate

    comm = (row.get("features") or {}).get("collectives", 0.0)
    return calibrate(row["predicted_step_s"], row["accelerator"], history, mode=row["mode"], features=row["features"],
                     comm_share=comm)


def evaluate(records: list[dict], predicted: list[dict]) -> dict:
    """Before / after figures of one set of out-of-sample predictions.

    ``predicted[i]``: ``{"model_s", "model_error", "calibrated_s", "error"}`` for ``records[i]``
    (seconds; error factors). Returns ``{"per_gpu": {gpu: {"records", "before": {...}, "after":
    {...}}}, "regret": {"groups", "before", "after", "price"}}`` where each per-GPU side has
    ``median`` (predicted / measured), ``spread`` (largest / smallest), ``error`` (the geometric mean
    error factor of the interval) and ``covered`` (the share of measured steps inside it)."""
    by: dict[str, list[tuple[dict, dict]]] = {}
    for r, p in zip(records, predicted):
        by.setdefault(r["gpu"], []).append((r, p))
    per_gpu = {}
    for gpu, pairs in sorted(by.items()):
        out: dict = {"records": len(pairs)}
        for side, step, err in (("before", "model_s", "model_error"), ("after", "calibrated_s", "error")):
            ratios = [p[step] / published.measured_s(r) for r, p in pairs]
            errs = [p[err] for _, p in pairs]
            out[side] = {"median": statistics.median(ratios), "spread": max(ratios) / min(ratios),
                         "error": math.exp(statistics.fmean(math.log(e) for e in errs)),
                         "covered": statistics.fmean(1.0 if 1 / e <= q <= e else 0.0 for q, e in zip(ratios, errs))}
        per_gpu[gpu] = out
    return {"per_gpu": per_gpu, "regret": regret(records, predicted)}


def regret(records: list[dict], predicted: list[dict]) -> dict:
    """The cost regret over published_steps' strictly matched groups (the same job on several
    GPUs) of the pick before (model) and after (calibrated), and of sorting by hourly price:
    ``{"groups": n, rule: {"mean", "max", "right"}}`` (regret: measured USD per token of the
    pick / the group's best - 1)."""
    gpus = sorted({r["gpu"] for r in records})
    usd = {g: p["usd_per_gpu_hour"] for g, p in published.on_demand_prices(gpus).items()}
    speed = {g: published.fastest_key(g) for g in gpus}
    out: dict = {}
    for side, step in (("before", "model_s"), ("after", "calibrated_s")):
        rows = [dict(r, measured_step_s=published.measured_s(r), predicted_step_s=p[step])
                for r, p in zip(records, predicted)]
        res = published.cost_regret(published.matched_groups(rows, published.STRICT), usd, speed)
        out["groups"] = res["summary"]["sftctl"]["groups"]
        out[side] = {k: res["summary"]["sftctl"][k] for k in ("mean", "max", "right")}
        out["price"] = {k: res["summary"]["price"][k] for k in ("mean", "max", "right")}
    return out


def _prediction(row: dict, got: dict) -> dict:
    """One out-of-sample prediction: the model's step and error factor (the prior ``calibrate``
    starts from), and the calibrated ones with the evidence."""
    return {"model_s": row["predicted_step_s"], "model_error": got["prior_error"], "calibrated_s": got["calibrated_step_s"],
            "error": got["error"], "correction": got["correction"], "weight": got["weight"], "runs": got["runs"]}


def halves(records: list[dict], rows: list[dict], seed: int, work: Path) -> list[dict]:
    """One draw: per GPU a random half (``seed``) imported, the other half predicted, then the
    other way round; each record's out-of-sample prediction, in the records' order. Each half's
    history is imported through the CLI (:func:`stored_history`, under ``work``)."""
    return _halves(records, rows, seed, lambda idx, tag: stored_history([rows[i] for i in idx], work, tag))


def _halves(records: list[dict], rows: list[dict], seed: int, history_of: Callable[[list[int], str], list]) -> list[dict]:
    """:func:`halves` with each half's run history ``history_of(indices, tag)`` (the CLI's round
    trip, or the rows in process: :func:`sweep`)."""
    rng = random.Random(seed)
    by: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by.setdefault(r["gpu"], []).append(i)
    first: set[int] = set()
    for gpu in sorted(by):
        idx = by[gpu][:]
        rng.shuffle(idx)
        first |= set(idx[: len(idx) // 2])
    second = set(range(len(records))) - first
    out: dict[int, dict] = {}
    for tag, known, unknown in (("a", first, second), ("b", second, first)):
        history = history_of(sorted(known), f"seed{seed}-{tag}")
        for i in unknown:
            out[i] = _prediction(rows[i], calibrated(rows[i], history))
    return [out[i] for i in range(len(records))]


def leave_one_out(records: list[dict], rows: list[dict], work: Path) -> list[dict]:
    """Each record predicted from the history of all the others (the full import's stored rows,
    less that one)."""
    history = stored_history(rows, work, "loo")
    if [h.name for h in history] != [r["name"] for r in rows]:
        raise RuntimeError("calibrate show does not give the rows back in their order")
    return [_prediction(rows[i], calibrated(rows[i], history[:i] + history[i + 1:])) for i in range(len(records))]


def _mean_over(draws: list[dict]) -> dict:
    """Per GPU and side, the median over draws of each figure; the regret's mean over draws."""
    per_gpu: dict = {}
    for gpu in draws[0]["per_gpu"]:
        per_gpu[gpu] = {"records": draws[0]["per_gpu"][gpu]["records"]}
        for side in ("before", "after"):
            per_gpu[gpu][side] = {k: statistics.median(d["per_gpu"][gpu][side][k] for d in draws)
                                  for k in ("median", "spread", "error", "covered")}
    reg: dict = {"groups": draws[0]["regret"]["groups"]}
    for side in ("before", "after", "price"):
        vals = [d["regret"][side] for d in draws if d["regret"][side]["mean"] is not None]
        reg[side] = {"mean": statistics.fmean(v["mean"] for v in vals) if vals else None,
                     "max": max((v["max"] for v in vals), default=None),
                     "right": statistics.fmean(v["right"] for v in vals) if vals else None}
    return {"per_gpu": per_gpu, "regret": reg}


def report(label: str, ev: dict) -> None:
    """Print one evaluation: per GPU before / after and the after / before ratio."""
    print(f"{label}:")
    for gpu, g in ev["per_gpu"].items():
        b, a = g["before"], g["after"]
        print(f"  {gpu:10s} {g['records']:2d} records  median {b['median']:.3f} -> {a['median']:.3f} "
              f"(|log| x{_log_ratio(a['median'], b['median'])})  spread {b['spread']:.2f}x -> {a['spread']:.2f}x "
              f"(x{a['spread'] / b['spread']:.2f})  interval /x{b['error']:.2f} -> /x{a['error']:.2f} "
              f"(covers {b['covered']:.0%} -> {a['covered']:.0%})")
    r = ev["regret"]
    if r["groups"]:
        def fmt(s: dict) -> str:
            return f"mean {s['mean']:.1%} max {s['max']:.1%}"
        print(f"  pick over {r['groups']} matched groups: model {fmt(r['before'])}; calibrated {fmt(r['after'])}; "
              f"sorting by price {fmt(r['price'])}; right in {r['before']['right']:g} / {r['after']['right']:g} / "
              f"{r['price']['right']:g}")


#: each coefficient of :mod:`sftctl.history`'s calibration and the values ``--sweep`` tries in
#: place of its own (one at a time, the others kept)
SWEEP = {"NOISE_RATIO": (1.0, 1.5, 3.0, 4.0), "SIMILARITY_POWER": (1, 2, 8), "ACCELERATOR_SHARE": (0.25, 0.75),
         "CROSS_ACCELERATOR_SHARE": (0.0, 0.5, 0.9), "MIN_SCATTER_RUNS": (2, 6, 1000)}


def sweep(records: list[dict], rows: list[dict], draws: int) -> list[dict]:
    """How much each calibration coefficient matters: for its own value and each of
    :data:`SWEEP`'s, the halves (median over ``draws`` draws) and leave-one-out figures after
    learning, per GPU. In process: the histories are ``rows`` as
    :class:`~sftctl.types.RunRecord` (what ``calibrate show --json`` gives back: the same figures
    as the CLI's round trip at the coefficients' own values, which the first row shows)."""
    from sftctl import history
    from sftctl.types import RunRecord

    runs = [RunRecord.from_dict(r) for r in rows]

    def in_process(indices: list[int], tag: str) -> list:
        return [runs[i] for i in indices]

    def figures() -> dict:
        halves_ev = _mean_over([evaluate(records, _halves(records, rows, s, in_process)) for s in SEEDS[:draws]])
        loo = evaluate(records, [_prediction(rows[i], calibrated(rows[i], runs[:i] + runs[i + 1:]))
                                 for i in range(len(records))])
        return {"per_gpu": {g: {"halves": halves_ev["per_gpu"][g]["after"], "leave_one_out": loo["per_gpu"][g]["after"]}
                            for g in halves_ev["per_gpu"]},
                "regret": halves_ev["regret"]["after"]}

    out = [{"constant": None, "value": None, **figures()}]
    for name, values in SWEEP.items():
        own = getattr(history, name)
        try:
            for v in values:
                setattr(history, name, v)
                out.append({"constant": name, "value": v, **figures()})
        finally:
            setattr(history, name, own)
    print("sweep (after learning; halves: median over draws | leave one out):")
    for row in out:
        label = "own values" if row["constant"] is None else f"{row['constant']}={row['value']:g}"
        cells = "  ".join(f"{g} median {f['halves']['median']:.3f} spread {f['halves']['spread']:.2f}x covers "
                          f"{f['halves']['covered']:.0%} | {f['leave_one_out']['median']:.3f} "
                          f"{f['leave_one_out']['spread']:.2f}x {f['leave_one_out']['covered']:.0%}"
                          for g, f in row["per_gpu"].items() if f["halves"] and len(records) > 4)
        print(f"  {label:28s} {cells}  regret {row['regret']['mean']:.2%}")
    return out


def _log_ratio(after: float, before: float) -> str:
    lb = abs(math.log(before))
    return f"{abs(math.log(after)) / lb:.2f}" if lb > 1e-9 else "-"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def opt(name: str, default: str | None = None) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else default

    draws = int(opt("--draws", str(len(SEEDS))) or 0)
    gpus = set((opt("--gpus") or "").split(",")) - {""}
    out = Path(opt("--out") or ROOT / "benchmarks" / "results" / "learning.json")
    records = [r for r in published.RECORDS if not gpus or r["gpu"] in gpus]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sftctl-learning-") as tmp:
        work = Path(tmp)
        if opt("--rows"):
            rows = [json.loads(x) for x in Path(opt("--rows") or "").read_text().splitlines() if x.strip()]
            keyed = {(r["name"], r["accelerator"], r["measured_step_s"]): r for r in rows}
            rows = [keyed[(r["name"], r["gpu"], published.measured_s(r))] for r in records]
        else:
            rows = import_records(records, work)
            if opt("--save-rows"):  # the export, for --rows next time (the import is the slow part)
                Path(opt("--save-rows") or "").write_text("".join(json.dumps(r) + "\n" for r in rows))
        t_import = time.perf_counter() - t0
        print(f"{len(records)} records imported and predicted in {t_import:.0f} s "
              f"({', '.join(f'{g} {n}' for g, n in sorted(_count(records).items()))})")
        per_draw = []
        for seed in SEEDS[:draws]:
            ev = evaluate(records, halves(records, rows, seed, work))
            per_draw.append(dict(ev, seed=seed))
            report(f"draw {seed} (half imported, the other half predicted; both ways)", ev)
        doc: dict = {"records": len(records), "gpus": _count(records), "import_s": round(t_import, 1),
                     "rows_from": ("sftctl calibrate import of the records, exported: " + str(opt("--rows")))
                     if opt("--rows") else "sftctl calibrate import of the records, this run"}
        if per_draw:
            doc["halves"] = _mean_over(per_draw) | {"draws": per_draw}
            report(f"halves, median over {len(per_draw)} draws", doc["halves"])
        if "--no-loo" not in argv:
            doc["leave_one_out"] = evaluate(records, leave_one_out(records, rows, work))
            report("leave one out", doc["leave_one_out"])
        if "--sweep" in argv:
            doc["sweep"] = sweep(records, rows, draws or len(SEEDS))
    from sftctl import history

    doc["constants"] = {k: getattr(history, k) for k in ("NOISE_RATIO", "SIMILARITY_POWER", "UNKNOWN_SIMILARITY",
                                                          "OTHER_OFFERING_WEIGHT", "OTHER_MODE_WEIGHT",
                                                          "ACCELERATOR_SHARE", "CROSS_ACCELERATOR_SHARE",
                                                          "MIN_SCATTER_RUNS") if hasattr(history, k)}
    doc["rows"] = [{"name": r["name"], "gpu": r["gpu"], "measured_step_s": published.measured_s(r),
                    "predicted_step_s": w["predicted_step_s"], "features": w["features"], "mode": w["mode"]}
                   for r, w in zip(records, rows)]
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} ({doc['seconds']:.0f} s)")
    return 0


def _count(records: list[dict]) -> dict[str, int]:
    c: dict[str, int] = {}
    for r in records:
        c[r["gpu"]] = c.get(r["gpu"], 0) + 1
    return c


if __name__ == "__main__":
    sys.exit(main())
