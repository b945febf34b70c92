"""How far to trust a predicted step on each accelerator: ``calibrations/accuracy/<name>.json``.

One file per catalog accelerator names the sources its prediction rests on (measured kernels,
collectives, attention tables, end-to-end steps) and its error as a factor ``f``: the measured
step is expected within ``[predicted / f, predicted * f]``; which file is an accelerator's is its
catalog entry's ``accuracy`` field. Where measured tables exist (H100, H200, B200, MI355X) the factor is cross-validated
(:mod:`sftctl.compiler.accuracy_cv`: GEMMs k-fold over shape buckets, the H200 step, and whole
published steps, the larger) and the collectives' own factor is kept apart, weighed by a plan's
communication share; A100-80GB's (and its die's A100-40GB) comes from its 16 published steps. An
accelerator with no measured data says so (``calibrated: false``) and carries the error of the
published-steps check of issue 20.
Only ``json``, ``math``, ``pathlib`` and the catalog's light loader are imported: the planner reads
this for every offering.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

ACCURACY_DIR = Path(__file__).resolve().parent / "calibrations" / "accuracy"
#: the factor of an accelerator with no accuracy file (the uncalibrated figure)
DEFAULT_FACTOR = 1.84


@functools.lru_cache(maxsize=None)
def accuracy(name: str) -> dict:
    """``{"calibrated": bool, "sources": [str], "error": factor, "basis": str}`` of accelerator
    ``name`` (catalog spelling, any case); one the catalog does not know, or whose entry names no
    ``accuracy`` file, is uncalibrated with :data:`DEFAULT_FACTOR`."""
    from sftctl.catalog.accelerators import find_accelerator

    acc = find_accelerator(name)
    p = ACCURACY_DIR / acc.accuracy if acc is not None and acc.accuracy else None
    if p is None or not p.exists():
        return {"calibrated": False, "sources": ["no accuracy file: nothing measured"], "error": DEFAULT_FACTOR,
                "basis": "uncalibrated default"}
    d = json.loads(p.read_text())
    out = {"calibrated": bool(d["calibrated"]), "sources": list(d["sources"]), "error": float(d["error"]["factor"]),
           "basis": d["error"]["basis"]}
    if "collectives_factor" in d["error"]:
        out["collectives_error"] = float(d["error"]["collectives_factor"])
    return out


def factor(name: str, comm_share: float = 0.0) -> float:
    """``name``'s error factor for a step whose exposed communication is ``comm_share`` (0..1) of
    it: ``exp(sqrt(ln(f)^2 + (comm_share ln(f_collectives))^2))`` where the file keeps the
    collectives' factor apart, else the file's factor."""
    a = accuracy(name)
    f, fc = a["error"], a.get("collectives_error")
    if not fc or comm_share <= 0:
        return f
    c = min(1.0, comm_share)
    return math.exp(math.sqrt(math.log(f) ** 2 + (c * math.log(fc)) ** 2))


def interval(name: str, value: float, comm_share: float = 0.0) -> tuple[float, float]:
    """``value`` (a step time or a cost) divided and multiplied by ``name``'s error factor
    (:func:`factor`, for a step with ``comm_share`` of exposed communication)."""
    f = factor(name, comm_share)
    return value / f, value * f


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two intervals intersect."""
    return a[0] <= b[1] and b[0] <= a[1]
