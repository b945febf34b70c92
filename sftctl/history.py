"""Predictions that learn from every run: a job's measured step time, and the correction the run
history gives each new prediction (issue 35, items 1 and 2).

**Measured step time** (:func:`measured_step_s`): the median of the reported ``step_time_s``
(seconds) over every rank, leaving out each rank's first :data:`WARMUP_STEPS` reports after
every (re)start (a report whose step is not above the rank's previous one starts again: a
resume) and every report marked ``checkpoint``. Fewer than :data:`MIN_MEASURED_STEPS` left: not
measured (None).

**Kernel-time mix** (:func:`kernel_mix`): the shares of a predicted step's time spent in
``attention``, ``gemm``, ``pointwise`` (pointwise, reduction and data-movement kernels) and
``collectives`` (the exposed communication), summing to 1. Two steps are alike by
:func:`similarity` = (1 - half the L1 distance of their mixes) ** :data:`SIMILARITY_POWER`, in
[0, 1]; where either mix is unknown, :data:`UNKNOWN_SIMILARITY`.

**Calibration** (:func:`calibrate`): a log-normal shrinkage toward the model, in two levels. For
a step the model predicts at ``p`` seconds on accelerator A, the true step is ``p * exp(c)``, with
prior ``c ~ N(0, s0**2)``, ``s0 = ln f`` and ``f`` A's cross-validated error factor
(:func:`sftctl.compiler.accuracy.factor`: the measured step lies within ``[p / f, p * f]``, read
as one standard deviation). ``c = a + e``: ``a`` is A's own bias, shared by every step on it
(clocks and power limit, driver and library versions, the host: the same H100 runs ~50 % slower
on one cloud than another, issue 35), with variance ``beta * s0**2``
(``beta`` = :data:`ACCELERATOR_SHARE`); ``e`` is this step's residual (how well the model prices
its kernel mix), ``(1 - beta) * s0**2``, and the residuals of two steps correlate by
:func:`similarity` of their kernel-time mixes. Each past run ``i`` on A gives ``r_i =
ln(measured_i / predicted_i) = a + e_i + noise``, the noise ``N(0, s_run**2 / v_i)``: ``s_run =
NOISE_RATIO * s0`` (what one measured figure says of its own step's truth) and ``v_i`` in
(0, 1] is :data:`OTHER_OFFERING_WEIGHT` when it ran on another offering (provider x instance
type) of A, times :data:`OTHER_MODE_WEIGHT` in another execution mode. In units of ``s0**2``::

    K_ij = beta + (1 - beta) sim(i, j) + [i == j] NOISE_RATIO**2 / v_i     the runs' covariance
    k_i  = beta + (1 - beta) sim(new, i)                                   each run's with c
    c_post  = k' K^-1 r                 calibrated step = p * exp(c_post)
    sd_post = s0 * sqrt(1 - k' K^-1 k)  STEP RANGE = calibrated /x exp(sd_post)

**Runs on other accelerators.** How well the model prices a step is partly the step's, whatever
it runs on: of 6 published steps measured on both an A100-80GB and an H100 (the same scripts,
``benchmarks/results/published_steps.json``), the residuals ``ln(measured / predicted)`` less
each GPU's mean correlate 0.90. So ``e`` on accelerator A is ``g + u_A``: ``g`` the step's own
residual, shared by every accelerator (variance ``G = (1 - beta) * rho * s_min**2``, ``rho`` =
:data:`CROSS_ACCELERATOR_SHARE`, ``s_min`` the narrowest prior width among the accelerators in
play, so that no accelerator's residual is smaller than its shared part), correlated between
steps by their similarity, and ``u_A`` the rest, A's alone. A run on accelerator B (no offering
weight: its offering is another by definition; the mode weight applies) then covaries with the new
step through ``G * sim`` only, and with runs on B through B's bias too. In units of ``s0**2``,
``q_i = s_i / s0`` and ``gamma = G / s0**2``::

    K_ij = [B_i == B_j] (beta q_i**2 + ((1 - beta) q_i**2 - gamma) sim(i, j)) + gamma sim(i, j)
           + [i == j] NOISE_RATIO**2 q_i**2 / v_i
    k_i  = [B_i == A] (beta + (1 - beta - gamma) sim(new, i)) + gamma sim(new, i)

which is the formula above when every run is on A. Twenty runs of this very step on another
accelerator of the same width move it ``20 gamma / (4 + 20)`` = 31 % of the way (``rho`` 0.75):
where a lab's runs show a model mispriced on one GPU, its other GPUs' predictions move with it, so
the pick does not shift toward the GPUs nobody ran it on. ``runs`` counts the runs on A;
``other_accelerator_runs`` those on others.

So ``n`` runs alike in every way (sim 1, this offering and mode) move the prediction ``n / (k +
n)`` of the way (in log, ``k = NOISE_RATIO**2 = 4``) to what they measured: one 20 %, twenty 83 %,
and the range narrows from ``f`` to ``f ** sqrt(4 / (4 + n))``. Runs of unlike steps (sim 0) still
speak for A's bias: one run each of twenty models unlike this one and each other moves it ``20 beta
/ (4 + 20 beta)`` = 71 % of the way to their mean; twenty runs of one unlike model are one model's
evidence, ``beta * 20 / (4 + 20)`` = 42 %. With no run on A nothing changes (``correction`` 1, the
model's interval).

**The runs' own scatter.** The Gaussian model reads runs that disagree as measurement noise, so
twenty runs of unlike models, each mispriced its own way, would narrow the range as if they had
pinned this step. The range is therefore never narrower than what the runs on A show themselves
(:func:`_scatter`): 1.645 x the weighted standard deviation of their ``r_i`` (weights: similarity to
the new step x offering x mode) x ``sqrt(1 + 1 / n)``, once they count :data:`MIN_SCATTER_RUNS`
effective runs. Runs that agree leave the Gaussian range; runs that scatter widen it, even past
``f``: on the 28 published steps' random halves, the learned range held 75 % (A100-80GB) and 70 %
(H100) of the other half without this, 81 % and 80 % with it (``benchmarks/learning.py``).

**Import** (:mod:`sftctl.history_import`): JSON Lines of measured runs from elsewhere; checked
whole before anything is predicted or stored (FILE:LINE errors; exit 2).

Only ``json``, ``math``, ``statistics`` and light sftctl modules are imported at module level:
the controller imports this module and ``sftctl plan`` reads it for every offering.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Iterable

from sftctl.compiler.accuracy import factor as error_factor
from sftctl.types import RunRecord, StepRecord

#: reports of each rank left out after every (re)start: compilation, allocator and cache warm-up
WARMUP_STEPS = 3
#: a job with fewer reported steps than this after warm-up is not measured
MIN_MEASURED_STEPS = 3
#: s_run / s0: how many prior widths one run of another step scatters around this step's truth.
#: 2 gives k = 4: one run moves a prediction 20 % of the way, twenty move it 83 %
NOISE_RATIO = 2.0
#: sharpens the kernel-mix similarity: mixes 10 % apart (L1/2) weigh 0.66, 35 % apart 0.18
SIMILARITY_POWER = 4
#: the similarity taken when a run or the new step has no kernel-time mix
UNKNOWN_SIMILARITY = 0.5
#: the weight of a run on another offering (provider x instance type) of the same accelerator:
#: the same chip can run ~50 % slower on one cloud than another (issue 35), so a run on this
#: offering says more
OTHER_OFFERING_WEIGHT = 0.5
#: the weight of a run in another execution mode (eager / default / sftensor)
OTHER_MODE_WEIGHT = 0.5
#: the share of the prior variance s0**2 that is the accelerator's own (clocks, power limit, driver and
#: library versions, the offering's host: shared by every step on it) rather than the step's
#: (how well the model prices this kernel mix). 1/2: neither level assumed the smaller; a run of
#: another model then still corrects a new model's step through the shared half
ACCELERATOR_SHARE = 0.5
#: ``rho``: the share of a step's own residual variance that every accelerator shares (module
#: docstring). The 6 published steps run on both A100-80GB and H100 correlate 0.90 once each GPU's
#: mean is taken out (benchmarks/results/published_steps.json); taken below that, for so few pairs
CROSS_ACCELERATOR_SHARE = 0.75
#: at most this many runs (the most alike, on this offering and mode, newest first) enter one
#: calibration: the posterior solves a dense system of that size
MAX_RUNS = 400
#: of those, at most this many runs on other accelerators (the most alike): each plan calibrates
#: every offering, and they speak only through a step's shared residual
MAX_OTHER_RUNS = 100
#: below this many effective runs (the square of the weights' sum over the sum of their squares) on
#: the accelerator, the range rests on the Gaussian model alone
MIN_SCATTER_RUNS = 3
#: solves of this many runs or more run BLAS on one thread (:func:`_one_blas_thread`)
BLAS_SINGLE_THREAD_FROM = 64
#: the kernel-mix keys, in this order
MIX_KEYS = ("attention", "gemm", "pointwise", "collectives")
#: where a run comes from: the lab's own jobs, or an import
SOURCES = ("run", "imported")


# ------------------------------------------------------------------------------ measuring


def measured_step_s(samples: Iterable[StepRecord | dict]) -> tuple[float | None, int]:
    """``(median step seconds after warm-up, how many reports it is the median of)`` of a job's
    reported steps (:class:`~sftctl.types.StepRecord` each, or dicts with its keys; oldest first
    per rank, as :meth:`sftctl.state.Store.step_series` returns them). ``(None, n)`` with fewer
    than :data:`MIN_MEASURED_STEPS` reports left."""
    kept: list[float] = []
    seen: dict[int, tuple[int, int]] = {}  # rank -> (last step, reports since its (re)start)
    for s in samples:
        s = s.to_dict() if isinstance(s, StepRecord) else s
        rank, step = int(s.get("rank") or 0), int(s["step"])
        last, since = seen.get(rank, (None, 0))
        since = 1 if last is None or step <= last else since + 1
        seen[rank] = (step, since)
        t = s.get("step_time_s")
        if since <= WARMUP_STEPS or s.get("checkpoint") or t is None or not t > 0:
            continue
        kept.append(float(t))
    if len(kept) < MIN_MEASURED_STEPS:
        return None, len(kept)
    return statistics.median(kept), len(kept)


def kernel_mix(kernels: Iterable[Any], comm_share: float = 0.0) -> dict[str, float] | None:
    """The kernel-time mix of a compiled step: ``kernels`` have ``kind`` and ``time_s`` (the
    compiler's KernelPlan, or dicts); ``comm_share`` (0..1) the exposed communication's share of
    the step. Shares of MIX_KEYS summing to 1 (rounded to 4 places); None without kernel time."""
    by: dict[str, float] = dict.fromkeys(MIX_KEYS[:3], 0.0)
    for k in kernels:
        kind = k["kind"] if isinstance(k, dict) else k.kind
        t = k["time_s"] if isinstance(k, dict) else k.time_s
        by["attention" if kind == "attention" else "gemm" if kind == "gemm" else "pointwise"] += max(0.0, t)
    total = sum(by.values())
    if total <= 0:
        return None
    comm = min(1.0, max(0.0, comm_share))
    mix = {k: v / total * (1 - comm) for k, v in by.items()} | {"collectives": comm}
    return {k: round(v, 4) for k, v in mix.items()}


def similarity(a: dict | None, b: dict | None) -> float:
    """How alike two kernel-time mixes are, in [0, 1] (module docstring)."""
    if not a or not b:
        return UNKNOWN_SIMILARITY
    l1 = sum(abs(float(a.get(k, 0.0)) - float(b.get(k, 0.0))) for k in MIX_KEYS)
    return max(0.0, 1.0 - l1 / 2) ** SIMILARITY_POWER


# ------------------------------------------------------------------------------ calibrating


def calibrate(predicted_s: float, accelerator: str, runs: Iterable[RunRecord] | Prepared, *,
              provider: str | None = None,
              instance_type: str | None = None, mode: str | None = None, features: dict | None = None,
              comm_share: float = 0.0) -> dict:
    """The model's ``predicted_s`` (seconds per step on ``accelerator``) corrected by ``runs``
    (:class:`~sftctl.types.RunRecord` each, or :class:`Prepared` arrays of them: a caller that
    calibrates many predictions against one history prepares it once), as the module docstring
    states: the Gaussian posterior of ``c`` given the runs' ``r_i``, over at most
    :data:`MAX_RUNS` runs (the weightiest).

    Returns ``{"calibrated_step_s", "interval_s": [low, high], "error": posterior factor,
    "prior_error": f, "runs": runs on this accelerator that weigh, "weight": W (the sum of the
    runs' similarity x offering x mode weights), "correction": calibrated / predicted,
    "sources": {"run": n, "imported": n, "labels": [...]}}``.
    """
    import numpy as np

    s0 = math.log(max(1.0001, error_factor(accelerator, comm_share)))
    same = accelerator.lower()
    h = runs if isinstance(runs, Prepared) else Prepared(runs)
    v = np.ones(h.n)
    if provider is not None:  # another offering of this accelerator says less
        v[(h.acc == same) & (h.offering != repr((provider, instance_type)))] *= OTHER_OFFERING_WEIGHT
    if mode is not None:
        v[(h.mode != "") & (h.mode != mode)] *= OTHER_MODE_WEIGHT
    if features:
        f = np.array([float(features.get(key, 0.0)) for key in MIX_KEYS])
        sim = np.where(h.known, np.clip(1 - np.abs(h.mix - f).sum(axis=1) / 2, 0.0, 1.0) ** SIMILARITY_POWER,
                       UNKNOWN_SIMILARITY)
    else:
        sim = np.full(h.n, UNKNOWN_SIMILARITY)
    widths = {same: s0} | {a: _width(a) for a in set(h.acc.tolist()) - {same}}  # accelerator -> prior width s_i
    gamma = (1 - ACCELERATOR_SHARE) * CROSS_ACCELERATOR_SHARE * (min(widths.values()) / s0) ** 2
    own = h.acc == same
    k = np.where(own, ACCELERATOR_SHARE + (1 - ACCELERATOR_SHARE - gamma) * sim, 0.0) + gamma * sim
    order = lambda idx: idx[np.lexsort((-h.ts[idx], -(k * v)[idx]))]  # noqa: E731  loudest first, then newest
    other = np.flatnonzero(~own)
    if other.size > MAX_OTHER_RUNS:  # they speak only through the shared residual: the most alike do
        other = np.sort(order(other)[:MAX_OTHER_RUNS])
    chosen = np.concatenate([np.flatnonzero(own), other])
    if chosen.size > MAX_RUNS:  # the runs that speak loudest for this step: most alike, this offering and mode
        chosen = order(chosen)[:MAX_RUNS]
    picked = [(float(sim[i]), float(v[i]), float(h.logr[i]), h.runs[i].features, h.runs[i], h.acc[i],
               widths[h.acc[i]] / s0, float(k[i])) for i in chosen.tolist()]
    c, var = _posterior(picked, gamma)
    counts = dict.fromkeys(SOURCES, 0)
    for t in picked:
        counts[t[4].source if t[4].source in SOURCES else "imported"] += 1
    labels = sorted({str(t[4].source_label) for t in picked if t[4].source_label})
    weight = sum(t[0] * t[1] for t in picked if t[5] == same)
    cal = predicted_s * math.exp(c)
    f = math.exp(max(s0 * math.sqrt(var), _scatter(picked, same)))
    return {"calibrated_step_s": cal, "interval_s": [cal / f, cal * f], "error": f, "prior_error": math.exp(s0),
            "runs": sum(t[5] == same for t in picked), "other_accelerator_runs": sum(t[5] != same for t in picked),
            "weight": round(weight, 4), "correction": math.exp(c), "sources": {**counts, "labels": labels}}


def _scatter(picked: list, accelerator: str) -> float:
    """The 90 % half-width (ln) that the runs on ``accelerator`` among ``picked`` (as
    :func:`_posterior` takes them) show themselves: 1.645 x the
    root-mean-square deviation of their ``r_i`` from their mean, each weighted by its similarity
    to the new step x its offering and mode weight, widened by ``sqrt(1 + 1 / n)`` for the mean's
    own error (``n`` the effective number of runs, ``(sum w)**2 / sum w**2``, 0 below
    :data:`MIN_SCATTER_RUNS`). Runs that scatter more than the Gaussian model expects (the steps
    of a lab's models each mispriced their own way) keep the STEP RANGE from narrowing below what
    they show."""
    w = [(t[0] * t[1], t[2]) for t in picked if t[5] == accelerator]
    total = sum(x for x, _ in w)
    n = total ** 2 / sum(x * x for x, _ in w) if total > 0 else 0.0
    if n < MIN_SCATTER_RUNS:
        return 0.0
    mean = sum(x * r for x, r in w) / total
    return 1.645 * math.sqrt(sum(x * (r - mean) ** 2 for x, r in w) / total * (1 + 1 / n))


def _width(accelerator: str) -> float:
    """``s_i``: the prior width (ln of the error factor) of a run's accelerator; one the catalog
    does not know has the uncalibrated width."""
    return math.log(max(1.0001, error_factor(accelerator)))


class Prepared:
    """The runs a calibration reads, as arrays: the planner builds them once per plan and
    calibrates every offering against them. Runs without a positive predicted and measured step
    are left out."""

    def __init__(self, runs: Iterable[RunRecord]):
        import numpy as np

        self.runs = [r for r in runs if r.predicted_step_s and r.measured_step_s
                     and r.predicted_step_s > 0 and r.measured_step_s > 0]
        self.n = len(self.runs)
        self.acc = np.array([r.accelerator.lower() for r in self.runs], dtype=object)
        self.offering = np.array([repr((r.provider, r.instance_type)) for r in self.runs], dtype=object)
        self.mode = np.array([r.mode or "" for r in self.runs], dtype=object)
        self.logr = np.array([math.log(r.measured_step_s / r.predicted_step_s) for r in self.runs], dtype=float)
        self.ts = np.array([r.ts or 0.0 for r in self.runs], dtype=float)
        self.known = np.array([bool(r.features) for r in self.runs], dtype=bool)
        self.mix = np.array([[float((r.features or {}).get(key, 0.0)) for key in MIX_KEYS] for r in self.runs],
                            dtype=float).reshape(self.n, len(MIX_KEYS))


def _posterior(picked: list, gamma: float = 0.0) -> tuple[float, float]:
    """``(c_post, sd_post**2 / s0**2)`` of the module docstring's Gaussian model for the runs
    ``picked`` (each ``(similarity to the new step, v, r, kernel mix, run, accelerator, q, k)``:
    the run's accelerator, lower case, its prior width over the new step's and its covariance
    with the new step ``k_i``), ``gamma`` the shared step residual's variance over ``s0**2``;
    ``(0, 1)`` without runs. Covariances are in units of ``s0**2``; the means in ln."""
    if not picked:
        return 0.0, 1.0
    import numpy as np

    b = ACCELERATOR_SHARE
    mix = np.array([[float((t[3] or {}).get(key, 0.0)) for key in MIX_KEYS] for t in picked])
    known = np.array([bool(t[3]) for t in picked])
    l1 = np.abs(mix[:, None, :] - mix[None, :, :]).sum(axis=2)  # similarity() for every pair, at once
    sims = np.where(known[:, None] & known[None, :], np.clip(1 - l1 / 2, 0.0, 1.0) ** SIMILARITY_POWER,
                    UNKNOWN_SIMILARITY)
    np.fill_diagonal(sims, 1.0)  # a run is its own step
    codes = {a: i for i, a in enumerate(dict.fromkeys(t[5] for t in picked))}
    acc = np.array([codes[t[5]] for t in picked])
    same = (acc[:, None] == acc[None, :]).astype(float)  # [B_i == B_j]
    q2 = np.array([t[6] ** 2 for t in picked])
    cov = (same * (b * q2[:, None] + ((1 - b) * q2[:, None] - gamma) * sims) + gamma * sims
           + np.diag([NOISE_RATIO ** 2 * q2[i] / t[1] for i, t in enumerate(picked)]))
    k = np.array([t[7] for t in picked])
    r = np.array([t[2] for t in picked])
    # the scale of r is ln, of cov s0^2: c_post = k' K^-1 r holds for any common scale of k and K
    with _one_blas_thread(len(picked)):
        solved = np.linalg.solve(cov, np.stack([r, k], axis=1))
    c = float(k @ solved[:, 0])
    var = max(0.0, 1.0 - float(k @ solved[:, 1]))
    return c, var


#: the threadpoolctl controller :func:`_one_blas_thread` limits BLAS with (made once: ~30 ms)
_BLAS: Any = None


def _one_blas_thread(n: int):
    """A context in which BLAS runs on one thread, for a solve of ``n`` runs of
    :data:`BLAS_SINGLE_THREAD_FROM` or more (below that, nothing). A dense solve of a few hundred
    runs takes ~2 ms on one core; OpenBLAS' threads, on a machine whose cores are busy (a plan beside
    a compile or a training), made the same solve 15-230 ms here."""
    global _BLAS
    import contextlib

    if n < BLAS_SINGLE_THREAD_FROM:
        return contextlib.nullcontext()
    if _BLAS is None:
        from threadpoolctl import ThreadpoolController

        _BLAS = ThreadpoolController()
    return _BLAS.limit(limits=1, user_api="blas")


# ------------------------------------------------------------------------------ a job's row


def job_run(job: Any, samples: list[StepRecord], now: float | None = None) -> RunRecord | None:
    """The run-history row of ``job`` (a :class:`sftctl.types.JobRecord`) from its reported
    steps (``source`` ``run``, labelled with the job's owner), or None when it has no prediction
    (no model, or not planned) or is not measured."""
    plan = getattr(job, "plan", None)
    if plan is None or job.offering is None:
        return None
    predicted = plan.planned("step_time_s")
    if not predicted:
        return None
    measured, n = measured_step_s(samples)
    if measured is None:
        return None
    o = job.offering
    nodes = int((job.spec.get("resources") or {}).get("nodes") or plan.chosen.nodes or 1)
    par, ckpt = plan.planned("parallelism"), plan.planned("activation_checkpointing")
    interval = plan.planned("step_time_interval_s") or [None, None]
    return RunRecord(
        job_id=job.id, accelerator=o.accelerator, count=o.count * nodes, gpus_per_node=o.count, nodes=nodes,
        provider=o.provider, instance_type=o.instance_type, region=o.region, mode=plan.planned("mode"),
        strategy=None if par is None else par + ("+ckpt" if ckpt else ""), predicted_step_s=float(predicted),
        interval_low_s=interval[0], interval_high_s=interval[1], measured_step_s=measured, measured_steps=n,
        features=plan.planned("features"), name=job.name, source="run", source_label=job.owner or "lab",
        ts=now or time.time())



def record_run(store: Any, job_id: str, after: float | None = None, series: list[StepRecord] | None = None) -> str | None:
    """Record job ``job_id``'s predicted and measured step time (:func:`job_run` over its reported
    steps, only those after ``after``, a migration's time, when given; ``series``: those steps,
    when the caller has read them already) in ``store``'s run history, with a ``measured`` event
    saying both, and return that event's message; None (nothing recorded) when its plan
    predicted no step or too few steps were reported."""
    series = store.step_series(job_id, after=after) if series is None else series
    job = store.get_job(job_id)
    row, ranks = job_run(job, series), max(1, len({p.rank for p in series}))
    if row is None:
        return None
    store.add_runs([row])
    predicted = job.plan.planned("calibrated_step_s") or row.predicted_step_s
    diff = row.measured_step_s / predicted - 1
    over = f"{round(row.measured_steps / ranks)} steps x {ranks} ranks" if ranks > 1 else f"{row.measured_steps} steps"
    message = (f"step time: measured {row.measured_step_s * 1e3:.1f} ms (median of {over} after warm-up), "
               f"predicted {predicted * 1e3:.1f} ms: {diff:+.0%}")
    store.add_event(job_id, "measured", message, {
        "predicted_s": predicted, "model_s": row.predicted_step_s, "measured_s": row.measured_step_s,
        "measured_steps": row.measured_steps, "difference": diff})
    return message

def step_time_view(predicted: float | None, measured: float | None, n: int = 0,
                   interval: list | None = None) -> dict | None:
    """``status``'s ``step_time``: ``{"predicted_s", "interval_s", "measured_s", "measured_steps",
    "difference"}`` (difference: measured / predicted - 1, e.g. 0.12 = 12 % slower than
    predicted); None when neither is known."""
    if predicted is None and measured is None:
        return None
    diff = measured / predicted - 1 if predicted and measured else None
    return {"predicted_s": predicted, "interval_s": interval, "measured_s": measured, "measured_steps": n,
            "difference": diff}
