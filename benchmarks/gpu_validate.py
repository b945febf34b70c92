"""GPU validation of the search compiler on one GPU, in one run of under ~8 minutes.

    python benchmarks/gpu_validate.py              # on a machine with CUDA torch + triton
    python benchmarks/gpu_validate.py --dry-run    # CPU, TRITON_INTERPRET=1, tiny sizes (plumbing check)

Parts, each behind a time guard (``--budget-s``, default 470 s for the whole run; shares: a 10%,
b 30%, r 12%, c 5%, d what is left but 3% kept for e; a part that runs out of time stops where
it is and says so):

a. **correctness**: every codegen kernel family (GEMM 2-D/batched/transposed/split-K/fused
   epilogue in bf16/fp16/fp32, softmax, log-softmax, row sum/max, fused cross-entropy, layer norm
   and RMS norm forward/backward, column sum, an elementwise chain) against float64 references.
b. **schedules vs the cost model**: GPT-2 small's GEMMs (M=8192 tokens; qkv 8192x768x2304,
   attention projection 8192x768x768, MLP 8192x3072x768 written MxKxN, and their backward
   dX/dW shapes) each timed over >= 100 schedule configs with ``triton.testing.do_bench``, plus
   fused kernels (layer norm, fused cross-entropy, an elementwise chain, column sum) over their
   schedule spaces. For GEMMs: Spearman rho and Kendall tau-b between the model's predicted and
   the measured times (numpy; no scipy), and the measured time of the model's top choice over the
   best measured. Kernels are compiled first in a process pool (Triton's disk cache), so timing
   does not wait on compiles.
r. **calibration records**: the reference kernels the H200 calibration set measured
   (``sftctl/compiler/calibrations/data/h200/kernels.py``: GEMM, layer norm, softmax, bias+GELU)
   on GPT-2's shapes and others, each config checked against fp32 and timed with ``do_bench``,
   written as JSON-lines records in that set's format to ``<results>.records.jsonl`` beside the
   JSON: one GPU run adds calibration data (``python -m sftctl.compiler.calibration fit --data``).
c. **generated GEMM vs cuBLAS**: square bf16 GEMMs 1024..8192, the search's config vs
   ``torch.mm``: TFLOP/s and ratio.
d. **training step**: GPT-2 small, batch 8 x 1024, bf16 autocast, fused AdamW: eager vs
   ``torch.compile(backend="sftensor")`` vs ``torch.compile()`` (Inductor); median step ms. Each
   variant runs in a subprocess with a hard timeout.
e. **fit**: the cost model's efficiency coefficients for this GPU from (b)'s GEMM measurements
   (Levenberg-Marquardt on log-time residuals, 70/30 train/test split of the points), with the
   residuals before and after.

Results go to ``$OUT/gpu_validate_<date>.json`` when ``$OUT`` is set, else
``benchmarks/results/gpu_validate_<date>.json`` (``--out`` overrides), rewritten after every
part, so a run that is cut short still leaves its partial results. A short table prints last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DRY = "--dry-run" in sys.argv
if DRY:  # before triton is imported anywhere: kernels are decorated in interpreter mode
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402

from sftctl.compiler.calibration import spearman as spearman_rho  # noqa: E402
from sftctl.compiler.target import calibrated_coefficients as _coeffs  # noqa: E402

# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------


class Clock:
    """A global deadline with per-part slices: ``part(seconds)`` -> deadline of that part."""

    def __init__(self, budget_s: float) -> None:
        self.t0 = time.monotonic()
        self.end = self.t0 + budget_s

    def left(self) -> float:
        return self.end - time.monotonic()

    def part(self, share_s: float) -> float:
        return min(self.end, time.monotonic() + share_s)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def kendall_tau_b(x, y) -> float:
    """Kendall's tau-b (tie-corrected), O(n^2) over all pairs; nan if n < 3."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n = len(x)
    if n < 3:
        return float("nan")
    iu = np.triu_indices(n, 1)
    dx = np.sign(x[:, None] - x[None, :])[iu]
    dy = np.sign(y[:, None] - y[None, :])[iu]
    s = float((dx * dy).sum())
    n0 = len(dx)
    tx, ty = float((dx == 0).sum()), float((dy == 0).sum())
    den = math.sqrt((n0 - tx) * (n0 - ty))
    return s / den if den else float("nan")


