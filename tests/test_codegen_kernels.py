"""Every codegen kernel family under Triton's CPU interpreter against float64 references.

Triton 3.9 fixes interpreter-vs-compiled when ``@triton.jit`` decorates; the codegen package
loads each kernel file per mode and picks the interpreter at launch for CPU tensors or
``TRITON_INTERPRET=1``, which this module sets for its tests. Inputs are fresh random tensors;
each test prints its seed on failure. Outputs are poisoned with NaN before each run (and the
split-K workspace too), so an element a kernel never writes fails the comparison.

Tolerances (max abs error / (1 + max |reference|), i.e. relative at scale, absolute near 0):
fp32 2e-5 (TF32 is off: ``allow_tf32=False``; the interpreter multiplies in fp32 anyway),
fp16 4e-3, bf16 2e-2 (output rounding: half an ulp is 2^-11 / 2^-8 relative, plus the
reduction's fp32 rounding), inputs are the rounded low-precision tensors themselves.
"""

from __future__ import annotations

import random
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from sftctl.compiler.codegen import gemm as gemm_mod  # noqa: E402
from sftctl.compiler.codegen import reduction as R  # noqa: E402
from sftctl.compiler.codegen.elementwise import Chain, collapse_dims, elementwise, generate_source  # noqa: E402
from sftctl.compiler.codegen.gemm import gemm  # noqa: E402
from sftctl.compiler.target import calibrated_coefficients as _coeffs  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SFTCTL_CODEGEN_CACHE", str(tmp_path / "codegen"))
    monkeypatch.setattr(gemm_mod, "POISON_WORKSPACE", True)
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # exp overflow in the interpreter


@pytest.fixture
def seed():
    """A fresh seed per test; every assertion message carries it (rerun with torch.manual_seed)."""
    s = random.randrange(2**31)
    torch.manual_seed(s)
    return s


def check(got, ref, dtype, what="", seed=None):
    got = got.detach().double()
    ref = ref.detach().double()
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    assert torch.isfinite(got).all() or not torch.isfinite(ref).all(), f"{what}: non-finite output (seed {seed})"
    err = (got - ref).abs().max().item() if got.numel() else 0.0
    scale = 1.0 + (ref.abs().max().item() if ref.numel() else 0.0)
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} > {TOL[dtype]} * {scale:.3g} (seed {seed})"


def nan_like(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def act_ref(x, activation):
    return {"none": lambda v: v, "relu": F.relu, "gelu": F.gelu, "gelu_erf": F.gelu,
            "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "silu": F.silu}[activation](x)


# ------------------------------------------------------------------------------------------
# GEMM

GEMM_CASES = [
    # (config, M, N, K, a_t, b_t, batch, activation, bias, residual, alpha)
    (dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1), 37, 45, 29, False, False, 0, "none", False, False, 1.0),
    (dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, GROUP_M=2), 37, 45, 29, True, False, 0, "relu", True, False, 1.0),
    (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, split_k=3), 37, 45, 70, False, True, 0, "gelu_tanh", True, True, 0.5),
    (dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, split_k=2, layout="copy_ab"), 21, 19, 64, True, True, 3, "silu", True, True, 1.0),
    (dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=8, num_warps=2, num_stages=2), 33, 17, 40, False, True, 2, "gelu", False, True, -1.25),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(GEMM_CASES)))
def test_gemm(case, dtype, seed):
    cfg, M, N, K, a_t, b_t, batch, act, has_bias, has_res, alpha = GEMM_CASES[case]
    lead = (batch,) if batch else ()
    a = (torch.randn(*lead, K, M, dtype=dtype).transpose(-1, -2) if a_t else torch.randn(*lead, M, K, dtype=dtype))
    b = (torch.randn(*lead, N, K, dtype=dtype).transpose(-1, -2) if b_t else torch.randn(*lead, K, N, dtype=dtype))
    bias = torch.randn(N, dtype=dtype) if has_bias else None
    res = torch.randn(*lead, M, N, dtype=dtype) if has_res else None
    out = nan_like((*lead, M, N), dtype)
    got = gemm(a, b, bias=bias, activation=act, residual=res, alpha=alpha, config=cfg, out=out, allow_tf32=False)
    assert got is out
    ref = alpha * (a.double() @ b.double())
    if bias is not None:
        ref = ref + bias.double()
    ref = act_ref(ref, act)
    if res is not None:
        ref = ref + res.double()
    check(got, ref, dtype, f"gemm case {case}", seed)


