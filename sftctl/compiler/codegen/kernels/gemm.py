"""Triton GEMM kernels: tiled (batched) matmul with a fused prologue and epilogue, and split-K.

Loaded through ``_runtime.builtin_kernels("gemm", interpret)``; see ``codegen/gemm.py`` for the
launcher and the meaning of every argument. The schedule (tile sizes, GROUP_M, split_k) is all
``tl.constexpr``; ``num_warps`` and ``num_stages`` are Triton launch options.
"""

import triton
import triton.language as tl

# Only builtins of triton.language are used (no tl.cdiv, tl.zeros, tl.sigmoid, tl.sum ...): those
# are themselves @triton.jit functions, decorated in whatever mode triton was *imported* in, which
# would tie these kernels to that mode. The helpers below are decorated with this file.


@triton.jit
def _cdiv(x, d):
    return (x + d - 1) // d


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


# Activation codes (``ACTIVATION`` constexpr); codegen/gemm.py ACTIVATIONS maps names to these.
ACT_NONE, ACT_RELU, ACT_GELU_TANH, ACT_GELU_ERF, ACT_SILU = 0, 1, 2, 3, 4


@triton.jit
def _activate(x, ACTIVATION: tl.constexpr):
    """Activation of an fp32 tile. gelu-tanh uses 0.5*(1+tanh(u)) == sigmoid(2u) (exact identity)."""
    if ACTIVATION == 1:
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == 2:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        x = x * _sigmoid(2.0 * u)
    elif ACTIVATION == 3:
        x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACTIVATION == 4:
        x = x * _sigmoid(x)
    return x


@triton.jit
def _epilogue_store(acc, c_ptr, bias_ptr, res_ptr, pid_b, offs_m, offs_n, M, N,
                    stride_cb, stride_cm, stride_cn, stride_rb, stride_rm, stride_rn, stride_bias,
                    alpha,
                    HAS_ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr):
    """out = act(alpha * acc + bias[n]) + residual, cast to the output's dtype, masked store."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_ALPHA:
        acc = acc * alpha
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    acc = _activate(acc, ACTIVATION)
    if HAS_RESIDUAL:
        r_ptrs = (res_ptr + pid_b.to(tl.int64) * stride_rb + offs_m[:, None].to(tl.int64) * stride_rm
                  + offs_n[None, :].to(tl.int64) * stride_rn)
        acc = acc + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
    c_ptrs = (c_ptr + pid_b.to(tl.int64) * stride_cb + offs_m[:, None].to(tl.int64) * stride_cm
              + offs_n[None, :].to(tl.int64) * stride_cn)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, res_ptr,
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cs, stride_cb, stride_cm, stride_cn,
    stride_rb, stride_rm, stride_rn,
    stride_bias,
    alpha,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """C[b] = epilogue(A[b] @ B[b]) for one BLOCK_M x BLOCK_N tile and one K slice.

    Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), batch, SPLIT_K). Tiles are visited in
    GROUP_M-grouped order (Triton tutorial 03). With SPLIT_K == 1 the epilogue runs here and
    writes C; otherwise ``c_ptr`` is the fp32 workspace ``[SPLIT_K, batch, M, N]`` (slice stride
    ``stride_cs``) and ``splitk_reduce_kernel`` sums the slices and runs the epilogue.
    """
    pid = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_k = tl.program_id(2)
    num_pid_m = _cdiv(M, BLOCK_M)
    num_pid_n = _cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows/columns past the edge wrap around (loads stay in bounds without masks; the store masks).
    offs_am = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
    offs_bn = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    k_per_split = _cdiv(_cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)

    # 64-bit scalar bases (batch, K slice); 32-bit in-tile offsets keep the contiguity the
    # vectorizer and the async-copy pipeliner need (rows/cols * strides < 2**31 per operand).
    a_base = a_ptr + pid_b.to(tl.int64) * stride_ab + k_start.to(tl.int64) * stride_ak
    b_base = b_ptr + pid_b.to(tl.int64) * stride_bb + k_start.to(tl.int64) * stride_bk
    a_ptrs = a_base + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = b_base + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_end - k, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_end - k, other=0.0)
        a = a.to(DOT_DTYPE)  # prologue: input cast (no-op when the operand already is DOT_DTYPE)
        b = b.to(DOT_DTYPE)
        if UPCAST_DOT:
            # The CPU interpreter multiplies bf16 as raw uint16 storage: feed it exact fp32 copies
            # (a bf16 x bf16 product is exact in fp32, as on the tensor cores).
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if SPLIT_K == 1:
        _epilogue_store(acc, c_ptr, bias_ptr, res_ptr, pid_b, offs_m, offs_n, M, N,
                        stride_cb, stride_cm, stride_cn, stride_rb, stride_rm, stride_rn, stride_bias,
                        alpha, HAS_ALPHA, HAS_BIAS, ACTIVATION, HAS_RESIDUAL)
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        w_ptrs = (c_ptr + pid_k.to(tl.int64) * stride_cs + pid_b.to(tl.int64) * stride_cb
                  + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn)
        tl.store(w_ptrs, acc, mask=mask)


@triton.jit
def splitk_reduce_kernel(
    ws_ptr, c_ptr, bias_ptr, res_ptr,
    M, N,
    stride_ws, stride_wb, stride_wm, stride_wn,
    stride_cb, stride_cm, stride_cn,
    stride_rb, stride_rm, stride_rn,
    stride_bias,
    alpha,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_ALPHA: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """Second split-K pass: C[b] = epilogue(sum_s W[s, b]) for one tile. Grid: (tiles, batch).

    Deterministic (fixed summation order s = 0..SPLIT_K-1), unlike an fp32 atomic add.
    """
    pid = tl.program_id(0)
    pid_b = tl.program_id(1)
    num_pid_n = _cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    w_ptrs = (ws_ptr + pid_b.to(tl.int64) * stride_wb + offs_m[:, None].to(tl.int64) * stride_wm
              + offs_n[None, :].to(tl.int64) * stride_wn)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for _s in tl.static_range(SPLIT_K):
        acc += tl.load(w_ptrs, mask=mask, other=0.0)
        w_ptrs += stride_ws
    _epilogue_store(acc, c_ptr, bias_ptr, res_ptr, pid_b, offs_m, offs_n, M, N,
                    stride_cb, stride_cm, stride_cn, stride_rb, stride_rm, stride_rn, stride_bias,
                    alpha, HAS_ALPHA, HAS_BIAS, ACTIVATION, HAS_RESIDUAL)