def cfg_key(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


class Results:
    """The JSON document, rewritten atomically after every part."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.path = path
        self.doc = {"meta": meta, "parts": {}}

    def put(self, part: str, value) -> None:
        self.doc["parts"][part] = value
        self.flush()

    def flush(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_jsonable(self.doc), indent=1))
        os.replace(tmp, self.path)


# ------------------------------------------------------------------------------------------------
# problems and the launch of one (family, spec, config) -- shared with the compile workers
# ------------------------------------------------------------------------------------------------


def gemm_problems(dry: bool) -> list[dict]:
    """GPT-2 small's GEMMs at 8 x 1024 tokens as ``{name, m, k, n, a_t, b_t}``: forward ``x @ W.T``
    (B K-contiguous), backward dX = dY @ W (B N-contiguous) and dW = dY.T @ X (A M-contiguous).
    Forward shapes first (they are the ones that must get >= 100 configs)."""
    T = 64 if dry else 8192
    layers = ([("qkv", 48, 96), ("proj", 48, 48), ("fc", 48, 192), ("mlp_proj", 192, 48)] if dry else
              [("qkv", 768, 2304), ("proj", 768, 768), ("fc", 768, 3072), ("mlp_proj", 3072, 768)])
    fwd = [dict(name=f"{n} fwd", m=T, k=k, n=nn, a_t=False, b_t=True) for n, k, nn in layers]
    fwd = [fwd[0], fwd[1], fwd[3], fwd[2]]  # the three named in the brief first
    bwd = []
    for n, k, nn in layers:
        bwd.append(dict(name=f"{n} dX", m=T, k=nn, n=k, a_t=False, b_t=False))
        bwd.append(dict(name=f"{n} dW", m=nn, k=T, n=k, a_t=True, b_t=False))
    if dry:  # the plumbing check: three forward shapes and one transposed-A backward shape
        return fwd[:3] + [bwd[1]]
    return fwd + bwd


def _empty_2d(rows: int, cols: int, transposed: bool, dtype, device, gen=None):
    """A ``rows x cols`` tensor, stored transposed (column-major) when ``transposed``."""
    import torch

    if transposed:
        return torch.randn(cols, rows, dtype=torch.float32, device=device, generator=gen).to(dtype).t()
    return torch.randn(rows, cols, dtype=torch.float32, device=device, generator=gen).to(dtype)


_INPUTS: dict = {}


def make_inputs(family: str, spec: dict, device: str):
    """Inputs of one benchmark case, cached per process."""
    import torch

    key = (family, json.dumps(spec, sort_keys=True), device)
    if key in _INPUTS:
        return _INPUTS[key]
    g = torch.Generator(device=device).manual_seed(0)
    dt = getattr(torch, spec.get("dtype", "bfloat16"))
    if family == "gemm":
        a = _empty_2d(spec["m"], spec["k"], spec["a_t"], dt, device, g) * 0.1
        b = _empty_2d(spec["k"], spec["n"], spec["b_t"], dt, device, g) * 0.1
        val = (a, b)
    elif family == "layer_norm":
        val = (torch.randn(spec["rows"], spec["n"], device=device, generator=g).to(dt),
               torch.randn(spec["n"], device=device, generator=g).to(dt),
               torch.randn(spec["n"], device=device, generator=g).to(dt))
    elif family == "cross_entropy":
        val = (torch.randn(spec["rows"], spec["n"], device=device, generator=g).to(dt),
               torch.randint(0, spec["n"], (spec["rows"],), device=device, generator=g))
    elif family == "elementwise":
        val = (torch.randn(spec["rows"], spec["n"], device=device, generator=g).to(dt),
               torch.randn(spec["n"], device=device, generator=g).to(dt),
               torch.randn(spec["rows"], spec["n"], device=device, generator=g).to(dt))
    elif family == "column_sum":
        val = (torch.randn(spec["rows"], spec["n"], device=device, generator=g).to(dt),)
    else:
        raise ValueError(family)
    _INPUTS.clear() if len(_INPUTS) > 8 else None
    _INPUTS[key] = val
    return val


EW_CHAIN = {"inputs": ("x", "b", "r"), "ops": (("h", "add", "x", "b"), ("g", "gelu", "h"), ("y", "add", "g", "r")),
            "outputs": ("y",)}


def launcher(family: str, spec: dict, config: dict, device: str):
    """A no-argument callable running one kernel launch of ``family`` with ``config``."""
    ins = make_inputs(family, spec, device)
    if family == "gemm":
        from sftctl.compiler.codegen.gemm import gemm

        a, b = ins
        return lambda: gemm(a, b, config=config)
    from sftctl.compiler.codegen import reduction as red

    if family == "layer_norm":
        x, w, bb = ins
        return lambda: red.layer_norm_fwd(x, w, bb, config=config)
    if family == "cross_entropy":
        x, t = ins
        return lambda: red.cross_entropy_fwd_bwd(x, t, grad_scale=1.0 / x.shape[0], config=config)
    if family == "column_sum":
        (x,) = ins
        return lambda: red.column_sum(x, config=config)
    if family == "elementwise":
        from sftctl.compiler.codegen.elementwise import elementwise

        x, bb, r = ins
        return lambda: elementwise(EW_CHAIN, (x, bb, r), config=config)
    raise ValueError(family)


def _warm_one(task):
    """Compile worker: run one launch (populates Triton's disk cache). Returns (index, error)."""
    idx, family, spec, config = task
    try:
        import torch

        launcher(family, spec, config, "cuda")()
        torch.cuda.synchronize()
        return idx, None
    except Exception as e:  # noqa: BLE001
        return idx, f"{type(e).__name__}: {str(e)[:200]}"


def precompile(tasks: list[tuple], deadline: float, workers: int) -> dict:
    """Compile every (family, spec, config) in a spawn process pool until ``deadline``.
    Returns ``{"done", "errors", "seconds", "timed_out"}``."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.monotonic()
    errors: dict[int, str] = {}
    done = 0
    timed_out = False
    ex = cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    try:
        futs = [ex.submit(_warm_one, (i,) + tuple(t)) for i, t in enumerate(tasks)]
        for f in cf.as_completed(futs, timeout=max(1.0, deadline - time.monotonic())):
            i, err = f.result()
            done += 1
            if err:
                errors[i] = err
    except cf.TimeoutError:
        timed_out = True
    finally:
        procs = list(getattr(ex, "_processes", {}).values())
        ex.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            with contextlib.suppress(Exception):
                p.terminate()
    return {"done": done, "tasks": len(tasks), "errors": errors, "seconds": time.monotonic() - t0,
            "timed_out": timed_out}


def bench(fn, dry: bool) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on the GPU, perf_counter on CPU."""
    if dry:
        fn()
        ts = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts))
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))


# ------------------------------------------------------------------------------------------------
# a. correctness against float64
# ------------------------------------------------------------------------------------------------

TOL = {"float32": 2e-2, "bfloat16": 3e-2, "float16": 1e-2}  # of max|ref| (TF32 for fp32 GEMMs)