def test_gemm_broadcast_batch_and_cast(seed):
    """A 2-D weight broadcast over a batch, fp32 activations cast to bf16 in the prologue,
    a broadcast residual row, fp32 output."""
    a = torch.randn(2, 19, 24)
    w = torch.randn(24, 40, dtype=torch.bfloat16)
    res = torch.randn(40)
    got = gemm(a, w, residual=res, compute_dtype=torch.bfloat16, out_dtype=torch.float32,
               config=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16))
    ref = a.bfloat16().double() @ w.double() + res.double()
    assert got.shape == (2, 19, 40) and got.dtype == torch.float32
    # the prologue's fp32 -> bf16 cast may round differently from torch's (the interpreter's numpy
    # cast need not round to nearest even): one bf16 ulp per element, so the bf16 tolerance
    check(got, ref, torch.bfloat16, "broadcast gemm", seed)


def test_gemm_errors():
    a, b = torch.randn(4, 5), torch.randn(6, 7)
    with pytest.raises(ValueError, match="inner"):
        gemm(a, b)
    with pytest.raises(ValueError, match="power of two"):
        gemm(a, torch.randn(5, 3), config={"BLOCK_M": 24})
    with pytest.raises(ValueError, match="activation"):
        gemm(a, torch.randn(5, 3), activation="tanh")
    with pytest.raises(TypeError, match="compute_dtype"):
        gemm(a, torch.randn(5, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="unknown keys"):
        gemm(a, torch.randn(5, 3), config={"BLOCK_Q": 16})


def test_gemm_launch_for_fusion_kernel():
    from sftctl.compiler.fusion import Kernel
    from sftctl.compiler.search.gemm import search_gemm
    from sftctl.compiler.hardware import get_accelerator

    from sftctl.compiler.problem import GemmProblem

    k = Kernel("gemm", [0], gemm=GemmProblem(batch=1, m=37, n=45, k=29, dtype="float32"))
    launch = gemm_mod.launch_for(k, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16))
    a, b = torch.randn(37, 29), torch.randn(29, 45)
    check(launch(a, b, allow_tf32=False), a.double() @ b.double(), torch.float32, "launch_for")
    choice = search_gemm(gemm_mod.problem_for_kernel(k), get_accelerator("H100"), _coeffs(get_accelerator("H100")))
    assert gemm_mod.launch_for(k, choice).config["BLOCK_M"] == choice.config["BLOCK_M"]


# ------------------------------------------------------------------------------------------
# Elementwise

CHAIN = Chain(
    inputs=("x", "b", "r"),
    ops=(("h", "add", "x", "b"), ("g", "gelu_tanh", "h"), ("y", "add", "g", "r"),
         ("m", "gt", "h", 0.0), ("t", "tanh", "x"), ("s", "sigmoid", "r"), ("e", "exp", "s"),
         ("l", "log", "e"), ("q", "rsqrt", "e"), ("w", "where", "m", "t", -1.5),
         ("z", "mul", "w", "q"), ("z2", "div", "z", "e"), ("z3", "sub", "z2", "l"), ("z4", "neg", "z3"),
         ("z5", "silu", "z4"), ("z6", "relu", "z5"), ("z7", "sqrt", "s"), ("z8", "add", "z6", "z7"),
         ("z9", "gelu", "z8"), ("c", "cast", "z9", "bfloat16")),
    outputs=("y", "m", "c"),
)


def chain_ref(x, b, r):
    h = x + b
    y = F.gelu(h, approximate="tanh") + r
    m = h > 0
    s = torch.sigmoid(r)
    e = torch.exp(s)
    z = torch.where(m, torch.tanh(x), torch.tensor(-1.5, dtype=x.dtype)) * torch.rsqrt(e)
    z = -(z / e - torch.log(e))
    z = F.gelu(F.relu(F.silu(z)) + torch.sqrt(s))
    return y, m, z.to(torch.bfloat16).double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "broadcast", "strided"])
