"""Nelder-Mead minimization: the one simplex search the compiler's fits share
(:func:`sftctl.compiler.matmul_model.fit`, :mod:`sftctl.compiler.calibration`'s restarts).
Deterministic; numpy is imported inside the function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def nelder_mead(f: Callable[[Any], float], x0, *, step: float, iters: int) -> tuple[Any, float]:
    """Minimize ``f`` from ``x0`` by ``iters`` Nelder-Mead steps (reflection 1, expansion 2,
    contraction and shrink 0.5).

    Args:
        f: the objective, called with a float numpy vector of ``x0``'s length; deterministic.
        x0: the start (a float numpy vector, or anything ``np.asarray`` makes one of); the first
            simplex is ``x0`` and ``x0 + step * e_i`` for every axis ``i``.
        step: the first simplex's edge, in ``x0``'s units.
        iters: steps to take (no other stopping rule).

    Returns:
        ``(x, f(x))``: the best vertex of the last simplex (the first of equals) and its value.
    """
    import numpy as np

    x0 = np.asarray(x0, dtype=float)
    n = len(x0)
    pts = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        c = np.mean(pts[:-1], axis=0)
        xr = c + (c - pts[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = c + 2.0 * (c - pts[-1])
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = c + 0.5 * (pts[-1] - c)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    i = int(np.argmin(vals))
    return pts[i], vals[i]