def part_a(device: str, dry: bool, deadline: float) -> dict:
    import torch
    import torch.nn.functional as F

    from sftctl.compiler.codegen import reduction as red
    from sftctl.compiler.codegen.elementwise import elementwise
    from sftctl.compiler.codegen.gemm import gemm

    g = torch.Generator(device=device).manual_seed(1)
    rows = []

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=device, generator=g).to(dtype)

    def check(name, got, want, dtype):
        if time.monotonic() > deadline:
            rows.append({"case": name, "skipped": "time"})
            return
        got = [got] if isinstance(got, torch.Tensor) else list(got)
        want = [want] if isinstance(want, torch.Tensor) else list(want)
        worst = 0.0
        for a, b in zip(got, want):
            scale = max(float(b.abs().max()), 1e-6)
            worst = max(worst, float((a.double() - b).abs().max()) / scale)
        rows.append({"case": name, "dtype": dtype, "rel_err": worst, "tol": TOL[dtype], "ok": worst <= TOL[dtype]})

    def guarded(name, dtype, fn):
        if time.monotonic() > deadline:
            rows.append({"case": name, "skipped": "time"})
            return
        try:
            got, want = fn()
            check(name, got, want, dtype)
        except Exception as e:  # noqa: BLE001
            rows.append({"case": name, "dtype": dtype, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]})

    s = 1 if dry else 4
    M, K, N = 48 * s, 40 * s, 56 * s
    cfgs = [{"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2},
            {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "split_k": 3, "num_warps": 4, "num_stages": 3, "GROUP_M": 4}]
    for dname in ("bfloat16", "float16", "float32"):
        dt = getattr(torch, dname)
        for ci, cfg in enumerate(cfgs):
            a, b = rnd(M, K, dtype=dt), rnd(N, K, dtype=dt).t()
            bias, res = rnd(N, dtype=dt), rnd(M, N, dtype=dt)

            def f(a=a, b=b, bias=bias, res=res, cfg=cfg):
                got = gemm(a, b, bias=bias, activation="gelu", residual=res, config=cfg)
                want = F.gelu(a.double() @ b.double() + bias.double()) + res.double()
                return got, want
            guarded(f"gemm {M}x{K}x{N} b^T bias+gelu+residual cfg{ci}", dname, f)
        a3, b3 = rnd(3, K, M, dtype=dt).transpose(1, 2), rnd(3, K, N, dtype=dt)
        guarded(f"bmm 3x{M}x{K}x{N} a^T split-k", dname,
                lambda a3=a3, b3=b3: (gemm(a3, b3, alpha=0.5, config=cfgs[1]), 0.5 * (a3.double() @ b3.double())))
    R, C = (8, 100) if dry else (64, 1000)
    for dname in ("float32", "bfloat16"):
        dt = getattr(torch, dname)
        x = rnd(R, C, dtype=dt)
        xd = x.double()
        guarded("softmax", dname, lambda x=x, xd=xd: (red.softmax(x), torch.softmax(xd, -1)))
        guarded("log_softmax", dname, lambda x=x, xd=xd: (red.log_softmax(x), torch.log_softmax(xd, -1)))
        guarded("row_sum", dname, lambda x=x, xd=xd: (red.row_sum(x), xd.sum(-1)))
        guarded("row_max", dname, lambda x=x, xd=xd: (red.row_max(x), xd.amax(-1)))
        t = torch.randint(0, C, (R,), device=device, generator=g)

        def ce(x=x, xd=xd, t=t):
            loss, dlog = red.cross_entropy_fwd_bwd(x, t, grad_scale=1.0 / R)
            xr = xd.clone().requires_grad_(True)
            lr = F.cross_entropy(xr, t, reduction="none")
            lr.mean().backward()
            return (loss, dlog), (lr.detach(), xr.grad)
        guarded("cross_entropy fwd+bwd", dname, ce)
        w, bb = rnd(C, dtype=dt), rnd(C, dtype=dt)

        def ln(x=x, w=w, bb=bb):
            y, mean, rstd = red.layer_norm_fwd(x, w, bb)
            dy = torch.ones_like(x)
            dx, dw, db = red.layer_norm_bwd(dy, x, w, mean, rstd)
            xr, wr, br = (v.double().clone().requires_grad_(True) for v in (x, w, bb))
            yr = F.layer_norm(xr, (C,), wr, br, 1e-5)
            yr.backward(dy.double())
            return (y, dx, dw, db), (yr.detach(), xr.grad, wr.grad, br.grad)
        guarded("layer_norm fwd+bwd", dname, ln)

        def rms(x=x, w=w):
            y, rstd = red.rms_norm_fwd(x, w)
            dy = torch.ones_like(x)
            dx, dw = red.rms_norm_bwd(dy, x, w, rstd)
            xr, wr = (v.double().clone().requires_grad_(True) for v in (x, w))
            yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr
            yr.backward(dy.double())
            return (y, dx, dw), (yr.detach(), xr.grad, wr.grad)
        guarded("rms_norm fwd+bwd", dname, rms)
        guarded("column_sum", dname, lambda x=x, xd=xd: (red.column_sum(x), xd.sum(0)))
        r = rnd(R, C, dtype=dt)
        guarded("elementwise add+gelu+add", dname, lambda x=x, w=w, r=r: (
            elementwise(EW_CHAIN, (x, w, r)), F.gelu(x.double() + w.double()) + r.double()))
    n_ok = sum(1 for r in rows if r.get("ok"))
    return {"cases": rows, "passed": n_ok, "total": len(rows),
            "failed": [r["case"] + " " + r.get("dtype", "") for r in rows if r.get("ok") is False]}


# ------------------------------------------------------------------------------------------------
# b. schedules: measured vs the cost model
# ------------------------------------------------------------------------------------------------

SANE = {"BLOCK_M": (64, 128, 256), "BLOCK_N": (64, 128, 256), "BLOCK_K": (32, 64, 128), "num_warps": (4, 8),
        "num_stages": (2, 3, 4, 5), "split_k": (1, 2, 4), "GROUP_M": (1, 8, 16), "layout": ("as_is",)}
SANE_DRY = {"BLOCK_M": (16, 32), "BLOCK_N": (16, 32), "BLOCK_K": (16, 32), "num_warps": (4,),
            "num_stages": (2,), "split_k": (1, 2), "GROUP_M": (1, 8), "layout": ("as_is",)}


def _problem(p: dict):
    from sftctl.compiler.costmodel import GemmProblem

    return GemmProblem(batch=1, m=p["m"], n=p["n"], k=p["k"], dtype="bfloat16", a_transposed=p["a_t"],
                       b_transposed=p["b_t"])


def gemm_config_sets(problems: list[dict], hw, n_configs: int, dry: bool) -> dict[str, list[dict]]:
    """Per problem: a shared seeded sample of the sane subspace (feasible for every problem on
    ``hw``, so compiles are shared), plus the model's top 5 in that subspace and the search's
    choice over the full space."""
    import itertools

    from sftctl.compiler.search.gemm import evaluate_configs, search_gemm

    space = SANE_DRY if dry else SANE
    keys = list(space)
    allc = [dict(zip(keys, v)) for v in itertools.product(*(space[k] for k in keys))]
    ok = np.ones(len(allc), dtype=bool)
    preds = {}
    for p in problems:
        t = evaluate_configs(_problem(p), hw, allc, _coeffs(hw))
        preds[p["name"]] = t
        ok &= np.isfinite(t)
    idx = [i for i in range(len(allc)) if ok[i]]
    random.Random(0).shuffle(idx)
    shared = [allc[i] for i in idx[:n_configs]]
    out = {}
    for p in problems:
        t = preds[p["name"]]
        top = [allc[i] for i in np.argsort(t)[:5] if np.isfinite(t[i])]
        choice = search_gemm(_problem(p), hw, _coeffs(hw), space=SANE_DRY if dry else None).config
        seen, cfgs = set(), []
        for c in ([choice] if choice else []) + top + shared:
            if cfg_key(c) not in seen:
                seen.add(cfg_key(c))
                cfgs.append(c)
        out[p["name"]] = cfgs
    return out


def fused_cases(dry: bool) -> list[dict]:
    """Fused kernels with their schedule spaces and the cost model's (config-independent) time."""
    T = 16 if dry else 8192
    V = 100 if dry else 50257
    C = 48 if dry else 768
    H = 192 if dry else 3072
    row_space = [{"BLOCK_N": bn, "num_warps": w} for bn in ((64, 256) if dry else (16, 32, 64, 128, 256, 512, 1024, 2048, 4096))
                 for w in ((4,) if dry else (1, 2, 4, 8, 16, 32))]
    ew_space = [{"BLOCK": b, "num_warps": w} for b in ((256, 1024) if dry else (64, 128, 256, 512, 1024, 2048, 4096, 8192))
                for w in ((4,) if dry else (1, 2, 4, 8, 16, 32))]
    cs = [{"BLOCK_M": bm, "BLOCK_N": bn, "split": s, "num_warps": w}
          for bm in ((16,) if dry else (8, 16, 32, 64, 128)) for bn in ((16, 64) if dry else (16, 32, 64, 128, 256))
          for s in ((1, 4) if dry else (1, 8, 32, 128)) for w in ((4,) if dry else (1, 2, 4, 8))]
    return [
        {"name": "layer_norm fwd", "family": "layer_norm", "spec": {"rows": T, "n": C}, "configs": row_space,
         "bytes": T * C * 2 * 2, "rows": T, "cols": C},
        {"name": "cross_entropy fwd+bwd", "family": "cross_entropy", "spec": {"rows": T, "n": V}, "configs": row_space,
         "bytes": T * V * 2 * 2 * 2, "rows": T, "cols": V},
        {"name": "bias+gelu+residual", "family": "elementwise", "spec": {"rows": T, "n": H}, "configs": ew_space,
         "bytes": T * H * 2 * 3},
        {"name": "column_sum (dbias)", "family": "column_sum", "spec": {"rows": T, "n": H}, "configs": cs,
         "bytes": T * H * 2},
    ]


def fused_predictions(f: dict, hw) -> list | None:
    """The streaming-kernel model's seconds per config of a fused case (None: no per-config model)."""
    from sftctl.compiler.costmodel import elementwise_time_s, row_kernel_time_s

    cfgs = f["configs"]
    if f["family"] in ("layer_norm", "cross_entropy"):
        kind = "layernorm" if f["family"] == "layer_norm" else "softmax"
        cfg = {"ROWS": np.ones(len(cfgs)), "BLOCK_N": np.array([c["BLOCK_N"] for c in cfgs], dtype=float),
               "num_warps": np.array([c["num_warps"] for c in cfgs], dtype=float)}
        return list(row_kernel_time_s(kind, f["rows"], f["cols"], cfg, hw, _coeffs(hw)))
    if f["family"] == "elementwise":
        n = f["spec"]["rows"] * f["spec"]["n"]
        cfg = {"BLOCK": np.array([c["BLOCK"] for c in cfgs], dtype=float),
               "num_warps": np.array([c["num_warps"] for c in cfgs], dtype=float)}
        return list(elementwise_time_s(n, cfg, hw, _coeffs(hw), kind="elementwise", bytes_per_element=f["bytes"] / n,
                                       instr_per_element=4.0 + 3.0 * 3))
    return None


def part_b(device: str, dry: bool, deadline: float, hw, n_configs: int, workers: int, results: Results) -> dict:
    from sftctl.compiler.costmodel import memory_bound_time_s, reduction_time_s
    from sftctl.compiler.search.gemm import evaluate_configs

    problems = gemm_problems(dry)
    sets = gemm_config_sets(problems, hw, n_configs, dry)
    fused = fused_cases(dry)
    out: dict = {"gemm": [], "fused": [], "hardware": hw.name}
    # compile everything first (GPU: a process pool filling Triton's cache)
    if not dry:
        tasks = [("gemm", p, c) for p in problems for c in sets[p["name"]]]
        tasks += [(f["family"], f["spec"], c) for f in fused for c in f["configs"]]
        comp_deadline = time.monotonic() + 0.45 * max(0.0, deadline - time.monotonic())
        out["precompile"] = precompile(tasks, comp_deadline, workers)
        results.put("b_schedules", out)
    for p in problems:
        if time.monotonic() > deadline:
            out["gemm"].append({"problem": p, "skipped": "time"})
            continue
        cfgs = sets[p["name"]]
        pred = evaluate_configs(_problem(p), hw, cfgs, _coeffs(hw))
        meas = []
        for c in cfgs:
            if time.monotonic() > deadline:
                break
            try:
                meas.append(bench(launcher("gemm", p, c, device), dry))
            except Exception as e:  # noqa: BLE001 - a config that fails to compile/run
                meas.append(float("nan"))
                out.setdefault("errors", []).append(f"{p['name']} {c}: {type(e).__name__}: {str(e)[:120]}")
        n = len(meas)
        m = np.asarray(meas)
        pr = np.asarray(pred[:n]) * 1e3
        fin = np.isfinite(m) & np.isfinite(pr)
        best = float(np.nanmin(m)) if fin.any() else float("nan")
        top = int(np.argmin(np.where(fin, pr, np.inf))) if fin.any() else 0
        flops = 2.0 * p["m"] * p["n"] * p["k"]
        out["gemm"].append({
            "problem": p, "n_configs": int(fin.sum()), "configs": cfgs[:n], "measured_ms": meas,
            "predicted_ms": pr.tolist(), "spearman_rho": spearman_rho(pr[fin], m[fin]),
            "kendall_tau": kendall_tau_b(pr[fin], m[fin]), "best_measured_ms": best,
            "model_top_measured_ms": float(m[top]) if fin.any() else None,
            "model_top_over_best": float(m[top] / best) if fin.any() else None,
            "search_choice_measured_ms": float(m[0]) if n else None,  # configs[0] is the search's choice
            "search_choice_over_best": float(m[0] / best) if n and fin.any() else None,
            "best_tflops": flops / (best * 1e-3) / 1e12 if fin.any() else None,
            "complete": n == len(cfgs)})
        results.put("b_schedules", out)
    for f in fused:
        if time.monotonic() > deadline:
            out["fused"].append({"name": f["name"], "skipped": "time"})
            continue
        meas = []
        for c in f["configs"]:
            if time.monotonic() > deadline:
                break
            try:
                meas.append(bench(launcher(f["family"], f["spec"], c, device), dry))
            except Exception as e:  # noqa: BLE001
                meas.append(float("nan"))
                out.setdefault("errors", []).append(f"{f['name']} {c}: {type(e).__name__}: {str(e)[:120]}")
        m = np.asarray(meas)
        if "cols" in f:
            model_s = float(reduction_time_s(f["rows"], f["cols"], "bfloat16", hw, _coeffs(hw), flops_per_elem=5.0))
        else:
            model_s = float(memory_bound_time_s(f["bytes"], hw, _coeffs(hw)))
        per_config = fused_predictions(f, hw)
        rho = None
        if per_config is not None and len(meas):
            pc = np.asarray(per_config[:len(meas)])
            fin = np.isfinite(m) & np.isfinite(pc)
            rho = spearman_rho(pc[fin], m[fin]) if fin.sum() >= 3 else None
            top = int(np.argmin(np.where(fin, pc, np.inf))) if fin.any() else None
        best = float(np.nanmin(m)) if np.isfinite(m).any() else float("nan")
        out["fused"].append({"name": f["name"], "spec": f["spec"], "n_configs": int(np.isfinite(m).sum()),
                             "configs": f["configs"][:len(meas)], "measured_ms": meas, "best_measured_ms": best,
                             "worst_measured_ms": float(np.nanmax(m)) if np.isfinite(m).any() else None,
                             "model_ms": model_s * 1e3, "model_over_best": model_s * 1e3 / best if best else None,
                             "best_config": f["configs"][int(np.nanargmin(m))] if np.isfinite(m).any() else None,
                             "achieved_gb_per_s": f["bytes"] / (best * 1e-3) / 1e9 if best else None,
                             "predicted_ms": [float(v) * 1e3 for v in per_config[:len(meas)]] if per_config else None,
                             "spearman_rho": rho,
                             "model_top_over_best": (float(m[top] / best) if per_config is not None and len(meas)
                                                     and top is not None and best else None),
                             "note": "predicted_ms: the per-config streaming-kernel model (row kernels: "
                                     "costmodel.row_kernel_time_s, elementwise: elementwise_time_s; none for "
                                     "column sums); model_ms: the step model's config-free time"})
        results.put("b_schedules", out)
    return out


# ------------------------------------------------------------------------------------------------
# r. calibration records: the reference kernels of sftctl/compiler/calibrations/data/h200/kernels.py
# ------------------------------------------------------------------------------------------------

#: (shape_name, M, N, K) of the GEMMs timed as records (A row-major M x K, B row-major K x N).
RECORD_GEMMS = [("gpt2_qkv", 8192, 2304, 768), ("gpt2_proj", 8192, 768, 768), ("gpt2_fc", 8192, 3072, 768),
                ("gpt2_fc_proj", 8192, 768, 3072), ("gpt2_dw_fc", 768, 3072, 8192), ("square4096", 4096, 4096, 4096)]
RECORD_ROWS = [(8192, 768), (8192, 3072), (16384, 1024), (4096, 4096)]
RECORD_EW = [(8192, 768), (8192, 3072), (65536, 1024)]


def reference_kernels():
    """The module of the measured reference kernels (``calibrations/data/h200/kernels.py``)."""
    import importlib.util

    path = REPO / "sftctl" / "compiler" / "calibrations" / "data" / "h200" / "kernels.py"
    spec = importlib.util.spec_from_file_location("sftctl_reference_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def record_cases(dry: bool, hw, n_gemm: int) -> list[dict]:
    """Records to measure: per GEMM shape a seeded sample of the sane subspace plus the
    calibrated model's top 5 (``sftctl.compiler.predict``); every row/elementwise config."""
    import itertools

    from sftctl.compiler.records import normalize, predict_records
    from sftctl.compiler.target import load_target

    out = []
    gemms = [("tiny", 64, 96, 64)] if dry else RECORD_GEMMS
    space = SANE_DRY if dry else SANE
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "GROUP_M")
    allc = [dict(zip(keys, v)) for v in itertools.product(space["BLOCK_M"], space["BLOCK_N"], space["BLOCK_K"],
                                                          space["num_warps"], space["num_stages"], (1, 8))]
    for name, M, N, K in gemms:
        # the dry run's interpreter mis-computes bf16 tl.dot (Triton 3.9): its plumbing check uses fp32
        recs = [{"kernel": "gemm", "shape_name": name, "M": M, "N": N, "K": K,
                 "dtype": "float32" if dry else "bfloat16", "config": c} for c in allc]
        t = predict_records([normalize(r) for r in recs], load_target(hw))
        top = [recs[i] for i in np.argsort(t)[:5]]
        rest = [recs[i] for i in range(len(recs))]
        random.Random(sum(map(ord, name))).shuffle(rest)
        seen, picked = set(), []
        for r in top + rest:
            key = json.dumps(r["config"], sort_keys=True)
            if key not in seen and len(picked) < (3 if dry else n_gemm):
                seen.add(key)
                picked.append(r)
        out += picked
    rows = [(16, 48)] if dry else RECORD_ROWS
    for kernel in ("layernorm", "softmax"):
        for M, N in rows:
            bn = 1 << (N - 1).bit_length()
            for R in ((1, 4) if dry else (1, 2, 4, 8, 16)):
                for w in ((4,) if dry else (1, 2, 4, 8, 16, 32)):
                    out.append({"kernel": kernel, "M": M, "N": N, "dtype": "bfloat16",
                                "config": {"ROWS": R, "BLOCK_N": bn, "num_warps": w}})
    for M, N in ([(16, 48)] if dry else RECORD_EW):
        for B in ((256,) if dry else (256, 512, 1024, 2048, 4096, 8192)):
            for w in ((4,) if dry else (1, 2, 4, 8, 16)):
                if B >= 32 * w:
                    out.append({"kernel": "bias_gelu", "M": M, "N": N, "dtype": "bfloat16",
                                "config": {"BLOCK": B, "num_warps": w}})
    return out


def _record_launcher(K, rec: dict, device: str):
    """(run, check) of one record: ``run()`` launches the kernel; ``check()`` returns the max
    error of its output over max |fp32 reference|."""
    import torch
    import triton

    c, M, N = rec["config"], rec["M"], rec["N"]
    g = torch.Generator(device="cpu").manual_seed(0)
    bf = getattr(torch, rec["dtype"])

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=bf)

    if rec["kernel"] == "gemm":
        Kd = rec["K"]
        a, b = rnd(M, Kd), rnd(Kd, N)
        out = torch.empty(M, N, device=device, dtype=bf)
        grid = (triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"]),)

        def run():
            K.mm_kernel[grid](a, b, out, M, N, Kd, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                              out.stride(0), out.stride(1), BM=c["BLOCK_M"], BN=c["BLOCK_N"], BK=c["BLOCK_K"],
                              GROUP_M=c["GROUP_M"], num_warps=c["num_warps"], num_stages=c["num_stages"])

        def ref():
            return a.float() @ b.float()
    elif rec["kernel"] in ("layernorm", "softmax"):
        x = rnd(M, N)
        w, bias = rnd(N), rnd(N)
        out = torch.empty_like(x)
        grid = (triton.cdiv(M, c["ROWS"]),)

        def run():
            if rec["kernel"] == "layernorm":
                K.layernorm_fwd[grid](x, w, bias, out, M, N, 1e-5, ROWS=c["ROWS"], BLOCK_N=c["BLOCK_N"],
                                      num_warps=c["num_warps"])
            else:
                K.softmax_fwd[grid](x, out, M, N, ROWS=c["ROWS"], BLOCK_N=c["BLOCK_N"], num_warps=c["num_warps"])

        def ref():
            if rec["kernel"] == "layernorm":
                return torch.nn.functional.layer_norm(x.float(), (N,), w.float(), bias.float(), 1e-5)
            return torch.softmax(x.float(), -1)
    else:
        x, bias = rnd(M, N), rnd(N)
        out = torch.empty_like(x)
        grid = (triton.cdiv(M * N, c["BLOCK"]),)

        def run():
            K.bias_gelu[grid](x, bias, out, M * N, N, BLOCK=c["BLOCK"], num_warps=c["num_warps"])

        def ref():
            return torch.nn.functional.gelu(x.float() + bias.float(), approximate="tanh")

    def check():
        run()
        r = ref()
        return float((out.float() - r).abs().max() / r.abs().max().clamp_min(1e-30))

    return run, check


def part_r(device: str, dry: bool, deadline: float, hw, records_path: Path, n_gemm: int = 40) -> dict:
    """Time the reference kernels as calibration records: one JSON line per (kernel, shape,
    config) in the format of ``calibrations/data/h200/README.md`` (``measured_s`` null and an
    ``error`` where a config fails to run or to match the fp32 reference), appended to
    ``records_path`` as each is measured, so ``python -m sftctl.compiler.calibration fit --data``
    (with the file named ``train.jsonl``) or ``python -m sftctl.compiler.predict`` reads it."""
    K = reference_kernels()
    cases = record_cases(dry, hw, n_gemm)
    records_path.parent.mkdir(parents=True, exist_ok=True)
    done = errors = 0
    with records_path.open("a") as f:
        for rec in cases:
            if time.monotonic() > deadline:
                break
            rec = dict(rec)
            try:
                run, check = _record_launcher(K, rec, device)
                err = check()
                tol = 2e-2
                if not err <= tol:
                    raise ValueError(f"output error {err:.3g} of max |fp32 reference| > {tol}")
                rec["measured_s"] = bench(run, dry) * 1e-3
            except Exception as e:  # noqa: BLE001 - a config that fails is a record too
                rec["measured_s"] = None
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                errors += 1
            f.write(json.dumps(rec) + "\n")
            f.flush()
            done += 1
    return {"records": str(records_path), "measured": done, "failed": errors, "planned": len(cases),
            "complete": done == len(cases)}


# ------------------------------------------------------------------------------------------------
# c. generated GEMM vs cuBLAS
# ------------------------------------------------------------------------------------------------


def part_c(device: str, dry: bool, deadline: float, hw) -> dict:
    import torch

    from sftctl.compiler.search.gemm import search_gemm

    rows = []
    sizes = (32, 64) if dry else (1024, 2048, 4096, 8192)
    for s in sizes:
        if time.monotonic() > deadline:
            rows.append({"size": s, "skipped": "time"})
            continue
        p = dict(name=f"square {s}", m=s, k=s, n=s, a_t=False, b_t=False)
        cfg = search_gemm(_problem(p), hw, _coeffs(hw), space=SANE_DRY if dry else None).config
        a, b = make_inputs("gemm", p, device)
        try:
            ours = bench(launcher("gemm", p, cfg, device), dry)
            ref = bench(lambda a=a, b=b: torch.mm(a, b), dry)
            flops = 2.0 * s ** 3
            rows.append({"size": s, "config": cfg, "sftensor_ms": ours, "cublas_ms": ref,
                         "sftensor_tflops": flops / (ours * 1e-3) / 1e12, "cublas_tflops": flops / (ref * 1e-3) / 1e12,
                         "ratio_vs_cublas": ref / ours})
        except Exception as e:  # noqa: BLE001
            rows.append({"size": s, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return {"rows": rows}


# ------------------------------------------------------------------------------------------------
# d. a training step (each variant in a subprocess with a hard timeout)
# ------------------------------------------------------------------------------------------------


def train_variant(variant: str, dry: bool) -> dict:
    """Child process: time GPT-2 small training steps; prints one JSON line."""
    import torch

    sys.path.insert(0, str(REPO / "examples" / "gpt"))
    from model import GPT, GPT2_SMALL, GPTConfig, next_byte_loss

    device = "cpu" if dry else "cuda"
    cfg = GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=64) if dry else GPT2_SMALL
    batch = 2 if dry else 8
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not dry)
    run = model
    if variant == "default":
        run = torch.compile(model)
    elif variant == "sftensor":
        import sftctl.compiler  # noqa: F401  (registers the backend if the entry point is missing)

        run = torch.compile(model, backend="sftensor")
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device=device, generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device=device, generator=g)
    # bf16 autocast on the GPU; the dry run stays float32 (the interpreter emulates bf16 slowly)
    amp = contextlib.nullcontext() if dry else torch.autocast(device, dtype=torch.bfloat16)

    def step():
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = next_byte_loss(run, (x, y))
        loss.backward()
        opt.step()
        return loss

    t0 = time.perf_counter()
    first = step().item()
    if device == "cuda":
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(1 if dry else 2):
        step()
    times = []
    for _ in range(2 if dry else 10):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step().detach()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {"variant": variant, "median_ms": 1e3 * float(np.median(times)), "first_step_s": first_s,
           "first_loss": first, "last_loss": float(loss), "steps_timed": len(times)}
    if variant == "sftensor":
        from sftctl.compiler import backend as be

        out["gemm_launches"] = dict(be.STATS)
        out["graphs"] = [{"kind": r.kind, "sites": len(r.sites), "accelerator": r.accelerator,
                          "ir_predicted_ms": 1e3 * r.ir.get("predicted_s", float("nan"))}
                         for r in be.DEFAULT_BACKEND.reports]
    if device == "cuda":
        out["max_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def part_d(dry: bool, deadline: float) -> dict:
    rows = []
    for variant in ("eager", "sftensor", "default"):
        left = deadline - time.monotonic()
        if left < 15:
            rows.append({"variant": variant, "skipped": "time"})
            continue
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if dry and variant == "sftensor":
            env["SFTCTL_SFTENSOR_FORCE"] = "1"  # exercise the rewrite on CPU (interpreted kernels)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--train-variant", variant] + (["--dry-run"] if dry else [])
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode == 0 and lines:
                rows.append(json.loads(lines[-1]) | {"wall_s": time.monotonic() - t0})
            else:
                rows.append({"variant": variant, "error": (proc.stderr or proc.stdout)[-1500:], "rc": proc.returncode})
        except subprocess.TimeoutExpired:
            rows.append({"variant": variant, "timed_out_s": left})
    eager = next((r.get("median_ms") for r in rows if r.get("variant") == "eager"), None)
    for r in rows:
        if eager and r.get("median_ms"):
            r["speedup_vs_eager"] = eager / r["median_ms"]
    return {"rows": rows, "config": "tiny GPT on CPU" if dry else "GPT-2 small, batch 8 x 1024, bf16 autocast, fused AdamW"}


# ------------------------------------------------------------------------------------------------
# e. fit the efficiency coefficients
# ------------------------------------------------------------------------------------------------

#: Coefficients fields fitted, with their bounds (fractions live in (0, 1]).
FIT_FIELDS = {"mma_efficiency": (0.2, 1.0), "hbm_efficiency": (0.3, 1.0), "l2_bytes_per_clk_per_sm": (8.0, 128.0),
              "tile_overhead_cycles": (50.0, 20000.0), "k_loop_overhead_cycles": (1.0, 400.0),
              "warp_tile_overhead_elems": (16.0, 4096.0), "latency_multiplier": (0.2, 5.0),
              "overlap_slack": (0.0, 0.5)}


def fit_coefficients(points: list[tuple], hw, iters: int = 40, seed: int = 0) -> dict:
    """Levenberg-Marquardt on ``log(model) - log(measured)`` over :data:`FIT_FIELDS`, in a
    bounded (logistic) parameterization, from ``calibrated_coefficients(hw)``.

    ``points``: ``(problem dict, config dict, measured seconds)``. 70% train / 30% test (seeded).
    Returns the fitted values, RMS log residuals before/after on both sets, and rho after.
    """
    from sftctl.compiler.search.gemm import evaluate_configs

    base = _coeffs(hw)
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(points))
    n_tr = max(1, int(0.7 * len(points)))
    train, test = [points[i] for i in idx[:n_tr]], [points[i] for i in idx[n_tr:]]
    names = list(FIT_FIELDS)

    def groups(pts):
        by = {}
        for p, c, t in pts:
            by.setdefault(json.dumps(p, sort_keys=True), (p, [], []))
            by[json.dumps(p, sort_keys=True)][1].append(c)
            by[json.dumps(p, sort_keys=True)][2].append(t)
        return list(by.values())

    g_tr, g_te = groups(train), groups(test)

    def to_coeffs(z):
        vals = {}
        for zi, n in zip(np.clip(z, -30.0, 30.0), names):
            lo, hi = FIT_FIELDS[n]
            vals[n] = lo + (hi - lo) / (1.0 + math.exp(-zi))
        return dataclasses.replace(base, **vals)

    def from_coeffs(c):
        z = []
        for n in names:
            lo, hi = FIT_FIELDS[n]
            f = min(max((getattr(c, n) - lo) / (hi - lo), 1e-4), 1 - 1e-4)
            z.append(math.log(f / (1 - f)))
        return np.asarray(z)

    def resid(c, gs):
        out = []
        for p, cfgs, ts in gs:
            pred = evaluate_configs(_problem(p), hw, cfgs, c)
            r = np.log(np.maximum(pred, 1e-12)) - np.log(np.asarray(ts))
            out.append(np.where(np.isfinite(r), r, 5.0))
        return np.concatenate(out) if out else np.zeros(0)

    def rms(r):
        return float(np.sqrt(np.mean(r * r))) if len(r) else float("nan")

    z = from_coeffs(base)
    r = resid(to_coeffs(z), g_tr)
    lam = 1e-2
    for _ in range(iters):
        J = np.empty((len(r), len(z)))
        for j in range(len(z)):
            dz = np.zeros_like(z)
            dz[j] = 1e-3
            J[:, j] = (resid(to_coeffs(z + dz), g_tr) - r) / 1e-3
        A = J.T @ J
        step = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-9), -J.T @ r)
        z_new = z + step
        r_new = resid(to_coeffs(z_new), g_tr)
        if rms(r_new) < rms(r):
            z, r, lam = z_new, r_new, lam / 3
        else:
            lam *= 5
            if lam > 1e6:
                break
    fitted = to_coeffs(z)

    def rho_after(c, gs):
        return [spearman_rho(evaluate_configs(_problem(p), hw, cfgs, c), ts) for p, cfgs, ts in gs]

    return {
        "fields": {n: getattr(fitted, n) for n in names},
        "defaults": {n: getattr(base, n) for n in names},
        "rms_log_resid": {"train_before": rms(resid(base, g_tr)), "train_after": rms(resid(fitted, g_tr)),
                          "test_before": rms(resid(base, g_te)), "test_after": rms(resid(fitted, g_te))},
        "median_abs_log_resid_after": float(np.median(np.abs(resid(fitted, g_tr + g_te)))),
        "spearman_after": rho_after(fitted, groups(points)),
        "n_train": len(train), "n_test": len(test),
        "paste": f"Coefficients.ACCELERATOR[{hw.name!r}] = "
                 + repr({n: round(float(getattr(fitted, n)), 4) for n in names}),
    }