def test_elementwise_chain(dtype, layout, seed):
    if layout == "contiguous":
        x, b, r = (torch.randn(5, 7, 13, dtype=dtype) for _ in range(3))
    elif layout == "broadcast":
        x = torch.randn(5, 7, 13, dtype=dtype)
        b = torch.randn(13, dtype=dtype)        # broadcast over the leading dims
        r = torch.randn(7, 1, dtype=dtype)      # stride 0 along the last dim
    else:
        x = torch.randn(13, 7, 5, dtype=dtype).permute(2, 1, 0)  # non-contiguous view
        b = torch.randn(5, 14, 13, dtype=dtype)[:, ::2, :]     # sliced: stride 2 along dim 1
        r = torch.randn(1, 1, 1, dtype=dtype)
    shape = torch.broadcast_shapes(x.shape, b.shape, r.shape)
    outs = [nan_like(shape, dtype), torch.zeros(shape, dtype=torch.bool), nan_like(shape, torch.float32)]
    outs[1].fill_(True)  # poison for a boolean: every element must be rewritten where h <= 0
    y, m, c = elementwise(CHAIN, {"x": x, "b": b, "r": r}, out=outs)
    ry, rm, rc = chain_ref(x.double(), b.double(), r.double())
    check(y, ry, dtype, f"chain y {layout}", seed)
    assert torch.equal(m, rm) or ((m != rm).float().mean() < 1e-3), f"mask differs (seed {seed})"
    # c is rounded to bf16 twice over: compare at bf16 tolerance
    check(c, rc, torch.bfloat16, f"chain c {layout}", seed)


def test_elementwise_generated_source_and_cache(tmp_path):
    src = generate_source(CHAIN, 2, frozenset({(1, 0)}))
    assert "@triton.jit" in src and "def ew_kernel(" in src and "c0 * s1_0" not in src
    x = torch.randn(33, 17)
    elementwise(Chain(("x",), (("y", "exp", "x"),), ("y",)), [x])
    files = list((tmp_path / "codegen").glob("ew_*.py"))
    assert len(files) == 1
    elementwise(Chain(("x",), (("y", "exp", "x"),), ("y",)), [x + 1])  # same key: no new file
    assert len(list((tmp_path / "codegen").glob("ew_*.py"))) == 1


def test_collapse_dims():
    assert collapse_dims((4, 5, 6), [(30, 6, 1), (30, 6, 1)]) == ((120,), [(1,), (1,)])
    assert collapse_dims((4, 5, 6), [(30, 6, 1), (0, 0, 1)]) == ((20, 6), [(6, 1), (0, 1)])
    assert collapse_dims((1, 1), [(1, 1)]) == ((1,), [(0,)])


def test_elementwise_errors():
    with pytest.raises(ValueError, match="unknown op"):
        Chain(("x",), (("y", "frobnicate", "x"),), ("y",))
    with pytest.raises(ValueError, match="before it is defined"):
        Chain(("x",), (("y", "add", "x", "z"),), ("y",))
    with pytest.raises(ValueError, match="never defined"):
        Chain(("x",), (("y", "exp", "x"),), ("q",))
    with pytest.raises(ValueError, match="broadcast"):
        elementwise(Chain(("x", "y"), (("z", "add", "x", "y"),), ("z",)), [torch.randn(3), torch.randn(4)])


# ------------------------------------------------------------------------------------------
# Reductions

