"""How far to trust a predicted step on each accelerator: ``calibrations/accuracy/<name>.json``.

One file per catalog accelerator names the sources its prediction rests on (measured kernels,
collectives, attention tables, end-to-end steps) and its error as a factor ``f``: the measured
step is expected within ``[predicted / f, predicted * f]``. An accelerator with no measured data
says so (``calibrated: false``) and carries the error of the published-steps check of issue 20.
Only ``json`` and ``pathlib`` are imported: the planner reads this for every offering.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

ACCURACY_DIR = Path(__file__).resolve().parent / "calibrations" / "accuracy"
#: the factor of an accelerator with no accuracy file (the uncalibrated figure)
DEFAULT_FACTOR = 1.84


@functools.lru_cache(maxsize=None)
def accuracy(name: str) -> dict:
    """``{"calibrated": bool, "sources": [str], "error": factor, "basis": str}`` of accelerator
    ``name`` (catalog spelling, any case); an unknown one is uncalibrated with :data:`DEFAULT_FACTOR`."""
    p = ACCURACY_DIR / f"{name.lower()}.json"
    if not p.exists():
        return {"calibrated": False, "sources": ["no accuracy file: nothing measured"], "error": DEFAULT_FACTOR,
                "basis": "uncalibrated default"}
    d = json.loads(p.read_text())
    return {"calibrated": bool(d["calibrated"]), "sources": list(d["sources"]), "error": float(d["error"]["factor"]),
            "basis": d["error"]["basis"]}


def interval(name: str, value: float) -> tuple[float, float]:
    """``value`` (a step time or a cost) divided and multiplied by ``name``'s error factor."""
    f = accuracy(name)["error"]
    return value / f, value * f


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two intervals intersect."""
    return a[0] <= b[1] and b[0] <= a[1]