def part_e(b: dict, hw, deadline: float) -> dict:
    pts = []
    for row in b.get("gemm", []):
        for c, t in zip(row.get("configs", []), row.get("measured_ms", [])):
            if t is not None and math.isfinite(t) and t > 0:
                pts.append((row["problem"], c, t * 1e-3))
    if len(pts) < 10:
        return {"skipped": f"only {len(pts)} measurements"}
    if time.monotonic() > deadline:
        return {"skipped": "time"}
    return fit_coefficients(pts, hw, iters=8 if DRY else 40) | {"points": len(pts)}


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def _table(doc: dict) -> str:
    P = doc["parts"]
    lines = []
    a = P.get("a_correctness", {})
    if a:
        lines.append(f"a. correctness: {a.get('passed')}/{a.get('total')} cases within tolerance"
                     + (f"; FAILED: {', '.join(a['failed'][:6])}" if a.get("failed") else ""))
    b = P.get("b_schedules", {})
    if b:
        lines.append("b. GEMM schedules (ms)            configs  rho    tau    best    model-top/best  search/best")
        for r in b.get("gemm", []):
            if "skipped" in r:
                lines.append(f"   {r['problem']['name']:<30} skipped ({r['skipped']})")
                continue
            f = lambda v, w=7, p=3: (f"{v:{w}.{p}f}" if isinstance(v, (int, float)) and v is not None and math.isfinite(v) else f"{'-':>{w}}")  # noqa: E731
            lines.append(f"   {r['problem']['name']:<30} {r['n_configs']:7d} {f(r['spearman_rho'], 6, 2)} "
                         f"{f(r['kendall_tau'], 6, 2)} {f(r['best_measured_ms'], 7, 3)} {f(r['model_top_over_best'], 14, 2)} "
                         f"{f(r['search_choice_over_best'], 12, 2)}")
        for r in b.get("fused", []):
            if "skipped" in r:
                lines.append(f"   {r['name']:<30} skipped")
                continue
            lines.append(f"   {r['name']:<30} {r['n_configs']:7d} best {r['best_measured_ms']:.4f} ms "
                         f"worst {r['worst_measured_ms'] or float('nan'):.4f} model/best {r['model_over_best'] or float('nan'):.2f}")
        if "precompile" in b:
            pc = b["precompile"]
            lines.append(f"   precompile: {pc['done']}/{pc['tasks']} in {pc['seconds']:.0f} s, {len(pc['errors'])} errors"
                         + (" (timed out)" if pc["timed_out"] else ""))
    c = P.get("c_vs_cublas", {})
    for r in c.get("rows", []):
        if "sftensor_tflops" in r:
            lines.append(f"c. {r['size']:5d}^3 bf16: sftensor {r['sftensor_tflops']:7.1f} TFLOP/s, "
                         f"cuBLAS {r['cublas_tflops']:7.1f}, ratio {r['ratio_vs_cublas']:.2f}")
        else:
            lines.append(f"c. {r['size']}: {r.get('skipped') or r.get('error', '')[:80]}")
    d = P.get("d_train_step", {})
    for r in d.get("rows", []):
        if "median_ms" in r:
            lines.append(f"d. {r['variant']:<9} {r['median_ms']:9.2f} ms/step (first step {r['first_step_s']:.1f} s)"
                         + (f", x{r['speedup_vs_eager']:.2f} vs eager" if r.get("speedup_vs_eager") else ""))
        else:
            lines.append(f"d. {r['variant']:<9} " + (r.get("skipped") or ("timed out" if "timed_out_s" in r else
                                                                          "error: " + str(r.get("error", ""))[-160:].replace("\n", " "))))
    e = P.get("e_fit", {})
    if "rms_log_resid" in e:
        rr = e["rms_log_resid"]
        lines.append(f"e. fit: RMS log-resid train {rr['train_before']:.3f} -> {rr['train_after']:.3f}, "
                     f"test {rr['test_before']:.3f} -> {rr['test_after']:.3f} ({e['points']} points)")
        lines.append("   " + e["paste"])
    elif e:
        lines.append(f"e. fit: {e.get('skipped') or e.get('error')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny sizes, few configs")
    ap.add_argument("--budget-s", type=float, default=None, help="whole-run time budget (default 470; dry 300)")
    ap.add_argument("--configs", type=int, default=None, help="shared GEMM configs per shape (default 110; dry 3)")
    ap.add_argument("--parts", default="abrcde", help="subset of parts to run, e.g. 'ab'")
    ap.add_argument("--workers", type=int, default=None, help="compile processes (default cores - 2, max 14)")
    ap.add_argument("--out", default=None, help="result JSON path")
    ap.add_argument("--train-variant", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.train_variant:
        print(json.dumps(_jsonable(train_variant(args.train_variant, args.dry_run))))
        return 0

    import torch

    dry = args.dry_run or not torch.cuda.is_available()
    if dry and not args.dry_run:
        print("no CUDA device: running the dry run (CPU, tiny sizes)", file=sys.stderr)
        os.environ["TRITON_INTERPRET"] = "1"
    budget = args.budget_s or (300.0 if dry else 470.0)
    clock = Clock(budget)
    device = "cpu" if dry else "cuda"
    from sftctl.compiler.hardware import get_accelerator
    from sftctl.compiler.target import Target

    if dry:
        hw = get_accelerator("H200")
        gpu = "none (dry run)"
    else:
        hw = Target.for_device(torch.device("cuda")).hw
        gpu = torch.cuda.get_device_name(0)
    date = _dt.date.today().isoformat()
    if args.out:
        path = Path(args.out)
    elif os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / f"gpu_validate_{date}{'-dryrun' if dry else ''}.json"
    else:
        path = REPO / "benchmarks" / "results" / f"gpu_validate_{date}{'-dryrun' if dry else ''}.json"
    import triton

    res = Results(path, {"date": date, "gpu": gpu, "accelerator": hw.name, "dry_run": dry, "budget_s": budget,
                         "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                         "cpus": os.cpu_count()})
    workers = args.workers or max(1, min(14, (os.cpu_count() or 4) - 2))
    n_cfg = args.configs or (3 if dry else 110)
    # shares of the budget: a 10%, b 30%, r 12%, c 5%; d gets what is left but 3% kept for e
    records_path = path.with_name(path.stem + ".records.jsonl")
    parts = {
        "a": ("a_correctness", 0.10, lambda dl: part_a(device, dry, dl)),
        "b": ("b_schedules", 0.30, lambda dl: part_b(device, dry, dl, hw, n_cfg, workers, res)),
        "r": ("r_records", 0.12, lambda dl: part_r(device, dry, dl, hw, records_path)),
        "c": ("c_vs_cublas", 0.05, lambda dl: part_c(device, dry, dl, hw)),
        "d": ("d_train_step", None, lambda dl: part_d(dry, dl)),
        "e": ("e_fit", None, lambda dl: part_e(res.doc["parts"].get("b_schedules", {}), hw, dl)),
    }
    for letter in "abrcde":
        if letter not in args.parts:
            continue
        name, share, fn = parts[letter]
        t0 = time.monotonic()
        deadline = clock.part(share * budget) if share else clock.end - (0.03 * budget if letter == "d" else 0.0)
        print(f"[{clock.elapsed():6.1f} s] part {letter} ({name}), {deadline - time.monotonic():.0f} s", file=sys.stderr,
              flush=True)
        try:
            value = fn(deadline)
        except Exception as e:  # noqa: BLE001 - a broken part must not lose the others
            value = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        if isinstance(value, dict):
            value["seconds"] = time.monotonic() - t0
        res.put(name, value)
    res.doc["meta"]["total_s"] = clock.elapsed()
    res.flush()
    print(_table(res.doc))
    print(f"results: {path}  ({clock.elapsed():.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
