"""The two-level calibration of :mod:`sftctl.history` (issue 35, item 2): an accelerator's bias
that every step on it shares, and a step residual that only alike kernel mixes share. Checked
against a float64 reference of the Gaussian posterior, written independently of the module (the
joint covariance of ``c`` and the runs, conditioned with a Schur complement)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from sftctl import history
from sftctl.types import RunRecord

GEMM = {"attention": 0.0, "gemm": 1.0, "pointwise": 0.0, "collectives": 0.0}
POINTWISE = {"attention": 0.0, "gemm": 0.0, "pointwise": 1.0, "collectives": 0.0}


def _run(measured: float, features: dict | None, predicted: float = 1.0, mode: str = "eager",
         provider: str | None = None) -> RunRecord:
    return RunRecord(job_id=None, accelerator="H100", count=8, gpus_per_node=8, nodes=1, provider=provider,
                     instance_type="p5" if provider else None, region=None, mode=mode, strategy="ddp",
                     predicted_step_s=predicted, measured_step_s=measured, measured_steps=10, features=features,
                     name="m", source="imported", source_label="pub", ts=1.0)


def _reference(new: dict | None, runs: list[RunRecord], mode: str | None, provider: str | None) -> tuple[float, float]:
    """(c_post, sd_post / s0) by conditioning the joint Gaussian of (c, r_1..r_n) (float64)."""
    beta, k = history.ACCELERATOR_SHARE, history.NOISE_RATIO ** 2
    steps = [new] + [r.features for r in runs]
    n = len(steps)
    joint = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            joint[i, j] = beta + (1 - beta) * (1.0 if i == j else history.similarity(steps[i], steps[j]))
    for i, r in enumerate(runs, 1):
        v = 1.0
        if provider is not None and (r.provider, r.instance_type) != (provider, "p5"):
            v *= history.OTHER_OFFERING_WEIGHT
        if mode is not None and r.mode != mode:
            v *= history.OTHER_MODE_WEIGHT
        joint[i, i] += k / v
    rr = np.array([math.log(r.measured_step_s / r.predicted_step_s) for r in runs])
    s_cr, s_rr = joint[0, 1:], joint[1:, 1:]
    mean = s_cr @ np.linalg.inv(s_rr) @ rr
    var = joint[0, 0] - s_cr @ np.linalg.inv(s_rr) @ s_cr
    return float(mean), math.sqrt(var)


def _scatter_reference(new: dict | None, runs: list[RunRecord], target: str, mode: str | None = None,
                       provider: str | None = None) -> float:
    """The runs' own 90 % half-width (ln) on ``target``: 1.645 x their weighted standard deviation
    around their weighted mean x sqrt(1 + 1/n_eff), weights similarity x offering x mode; 0 below
    three effective runs. Written from the module docstring, in float64 numpy."""
    own = [r for r in runs if r.accelerator == target]
    if not own:
        return 0.0
    w = np.array([history.similarity(new, r.features)
                  * (history.OTHER_OFFERING_WEIGHT if provider is not None and (r.provider, r.instance_type)
                     != (provider, "p5") else 1.0)
                  * (history.OTHER_MODE_WEIGHT if mode is not None and r.mode != mode else 1.0) for r in own])
    x = np.log([r.measured_step_s / r.predicted_step_s for r in own])
    n = w.sum() ** 2 / (w ** 2).sum() if w.sum() > 0 else 0.0
    if n < history.MIN_SCATTER_RUNS:
        return 0.0
    mean = np.average(x, weights=w)
    return float(1.645 * np.sqrt(np.average((x - mean) ** 2, weights=w) * (1 + 1 / n)))


def test_the_posterior_matches_a_float64_reference_on_random_histories():
    rng = random.Random(35)
    for _ in range(40):
        def mix():
            if rng.random() < 0.15:
                return None  # a run (or step) without a kernel-time mix
            w = [rng.random() for _ in history.MIX_KEYS]
            return {key: x / sum(w) for key, x in zip(history.MIX_KEYS, w)}
        runs = [_run(math.exp(rng.gauss(0, 0.4)), mix(), predicted=rng.uniform(0.01, 5),
                     mode=rng.choice(["eager", "default"]), provider=rng.choice([None, "aws"]))
                for _ in range(rng.randint(1, 25))]
        new, mode, provider = mix(), rng.choice([None, "eager"]), rng.choice([None, "aws"])
        got = history.calibrate(2.0, "H100", runs, provider=provider, instance_type="p5" if provider else None,
                                mode=mode, features=new)
        c, sd = _reference(new, runs, mode, provider)
        s0 = math.log(history.error_factor("H100"))
        # tolerance: float64 solve against an explicit inverse of a matrix with condition number < 100
        assert math.log(got["correction"]) == pytest.approx(c, abs=1e-9)
        assert got["calibrated_step_s"] == pytest.approx(2.0 * math.exp(c), rel=1e-9)
        # the range: the Gaussian posterior's, or the runs' own scatter where that is wider
        assert math.log(got["error"]) == pytest.approx(max(s0 * sd, _scatter_reference(new, runs, "H100", mode,
                                                                                       provider)), rel=1e-9)


def test_runs_that_scatter_keep_the_step_range_as_wide_as_they_show():
    """Twenty runs of this very step, half measured 1.4x and half 1/1.4x the model: the Gaussian
    model alone, which reads their scatter as measurement noise, narrows the range to
    ``f ** sqrt(4 / 24)`` = 1.09x, while 90 % of such steps lie within 1.4x. The range follows
    the runs: 1.645 x ln 1.4 x sqrt(1 + 1/20) in ln. Twenty runs that agree (all 1.3x) narrow it."""
    f = history.error_factor("H100")
    scatter = [_run(1.4 if i % 2 else 1 / 1.4, GEMM) for i in range(20)]
    got = history.calibrate(1.0, "H100", scatter, features=GEMM)
    assert got["correction"] == pytest.approx(1.0, abs=1e-9)  # they average to the model
    assert math.log(got["error"]) == pytest.approx(1.645 * math.log(1.4) * math.sqrt(1 + 1 / 20), rel=1e-9)
    assert got["error"] > 1.7 > f
    agree = history.calibrate(1.0, "H100", [_run(1.3, GEMM)] * 20, features=GEMM)
    assert agree["error"] == pytest.approx(f ** math.sqrt(4 / 24), rel=1e-9) and agree["error"] < 1.1
    # two runs are too few to say how they scatter: the Gaussian range alone
    two = history.calibrate(1.0, "H100", scatter[:2], features=GEMM)
    assert two["error"] == pytest.approx(f ** math.sqrt(1 - 2 / 6), rel=1e-9)


def test_another_models_runs_correct_the_accelerators_bias():
    """Twenty runs of a step unlike this one (similarity 0) say the accelerator runs 2x slower
    than the model thinks: half the prior variance is the accelerator's, so they move this step
    beta * 20 / (4 + 20) of the way in log (twenty runs of one model are one model's evidence)."""
    assert history.similarity(GEMM, POINTWISE) == 0.0
    unlike = history.calibrate(1.0, "H100", [_run(2.0, POINTWISE)] * 20, features=GEMM)
    alike = history.calibrate(1.0, "H100", [_run(2.0, GEMM)] * 20, features=GEMM)
    beta = history.ACCELERATOR_SHARE
    assert math.log2(unlike["correction"]) == pytest.approx(beta * 20 / 24, rel=1e-9)
    assert math.log2(alike["correction"]) == pytest.approx(20 / 24, rel=1e-9)
    assert 1.3 < unlike["correction"] < alike["correction"] < 2.0
    none = history.calibrate(1.0, "H100", [], features=GEMM)
    # the range narrows with either, the alike runs' more: sd^2 = 1 - beta^2 * 20/24 against 4/24
    assert none["error"] > unlike["error"] > alike["error"]
    s0 = math.log(none["error"])
    assert math.log(unlike["error"]) == pytest.approx(s0 * math.sqrt(1 - beta ** 2 * 20 / 24), rel=1e-9)
    # and runs of an unlike step on another accelerator say nothing: no bias nor residual shared
    other = history.calibrate(1.0, "A100-80GB", [_run(2.0, POINTWISE)] * 20, features=GEMM)
    assert (other["runs"], other["other_accelerator_runs"], other["correction"]) == (0, 20, 1.0)


def _reference_across(target: str, new: dict | None, runs: list[RunRecord]) -> tuple[float, float]:
    """(c_post, sd_post) in ln, from the generative model in absolute units: ``c = a_B + g + u_B``
    (the accelerator's bias, the step's residual every accelerator shares, B's own rest), the
    joint covariance of (c_new, r_1..r_n) summed from those three parts, conditioned (float64)."""
    beta, rho, k = history.ACCELERATOR_SHARE, history.CROSS_ACCELERATOR_SHARE, history.NOISE_RATIO ** 2
    accs = [target] + [r.accelerator for r in runs]
    s = [math.log(history.error_factor(a)) for a in accs]
    shared = (1 - beta) * rho * min(s) ** 2
    steps = [new] + [r.features for r in runs]
    n = len(steps)
    joint = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            sim = 1.0 if i == j else history.similarity(steps[i], steps[j])
            joint[i, j] = shared * sim
            if accs[i] == accs[j]:
                joint[i, j] += beta * s[i] ** 2 + ((1 - beta) * s[i] ** 2 - shared) * sim
        if i:
            joint[i, i] += k * s[i] ** 2
    rr = np.array([math.log(r.measured_step_s / r.predicted_step_s) for r in runs])
    s_cr, s_rr = joint[0, 1:], joint[1:, 1:]
    mean = s_cr @ np.linalg.inv(s_rr) @ rr
    return float(mean), math.sqrt(joint[0, 0] - s_cr @ np.linalg.inv(s_rr) @ s_cr)


def _on(acc: str, run: RunRecord) -> RunRecord:
    return RunRecord(**{**run.to_dict(), "accelerator": acc})


def test_runs_on_other_accelerators_match_a_float64_reference():
    """Histories mixing H100, A100-80GB and L4 runs (three prior widths: 1.23, 1.22, 1.84),
    random steps and mixes, against the generative reference."""
    rng = random.Random(36)
    for _ in range(30):
        def mix():
            w = [rng.random() for _ in history.MIX_KEYS]
            return {key: x / sum(w) for key, x in zip(history.MIX_KEYS, w)}
        runs = [_on(rng.choice(["H100", "A100-80GB", "L4"]), _run(math.exp(rng.gauss(0, 0.3)), mix(),
                                                                      predicted=rng.uniform(0.01, 5)))
                for _ in range(rng.randint(1, 20))]
        target, new = rng.choice(["H100", "A100-80GB", "L4"]), mix()
        got = history.calibrate(2.0, target, runs, features=new)
        c, sd = _reference_across(target, new, runs)
        assert math.log(got["correction"]) == pytest.approx(c, abs=1e-9)
        assert math.log(got["error"]) == pytest.approx(max(sd, _scatter_reference(new, runs, target)), rel=1e-9)
        assert got["runs"] + got["other_accelerator_runs"] == len(runs)
        assert got["runs"] == sum(r.accelerator == target for r in runs)


def test_a_step_mispriced_on_one_gpu_moves_its_prediction_on_the_others():
    """Twenty runs of this very step on an A100 measured 2x the model: the H100's prediction of
    it moves too (20 gamma / (4 + 20) of the way, gamma = (1 - beta) rho (s_min / s0)^2), less
    than the A100's own (83 %), and a wide-prior L4 moves no further than the shared part allows:
    a 2x on the A100 never says more than 2x elsewhere."""
    runs = [_on("A100-80GB", _run(2.0, GEMM))] * 20
    a100 = history.calibrate(1.0, "A100-80GB", runs, features=GEMM)
    h100 = history.calibrate(1.0, "H100", runs, features=GEMM)
    l4 = history.calibrate(1.0, "L4", runs, features=GEMM)
    beta, rho = history.ACCELERATOR_SHARE, history.CROSS_ACCELERATOR_SHARE
    s = {a: math.log(history.error_factor(a)) for a in ("A100-80GB", "H100", "L4")}
    gamma = (1 - beta) * rho * (min(s["A100-80GB"], s["H100"]) / s["H100"]) ** 2
    assert math.log2(a100["correction"]) == pytest.approx(20 / 24, rel=1e-9)
    assert math.log2(h100["correction"]) == pytest.approx(20 * gamma / (4 * (s["A100-80GB"] / s["H100"]) ** 2
                                                                        + 20 * (s["A100-80GB"] / s["H100"]) ** 2),
                                                          rel=1e-9)
    assert 1.15 < h100["correction"] < a100["correction"] and (h100["runs"], h100["other_accelerator_runs"]) == (0, 20)
    assert 1.0 < l4["correction"] < 2 ** 0.5
    # the H100's range narrows a little: its own residual and bias are still unknown
    assert history.calibrate(1.0, "H100", [], features=GEMM)["error"] > h100["error"] > a100["error"]


def test_two_models_agreeing_say_more_than_one_model_run_twice():
    """Evidence from independent models adds up for the shared bias; repeating one model does
    not add a second model's worth."""
    other = {"attention": 0.5, "gemm": 0.0, "pointwise": 0.0, "collectives": 0.5}
    assert history.similarity(other, POINTWISE) == history.similarity(other, GEMM) == 0.0
    one_model = history.calibrate(1.0, "H100", [_run(2.0, POINTWISE)] * 2, features=GEMM)
    two_models = history.calibrate(1.0, "H100", [_run(2.0, POINTWISE), _run(2.0, other)], features=GEMM)
    assert two_models["correction"] > one_model["correction"] > 1.0


def test_many_runs_keep_the_weightiest_and_stay_quick():
    rng = random.Random(1)
    runs = [_run(math.exp(rng.gauss(0.3, 0.2)), {"attention": rng.random(), "gemm": 1.0, "pointwise": 0.1,
                                                 "collectives": 0.0}) for _ in range(history.MAX_RUNS + 50)]
    got = history.calibrate(1.0, "H100", runs, features=GEMM)
    assert got["runs"] == history.MAX_RUNS
    elsewhere = history.calibrate(1.0, "A100-80GB", runs, features=GEMM)  # the most alike of another GPU's
    assert (elsewhere["runs"], elsewhere["other_accelerator_runs"]) == (0, history.MAX_OTHER_RUNS)
    assert 1.0 < got["correction"] < math.exp(0.5)


def test_large_solves_run_blas_on_one_thread_and_small_ones_leave_it_alone():
    """OpenBLAS' threads on busy cores made a 400-run solve 15-230 ms instead of ~2 ms
    (benchmarks/calibrate_speed.py): solves of BLAS_SINGLE_THREAD_FROM runs or more run on one."""
    import numpy  # noqa: F401  (loads OpenBLAS, so threadpoolctl sees it)
    from threadpoolctl import threadpool_info

    def blas_threads() -> list[int]:
        return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]

    before = blas_threads()
    assert before, "numpy's BLAS is not visible to threadpoolctl"
    with history._one_blas_thread(history.BLAS_SINGLE_THREAD_FROM):
        assert blas_threads() == [1] * len(before)
    assert blas_threads() == before
    with history._one_blas_thread(history.BLAS_SINGLE_THREAD_FROM - 1):
        assert blas_threads() == before
