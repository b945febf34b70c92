"""GEMM schedule search: Triton-style tile configs scored by the analytical cost model.

The space (:data:`SPACE`) is the cartesian product of BLOCK_M, BLOCK_N, split_k, num_warps (the
group *prefix*), BLOCK_K, num_stages, GROUP_M and the operand layout choice (the *suffix*):
840,000 candidates per GEMM class. :func:`search_gemm` is an exact branch-and-bound over it:

1. For each of the 1,000 prefix groups, :func:`~sftctl.compiler.costmodel.gemm_group_bound`
   gives a lower bound of the model's time of every member (the model's expression tree on
   best-case leaves; <= each member's time, in floating point too).
2. Groups are sorted by (bound, group index) and scored in growing batches, all members of a
   batch at once (numpy broadcasting over ``batch x |suffix|``).
3. It stops before the next group whose bound exceeds the best time found, or equals it with a
   larger group index: ties are broken lexicographically on the config tuple in :data:`ORDER`
   (prefix first), i.e. the smallest flat index of the exhaustive enumeration, so the result is
   exactly :func:`exhaustive_gemm`'s, config included.

Results are memoized by (problem, hardware fields, coefficients, space).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from sftctl.compiler.costmodel import (
    LAYOUTS, Coefficients, GemmProblem, gemm_group_bound, gemm_time_s,
)
from sftctl.compiler.hardware import Accelerator

PREFIX = ("BLOCK_M", "BLOCK_N", "split_k", "num_warps")
SUFFIX = ("BLOCK_K", "num_stages", "GROUP_M", "layout")
#: Enumeration order of the space; also the lexicographic tie-break order of configs.
ORDER = PREFIX + SUFFIX

#: The full schedule space (layout: index into ``costmodel.LAYOUTS``).
SPACE: dict[str, tuple[int, ...]] = {
    "BLOCK_M": (16, 32, 64, 128, 256),
    "BLOCK_N": (16, 32, 64, 128, 256),
    "split_k": (1, 2, 3, 4, 6, 8, 12, 16),
    "num_warps": (1, 2, 4, 8, 16),
    "BLOCK_K": (16, 32, 64, 128, 256),
    "num_stages": (1, 2, 3, 4, 5, 6, 7),
    "GROUP_M": (1, 2, 4, 8, 16, 32),
    "layout": (0, 1, 2, 3),
}


@dataclass(frozen=True)
class GemmChoice:
    """The best schedule of one GEMM class and what finding it took.

    ``config`` is None (and ``time_s`` inf) when no candidate is feasible. ``n_scored`` counts
    candidates whose time was computed; ``n_infeasible`` those of them that were infeasible.
    ``seconds`` is the search's wall time (of the original search when ``cached``).
    """

    config: dict | None
    time_s: float
    n_candidates: int
    n_scored: int
    n_infeasible: int
    seconds: float
    n_groups: int = 0
    n_groups_scored: int = 0
    pruned: bool = True
    cached: bool = False


def _normalize(space: dict | None) -> dict[str, tuple[int, ...]]:
    space = SPACE if space is None else space
    out = {}
    for key in ORDER:
        vals = space.get(key, SPACE[key])
        if key == "layout":
            vals = [LAYOUTS.index(v) if isinstance(v, str) else int(v) for v in vals]
        vals = tuple(sorted({int(v) for v in vals}))
        if not vals:
            raise ValueError(f"schedule space: {key} has no values")
        out[key] = vals
    return out


def _axes(vals: dict, keys: tuple[str, ...], lead: int = 0) -> dict[str, np.ndarray]:
    """Per-key float arrays shaped to broadcast over ``lead`` leading axes + ``keys``."""
    n = lead + len(keys)
    out = {}
    for i, key in enumerate(keys):
        shape = [1] * n
        shape[lead + i] = len(vals[key])
        out[key] = np.asarray(vals[key], dtype=np.float64).reshape(shape)
    return out


def schedule_space(problem: GemmProblem | None = None, hw: Accelerator | None = None,
                   space: dict | None = None) -> dict[str, np.ndarray]:
    """The full cartesian space as flat int64 arrays, in :data:`ORDER` (row-major).

    The space does not depend on the problem or hardware (kept in the signature for callers
    that will specialise it); the model marks what a given hardware can not run as infeasible.
    """
    vals = _normalize(space)
    grids = np.meshgrid(*(np.asarray(vals[k], dtype=np.int64) for k in ORDER), indexing="ij")
    return {k: g.reshape(-1) for k, g in zip(ORDER, grids)}


def _config(vals: dict, rank: int) -> dict:
    dims = [len(vals[k]) for k in ORDER]
    idx = np.unravel_index(rank, dims)
    cfg: dict = {k: int(vals[k][int(i)]) for k, i in zip(ORDER, idx)}
    cfg["layout"] = LAYOUTS[cfg["layout"]]
    return cfg


def _freeze(v):
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    return v


def _hw_key(hw: Accelerator) -> tuple:
    return tuple((f.name, _freeze(getattr(hw, f.name))) for f in dataclasses.fields(hw) if f.name != "sources")


_CACHE: OrderedDict = OrderedDict()
_CACHE_MAX = 4096


def clear_cache() -> None:
    _CACHE.clear()


def _memo(kind: str, problem, hw, coeffs, vals, compute):
    key = (kind, problem, _hw_key(hw), coeffs, tuple(vals.items()))
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return dataclasses.replace(hit, config=dict(hit.config) if hit.config else None, cached=True)
    choice = compute()
    _CACHE[key] = choice
    if len(_CACHE) > _CACHE_MAX:
        _CACHE.popitem(last=False)
    return dataclasses.replace(choice, config=dict(choice.config) if choice.config else None)


def exhaustive_gemm(problem: GemmProblem, hw: Accelerator, coeffs: Coefficients,
                    space: dict | None = None, use_cache: bool = True) -> GemmChoice:
    """Score every candidate; the reference :func:`search_gemm` must agree with."""
    c = coeffs
    vals = _normalize(space)

    def run() -> GemmChoice:
        t0 = time.perf_counter()
        axes = _axes(vals, ORDER[1:], lead=1)
        n_inner = math.prod(len(vals[k]) for k in ORDER[1:])
        best_t, best_rank, n_inf = math.inf, -1, 0
        for i, bm in enumerate(vals["BLOCK_M"]):  # one BLOCK_M slice at a time: bounded memory
            cands = dict(axes, BLOCK_M=np.full((1,) * len(ORDER), float(bm)))
            t = np.ascontiguousarray(gemm_time_s(problem, hw, cands, c)).reshape(-1)
            n_inf += int(np.count_nonzero(~np.isfinite(t)))
            j = int(np.argmin(t))
            if t[j] < best_t:  # strict: earlier slices win ties (smaller flat index)
                best_t, best_rank = float(t[j]), i * n_inner + j
        n = len(vals["BLOCK_M"]) * n_inner
        return GemmChoice(config=_config(vals, best_rank) if best_rank >= 0 else None, time_s=best_t,
                          n_candidates=n, n_scored=n, n_infeasible=n_inf,
                          seconds=time.perf_counter() - t0,
                          n_groups=math.prod(len(vals[k]) for k in PREFIX),
                          n_groups_scored=math.prod(len(vals[k]) for k in PREFIX), pruned=False)

    return _memo("exhaustive", problem, hw, c, vals, run) if use_cache else run()


def search_gemm(problem: GemmProblem, hw: Accelerator, coeffs: Coefficients,
                prune: bool = True, space: dict | None = None, use_cache: bool = True,
                measured: dict | None = None, measure=None, max_measure: int = 32) -> GemmChoice:
    """The model's best schedule for ``problem`` on ``hw`` (branch-and-bound; exact).

    ``prune=False`` is :func:`exhaustive_gemm`. ``space`` restricts the values per key (default
    :data:`SPACE`). ``use_cache=False`` bypasses the memo (benchmarks).

    Measured resources (the occupancy hook; ``codegen/targets.py``):

    * ``measured``: config (dict, or its :func:`config_key` tuple) -> resources of its compiled
      kernel (``KernelResources``, or None / :data:`UNCOMPILABLE` when the backend refused it).
      Those configs are scored with their measured registers and shared memory; one that does
      not fit is infeasible. Each group's lower bound becomes ``min(bound, measured members'
      times)``, so the search stays exact for the model with measurements.
    * ``measure``: ``config -> resources`` (``targets.gemm_measurer(problem, hw)``): the winner
      is compiled and measured, and the search repeats until the winner is a measured config
      (at most ``max_measure`` compiles; then the best measured feasible config is returned).
    Searches with measurements are not memoized.
    """
    if measured or measure is not None:
        return _search_measured(problem, hw, coeffs, prune, space, measured, measure, max_measure)
    if not prune:
        return exhaustive_gemm(problem, hw, coeffs, space, use_cache)
    c = coeffs
    vals = _normalize(space)
    run = functools.partial(_branch_and_bound, problem, hw, c, vals)
    return _memo("bnb", problem, hw, c, vals, run) if use_cache else run()


def _branch_and_bound(problem: GemmProblem, hw: Accelerator, c: Coefficients, vals: dict,
                      measured_ranks: dict | None = None) -> GemmChoice:
    """``measured_ranks``: flat rank -> measured time; those ranks' scores are replaced."""
    t0 = time.perf_counter()
    prefix_axes = _axes(vals, PREFIX)
    bound = np.array(
        np.broadcast_to(gemm_group_bound(problem, hw, prefix_axes, {k: vals[k] for k in SUFFIX}, c),
                        tuple(len(vals[k]) for k in PREFIX))).reshape(-1)
    n_groups = bound.size
    per_group0 = math.prod(len(vals[k]) for k in SUFFIX)
    by_group: dict[int, list[tuple[int, float]]] = {}
    for rank, mt in (measured_ranks or {}).items():
        g = rank // per_group0
        by_group.setdefault(g, []).append((rank % per_group0, mt))
        if mt < bound[g]:
            bound[g] = mt
    grids = np.meshgrid(*(np.asarray(vals[k], dtype=np.float64) for k in PREFIX), indexing="ij")
    pvals = {k: g.reshape(-1) for k, g in zip(PREFIX, grids)}
    order = np.lexsort((np.arange(n_groups), bound))
    suffix_axes = _axes(vals, SUFFIX, lead=1)
    per_group = math.prod(len(vals[k]) for k in SUFFIX)

    best_t, best_rank, best_g = math.inf, -1, -1
    n_scored = n_inf = 0
    pos, batch = 0, 4
    while pos < n_groups:
        idx = order[pos:pos + batch]
        b = bound[idx]
        # Stop at the first group that can neither beat nor tie-win against the best so far.
        stop = (b > best_t) | ((b == best_t) & (idx > best_g)) | ~np.isfinite(b)
        if stop.any():
            idx = idx[:int(np.argmax(stop))]
        if idx.size == 0:
            break
        cands = dict(suffix_axes)
        for k in PREFIX:
            cands[k] = pvals[k][idx].reshape((-1,) + (1,) * len(SUFFIX))
        t = np.array(gemm_time_s(problem, hw, cands, c)).reshape(idx.size, per_group)
        if by_group:
            for row, g in enumerate(idx):
                for col, mt in by_group.get(int(g), ()):
                    t[row, col] = mt
        n_scored += t.size
        n_inf += int(np.count_nonzero(~np.isfinite(t)))
        m = float(t.min())
        if math.isfinite(m) and m <= best_t:
            rows, cols = np.nonzero(t == m)
            ranks = idx[rows].astype(np.int64) * per_group + cols
            r = int(ranks.min())
            if m < best_t or r < best_rank:
                best_t, best_rank, best_g = m, r, r // per_group
        pos += idx.size
        if stop.any():
            break
        batch = min(batch * 2, 64)
    return GemmChoice(config=_config(vals, best_rank) if best_rank >= 0 else None, time_s=best_t,
                      n_candidates=n_groups * per_group, n_scored=n_scored, n_infeasible=n_inf,
                      seconds=time.perf_counter() - t0, n_groups=n_groups,
                      n_groups_scored=n_scored // per_group, pruned=True)


@dataclass(frozen=True)
class GemmCandidate:
    """One of :func:`top_k_gemm`'s schedules: ``config``, the model's ``time_s`` and the second
    costs that break its ties (:func:`tie_break_costs`): ``segments`` (contiguous row segments
    loaded and stored), ``traffic_s`` (HBM + L2 traffic at their peak bandwidths, s), then
    ``footprint_bytes`` (registers + shared memory of one block)."""

    config: dict
    time_s: float
    segments: float
    traffic_s: float
    footprint_bytes: float


def _tie_time(t: float) -> float:
    """Model times equal to 9 significant digits are a tie (floating-point noise of equal terms)."""
    return float(f"{t:.9g}")


def tie_break_costs(problem: GemmProblem, hw: Accelerator, coeffs: Coefficients,
                    configs: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The second costs that order schedules of equal model time (:func:`top_k_gemm`), one
    entry per config:

    * ``segments``: contiguous row segments the kernel's loads and stores touch (memory
      transactions and address arithmetic for the same bytes): per tile and K step, a row-major
      A tile is ``BLOCK_M`` rows of ``BLOCK_K`` elements (stored K x M: ``BLOCK_K`` rows), a
      row-major B tile ``BLOCK_K`` rows (stored N x K: ``BLOCK_N``), plus ``BLOCK_M`` rows of C;
      on the H200 calibration set's 52 groups of configs the model ties, the fewest segments
      was never slower than the enumeration order's pick and faster in 6 (mean 1.018x the
      group's best measured, against 1.027x; worst 1.16x against 1.21x);
    * ``traffic`` (s): the model's HBM + L2 traffic terms (``t_hbm + t_l2``);
    * ``footprint`` (bytes): registers + shared memory of one block.
    """
    from sftctl.compiler.costmodel import _evaluate

    arrays = {x: np.asarray([cf.get(x, 8 if x == "GROUP_M" else (1 if x == "split_k" else 0)) if x != "layout"
                             else (LAYOUTS.index(cf[x]) if isinstance(cf.get(x), str) else cf.get(x, 0))
                             for cf in configs], dtype=np.float64) for x in ORDER}
    n = len(configs)
    terms = _evaluate(problem, hw, arrays, coeffs, terms=True)
    traffic = np.broadcast_to(terms["t_hbm"] + terms["t_l2"], (n,))
    foot = np.broadcast_to(terms["regs_per_thread"] * 4.0 * 32.0 * arrays["num_warps"] + terms["smem_bytes"], (n,))
    bm, bn, bk, sk = arrays["BLOCK_M"], arrays["BLOCK_N"], arrays["BLOCK_K"], arrays["split_k"]
    steps = np.ceil(np.ceil(problem.k / sk) / bk)
    a_rows = (bk if problem.a_transposed else bm) * steps
    b_rows = (bn if problem.b_transposed else bk) * steps
    tiles = problem.batch * np.ceil(problem.m / bm) * np.ceil(problem.n / bn) * sk
    segments = tiles * (a_rows + b_rows + bm)
    return segments, traffic, foot


def top_k_gemm(problem: GemmProblem, hw: Accelerator, coeffs: Coefficients, k: int = 8,
               space: dict | None = None) -> list[GemmCandidate]:
    """The ``k`` best feasible schedules by model time, best first ([] when none is feasible).

    Branch-and-bound as :func:`search_gemm`, keeping every candidate within the k-th best time
    (groups whose bound exceeds it are never scored). Ties of the model time (:func:`_tie_time`)
    are broken by physics, never by enumeration order (:func:`tie_break_costs`): fewer
    contiguous row segments loaded and stored first (the same bytes in fewer, longer
    transactions), then less memory traffic (the ``t_hbm + t_l2`` terms), then the smaller
    per-block footprint (registers + shared memory: room for co-resident blocks); only configs
    equal in all of them keep the space's order.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    c = coeffs
    vals = _normalize(space)
    prefix_axes = _axes(vals, PREFIX)
    bound = np.array(
        np.broadcast_to(gemm_group_bound(problem, hw, prefix_axes, {x: vals[x] for x in SUFFIX}, c),
                        tuple(len(vals[x]) for x in PREFIX))).reshape(-1)
    n_groups = bound.size
    grids = np.meshgrid(*(np.asarray(vals[x], dtype=np.float64) for x in PREFIX), indexing="ij")
    pvals = {x: g.reshape(-1) for x, g in zip(PREFIX, grids)}
    order = np.lexsort((np.arange(n_groups), bound))
    suffix_axes = _axes(vals, SUFFIX, lead=1)
    per_group = math.prod(len(vals[x]) for x in SUFFIX)
    pool_t, pool_r = np.empty(0), np.empty(0, dtype=np.int64)
    kth = math.inf
    pos, batch = 0, 4
    while pos < n_groups:
        idx = order[pos:pos + batch]
        stop = (bound[idx] > kth * (1 + 1e-9)) | ~np.isfinite(bound[idx])
        if stop.any():
            idx = idx[:int(np.argmax(stop))]
        if idx.size:
            cands = dict(suffix_axes)
            for x in PREFIX:
                cands[x] = pvals[x][idx].reshape((-1,) + (1,) * len(SUFFIX))
            t = np.array(gemm_time_s(problem, hw, cands, c)).reshape(-1)
            ranks = (idx.astype(np.int64)[:, None] * per_group + np.arange(per_group)[None, :]).reshape(-1)
            ok = np.isfinite(t) & (t <= kth * (1 + 1e-9))
            pool_t, pool_r = np.concatenate([pool_t, t[ok]]), np.concatenate([pool_r, ranks[ok]])
            if pool_t.size >= k:
                kth = float(np.partition(pool_t, k - 1)[k - 1])
                keep = pool_t <= kth * (1 + 1e-9)
                pool_t, pool_r = pool_t[keep], pool_r[keep]
        pos += max(idx.size, 1)
        if stop.any():
            break
        batch = min(batch * 2, 64)
    if not pool_t.size:
        return []
    cfgs = [_config(vals, int(r)) for r in pool_r]
    segments, traffic, foot = tie_break_costs(problem, hw, c, cfgs)
    keyed = sorted(range(pool_t.size), key=lambda i: (_tie_time(float(pool_t[i])), float(segments[i]), float(traffic[i]),
                                                       float(foot[i]), int(pool_r[i])))
    return [GemmCandidate(cfgs[i], float(pool_t[i]), float(segments[i]), float(traffic[i]), float(foot[i]))
            for i in keyed[:k]]


# --------------------------------------------------------------------------------------------
# Torch Inductor's default mm configs (the baseline the search is compared against)

#: Copy of ``BaseConfigHeuristic.mm_configs`` (used by ``CUDAConfigHeuristic``) in torch 2.13.0,
#: torch/_inductor/template_heuristics/triton.py: (BLOCK_M, BLOCK_N, BLOCK_K, num_stages,
#: num_warps), GROUP_M=8. Used when that import fails.
_INDUCTOR_MM_CONFIGS_2_13 = (
    (32, 32, 16, 1, 2), (32, 32, 128, 2, 4), (32, 64, 32, 5, 8), (64, 32, 32, 5, 8),
    (64, 32, 128, 5, 4), (64, 64, 16, 2, 4), (64, 64, 32, 2, 4), (64, 64, 64, 3, 8),
    (64, 64, 128, 5, 4), (64, 128, 32, 3, 4), (64, 128, 32, 4, 8), (64, 128, 64, 3, 4),
    (64, 128, 128, 4, 4), (128, 64, 32, 3, 4), (128, 64, 32, 4, 8), (128, 128, 32, 2, 8),
    (128, 128, 32, 3, 4), (128, 128, 64, 3, 4), (128, 128, 64, 5, 8), (128, 128, 128, 4, 8),
    (128, 256, 64, 4, 8),
)


def _as_config(bm, bn, bk, stages, warps, group_m=8) -> dict:
    return {"BLOCK_M": int(bm), "BLOCK_N": int(bn), "BLOCK_K": int(bk), "num_warps": int(warps),
            "num_stages": int(stages), "split_k": 1, "GROUP_M": int(group_m), "layout": "as_is"}


@functools.lru_cache(maxsize=None)
def _inductor_mm_configs(source: str) -> tuple:
    if source in ("auto", "torch"):
        try:  # lazy: importing torch._inductor takes seconds
            from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic

            confs = tuple((x.block_m, x.block_n, x.block_k, x.num_stages, x.num_warps,
                           getattr(x, "group_m", 8) or 8) for x in CUDAConfigHeuristic().mm_configs)
            if confs:
                return confs
        except Exception:
            if source == "torch":
                raise
    return tuple(t + (8,) for t in _INDUCTOR_MM_CONFIGS_2_13)


def inductor_mm_configs(source: str = "auto") -> list[dict]:
    """Inductor's default Triton mm configs for CUDA, as config dicts in our keys.

    ``source``: ``torch`` (from the installed torch; raises if the import path moved),
    ``fallback`` (the hard-coded copy of torch 2.13.0's list), ``auto`` (torch, else fallback).
    """
    if source not in ("auto", "torch", "fallback"):
        raise ValueError(f"source must be auto, torch or fallback, not {source!r}")
    return [_as_config(*t) for t in _inductor_mm_configs(source)]


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def inductor_scaled_configs(problem: GemmProblem, configs: list[dict] | None = None) -> list[dict]:
    """The configs Inductor would autotune for ``problem``: its ``_scale_mm_configs`` (block sizes
    clamped to the next power of two of m, n, k, at least 16) and ``_finalize_mm_configs``
    (``num_warps = min(num_warps, BLOCK_M * BLOCK_N // 256)``, duplicates dropped)."""
    configs = inductor_mm_configs() if configs is None else configs
    m_hint = max(_next_power_of_2(problem.m), 16)
    n_hint = max(_next_power_of_2(problem.n), 16)
    k_hint = max(_next_power_of_2(problem.k), 16)
    out, seen = [], set()
    for cfg in configs:
        bm = max(min(cfg["BLOCK_M"], m_hint), 16)
        bn = max(min(cfg["BLOCK_N"], n_hint), 16)
        bk = max(min(cfg["BLOCK_K"], k_hint), 16)
        warps = max(1, min(cfg["num_warps"], bm * bn // 256))
        new = dict(cfg, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
        key = tuple(new[k] for k in ORDER)
        if key not in seen:
            seen.add(key)
            out.append(new)
    return out


def _resource_arrays(resources) -> dict:
    """``regs_per_thread``/``smem_bytes`` arrays from measured resources (NaN where None).

    An entry may be a ``codegen.targets.KernelResources`` (anything with ``registers`` and
    ``shared_bytes``, optionally ``spill_bytes``), None (not measured: the model's estimate) or
    :data:`UNCOMPILABLE` (the backend refused the schedule: infeasible). Spilled bytes cost time
    (``Coefficients.spill_bytes_per_clk``); they do not make a config infeasible.
    """
    regs, smem, spill = [], [], []
    for r in resources:
        if r is None:
            regs.append(np.nan)
            smem.append(np.nan)
            spill.append(np.nan)
        elif r is UNCOMPILABLE:
            regs.append(np.inf)
            smem.append(np.inf)
            spill.append(np.nan)
        else:
            regs.append(float(r.registers))
            smem.append(float(r.shared_bytes))
            spill.append(float(getattr(r, "spill_bytes", 0) or 0))
    return {"regs_per_thread": np.asarray(regs), "smem_bytes": np.asarray(smem),
            "spill_bytes": np.asarray(spill)}


#: Marks a measured config whose kernel the backend could not compile (infeasible).
UNCOMPILABLE = object()


def evaluate_configs(problem: GemmProblem, hw: Accelerator, configs: list[dict],
                     coeffs: Coefficients, resources: list | None = None) -> np.ndarray:
    """The model's time of each config dict (``inf`` where infeasible).

    ``resources``: optional measured resources per config (same length; entries as in
    :func:`_resource_arrays`): their registers and shared memory replace the model's estimates
    in the occupancy term, and a config that does not fit is ``inf``.
    """
    if not configs:
        return np.zeros(0)
    cands = {k: np.asarray([cfg.get(k, SPACE[k][0] if k != "GROUP_M" else 8) for cfg in configs])
             for k in ORDER}
    if resources is not None:
        if len(resources) != len(configs):
            raise ValueError("evaluate_configs: resources must align with configs")
        cands.update(_resource_arrays(resources))
    return np.asarray(gemm_time_s(problem, hw, cands, coeffs), dtype=np.float64)


# --------------------------------------------------------------------------------------------
# Measured resources (the occupancy hook)


def config_key(config: dict) -> tuple:
    """A config as a hashable tuple in :data:`ORDER` (layout as its index)."""
    out = []
    for k in ORDER:
        v = config.get(k, 8 if k == "GROUP_M" else (1 if k == "split_k" else (0 if k == "layout" else None)))
        if k == "layout" and isinstance(v, str):
            v = LAYOUTS.index(v)
        if v is None:
            raise ValueError(f"config misses {k}")
        out.append(int(v))
    return tuple(out)


def _rank_of(vals: dict, key: tuple) -> int | None:
    """Flat rank of a config key in the normalized space, None when outside it."""
    idx = []
    for k, v in zip(ORDER, key):
        if v not in vals[k]:
            return None
        idx.append(vals[k].index(v))
    return int(np.ravel_multi_index(idx, [len(vals[k]) for k in ORDER]))


def _search_measured(problem, hw, coeffs, prune, space, measured, measure, max_measure) -> GemmChoice:
    c = coeffs
    vals = _normalize(space)
    table: dict[tuple, object] = {}
    for cfg, res in (measured or {}).items():
        key = cfg if isinstance(cfg, tuple) else config_key(cfg)
        table[key] = UNCOMPILABLE if res is None else res
    t0 = time.perf_counter()
    n_compiles = 0
    while True:
        ranks = {}
        if table:
            keys = list(table)
            cfgs = [dict(zip(ORDER, k)) for k in keys]
            times = evaluate_configs(problem, hw, cfgs, c, [table[k] for k in keys])
            for k, mt in zip(keys, times):
                r = _rank_of(vals, k)
                if r is not None:
                    ranks[r] = float(mt)
        if prune:
            choice = _branch_and_bound(problem, hw, c, vals, ranks)
        else:
            choice = _exhaustive_measured(problem, hw, c, vals, ranks)
        if choice.config is None or measure is None:
            break
        key = config_key(choice.config)
        if key in table:
            break
        if n_compiles >= max_measure:  # give up: the best measured feasible config
            feasible = {r: t for r, t in ranks.items() if math.isfinite(t)}
            if not feasible:
                choice = dataclasses.replace(choice, config=None, time_s=math.inf)
            else:
                r = min(feasible, key=lambda x: (feasible[x], x))
                choice = dataclasses.replace(choice, config=_config(vals, r), time_s=feasible[r])
            break
        res = measure(dict(choice.config))
        table[key] = UNCOMPILABLE if res is None else res
        n_compiles += 1
    return dataclasses.replace(choice, seconds=time.perf_counter() - t0, cached=False)


def _exhaustive_measured(problem, hw, c, vals, ranks: dict) -> GemmChoice:
    choice = exhaustive_gemm(problem, hw, c, {k: list(v) for k, v in vals.items()}, use_cache=False)
    # rescore: the exhaustive minimum with measured configs replaced
    t0 = time.perf_counter()
    axes = _axes(vals, ORDER[1:], lead=1)
    n_inner = math.prod(len(vals[k]) for k in ORDER[1:])
    best_t, best_rank = math.inf, -1
    for i, bm in enumerate(vals["BLOCK_M"]):
        cands = dict(axes, BLOCK_M=np.full((1,) * len(ORDER), float(bm)))
        t = np.array(gemm_time_s(problem, hw, cands, c)).reshape(-1)
        for r, mt in ranks.items():
            if i * n_inner <= r < (i + 1) * n_inner:
                t[r - i * n_inner] = mt
        j = int(np.argmin(t))
        if t[j] < best_t:
            best_t, best_rank = float(t[j]), i * n_inner + j
    return dataclasses.replace(choice, config=_config(vals, best_rank) if best_rank >= 0 else None,
                               time_s=best_t, seconds=choice.seconds + time.perf_counter() - t0)