ROW_SHAPES = [((6, 45), 16), ((3, 4, 70), 32), ((5, 13), 16)]  # (shape, BLOCK_N): rows > one block


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,block", ROW_SHAPES)
def test_row_reductions_and_softmax(shape, block, dtype, seed):
    x = torch.randn(*shape, dtype=dtype) * 3
    cfg = {"BLOCK_N": block}
    xd = x.double()
    out = nan_like(shape[:-1], dtype)
    check(R.row_sum(x, config=cfg, out=out), xd.sum(-1), dtype, "row_sum", seed)
    out = nan_like(shape[:-1], dtype)
    check(R.row_max(x, config=cfg, out=out), xd.amax(-1), dtype, "row_max", seed)
    out = nan_like(shape, dtype)
    check(R.softmax(x, config=cfg, out=out), xd.softmax(-1), dtype, "softmax", seed)
    out = nan_like(shape, dtype)
    check(R.log_softmax(x, config=cfg, out=out), xd.log_softmax(-1), dtype, "log_softmax", seed)
    xt = x.transpose(0, -2) if x.dim() == 3 else x  # strided rows
    check(R.softmax(xt, config=cfg), xt.double().softmax(-1), dtype, "softmax strided", seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy(dtype, seed):
    rows, V = 11, 77
    logits = torch.randn(rows, V, dtype=dtype) * 2
    target = torch.randint(0, V, (rows,))
    target[3] = -100
    dl = nan_like((rows, V), dtype)
    loss, dlogits = R.cross_entropy_fwd_bwd(logits, target, grad_scale=0.25, config={"BLOCK_N": 32}, dlogits=dl)
    xr = logits.double().requires_grad_()
    ref = F.cross_entropy(xr, target, reduction="none", ignore_index=-100)
    (ref.sum() * 0.25).backward()
    assert loss.dtype == torch.float32
    check(loss, ref, dtype, "ce loss", seed)
    check(dlogits, xr.grad, dtype, "ce grad", seed)
    # device-side scale (e.g. grad_out / n_valid), 3-D logits
    scale = torch.tensor([0.1])
    loss3, d3 = R.cross_entropy_fwd_bwd(logits.view(1, rows, V), target.view(1, rows), grad_scale=scale)
    check(d3.view(rows, V), xr.grad / 0.25 * 0.1, dtype, "ce grad tensor scale", seed)
    with pytest.raises(ValueError, match="out of range"):
        R.cross_entropy_fwd_bwd(logits, torch.full((rows,), V), check_targets=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,block,split", [(45, 16, 3), (130, 64, 1)])
def test_layer_norm(n, block, split, dtype, seed):
    x = torch.randn(3, 7, n, dtype=dtype) + 0.5
    w = torch.randn(n, dtype=dtype)
    b = torch.randn(n, dtype=dtype)
    y, mean, rstd = R.layer_norm_fwd(x, w, b, 1e-5, config={"BLOCK_N": block})
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    yr = F.layer_norm(xr, (n,), wr, br, 1e-5)
    check(y, yr, dtype, "ln y", seed)
    check(mean, x.double().mean(-1), torch.float32, "ln mean", seed)
    check(rstd, 1 / torch.sqrt(x.double().var(-1, unbiased=False) + 1e-5), torch.float16, "ln rstd", seed)
    dy = torch.randn_like(x)
    yr.backward(dy.double())
    dx, dw, db = R.layer_norm_bwd(dy, x, w, mean, rstd, config={"BLOCK_N": block},
                                  colsum_config={"BLOCK_M": 16, "BLOCK_N": 16, "split": split})
    check(dx, xr.grad, dtype, "ln dx", seed)
    check(dw, wr.grad, dtype, "ln dw", seed)
    check(db, br.grad, dtype, "ln db", seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype, seed):
    n = 53
    x = torch.randn(4, 9, n, dtype=dtype)
    w = torch.randn(n, dtype=dtype)
    y, rstd = R.rms_norm_fwd(x, w, 1e-6, config={"BLOCK_N": 16})
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    yr = F.rms_norm(xr, (n,), wr, 1e-6)
    check(y, yr, dtype, "rms y", seed)
    dy = torch.randn_like(x)
    yr.backward(dy.double())
    dx, dw = R.rms_norm_bwd(dy, x, w, rstd, config={"BLOCK_N": 16}, colsum_config={"split": 4, "BLOCK_M": 16})
    check(dx, xr.grad, dtype, "rms dx", seed)
    check(dw, wr.grad, dtype, "rms dw", seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_column_sum(dtype, seed):
    x = torch.randn(5, 37, 29, dtype=dtype)
    for cfg in ({"BLOCK_M": 16, "BLOCK_N": 16, "split": 1}, {"BLOCK_M": 16, "BLOCK_N": 16, "split": 7}, None):
        check(R.column_sum(x, config=cfg), x.double().sum((0, 1)), dtype, f"column_sum {cfg}", seed)
    check(R.column_sum(x, out_dtype=torch.float32), x.double().sum((0, 1)), torch.float32
          if dtype == torch.float32 else torch.float16, "column_sum fp32 out", seed)


def test_reduction_errors():
    with pytest.raises(ValueError, match="empty"):
        R.softmax(torch.randn(3, 0))
    with pytest.raises(ValueError, match="power of two"):
        R.softmax(torch.randn(3, 5), config={"BLOCK_N": 24})
    with pytest.raises(ValueError, match="weight"):
        R.layer_norm_fwd(torch.randn(3, 5), torch.randn(4))
    with pytest.raises(TypeError):
        R.row_sum(torch.ones(3, 4, dtype=torch.int32))
