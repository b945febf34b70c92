"""Triton row/column reduction kernels: sum/max, softmax, log-softmax, cross-entropy, norms.

Loaded through ``_runtime.builtin_kernels("reduction", interpret)``; ``codegen/reduction.py``
has the launchers and documents shapes and dtypes. One program handles one row and loops over
it in ``BLOCK_N`` chunks, so rows of any length work; all arithmetic is fp32. Only builtins of
``triton.language`` are used (see kernels/gemm.py for why).
"""

import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _row_max_sumexp(x_ptr, row_off, n_cols, stride_xc, BLOCK_N: tl.constexpr):
    """Online softmax statistics of one row: (max, sum(exp(x - max))), fp32 scalars."""
    cols = tl.arange(0, BLOCK_N)
    m_vec = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s_vec = tl.full((BLOCK_N,), 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        x = tl.load(x_ptr + row_off + c.to(tl.int64) * stride_xc, mask=c < n_cols,
                    other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_vec, x)
        # lanes still at -inf keep a zero sum (avoids exp(-inf - -inf) = nan)
        scale = tl.where(m_new == float("-inf"), 0.0, tl.exp(m_vec - m_new))
        s_vec = s_vec * scale + tl.where(m_new == float("-inf"), 0.0, tl.exp(x - m_new))
        m_vec = m_new
    m = tl.reduce(m_vec, 0, _max)
    s = tl.reduce(tl.where(m_vec == float("-inf"), 0.0, s_vec * tl.exp(m_vec - m)), 0, _add)
    return m, s


@triton.jit
def row_reduce_kernel(x_ptr, out_ptr, n_cols, stride_xr, stride_xc,
                      OP: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[r] = sum_c x[r, c] (OP 0) or max_c x[r, c] (OP 1). Grid: (rows,)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    if OP == 0:
        acc = tl.full((BLOCK_N,), 0.0, tl.float32)
    else:
        acc = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        if OP == 0:
            x = tl.load(x_ptr + row * stride_xr + c.to(tl.int64) * stride_xc, mask=c < n_cols, other=0.0)
            acc += x.to(tl.float32)
        else:
            x = tl.load(x_ptr + row * stride_xr + c.to(tl.int64) * stride_xc, mask=c < n_cols,
                        other=float("-inf"))
            acc = tl.maximum(acc, x.to(tl.float32))
    if OP == 0:
        r = tl.reduce(acc, 0, _add)
    else:
        r = tl.reduce(acc, 0, _max)
    tl.store(out_ptr + row, r.to(out_ptr.dtype.element_ty))


@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_cols, stride_xr, stride_xc, stride_yr, stride_yc,
                   LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[r] = softmax(x[r]) (LOG False) or log_softmax(x[r]). Grid: (rows,). Two passes."""
    row = tl.program_id(0).to(tl.int64)
    m, s = _row_max_sumexp(x_ptr, row * stride_xr, n_cols, stride_xc, BLOCK_N)
    log_s = tl.log(s)
    inv_s = 1.0 / s
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = c < n_cols
        x = tl.load(x_ptr + row * stride_xr + c.to(tl.int64) * stride_xc, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            y = x - m - log_s
        else:
            y = tl.exp(x - m) * inv_s
        tl.store(y_ptr + row * stride_yr + c.to(tl.int64) * stride_yc, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def cross_entropy_kernel(logits_ptr, target_ptr, loss_ptr, dlogits_ptr, scale_ptr,
                         n_cols, stride_lr, stride_lc, stride_dr, stride_dc, stride_t,
                         ignore_index, grad_scale,
                         HAS_SCALE_PTR: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per row r with target t: loss[r] = logsumexp(x[r]) - x[r, t];
    dlogits[r] = (softmax(x[r]) - onehot(t)) * scale. Rows with t == ignore_index: 0 and 0.
    ``scale`` is ``grad_scale`` times ``*scale_ptr`` when HAS_SCALE_PTR. Grid: (rows,)."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(target_ptr + row * stride_t).to(tl.int64)
    valid = t != ignore_index
    m, s = _row_max_sumexp(logits_ptr, row * stride_lr, n_cols, stride_lc, BLOCK_N)
    t_safe = tl.where(valid, t, 0)
    x_t = tl.load(logits_ptr + row * stride_lr + t_safe * stride_lc).to(tl.float32)
    loss = tl.where(valid, m + tl.log(s) - x_t, 0.0)
    tl.store(loss_ptr + row, loss)
    scale = grad_scale
    if HAS_SCALE_PTR:
        scale = scale * tl.load(scale_ptr).to(tl.float32)
    scale = tl.where(valid, scale, 0.0)
    inv_s = 1.0 / s
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = c < n_cols
        x = tl.load(logits_ptr + row * stride_lr + c.to(tl.int64) * stride_lc, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - m) * inv_s
        g = (p - tl.where(c.to(tl.int64) == t, 1.0, 0.0)) * scale
        tl.store(dlogits_ptr + row * stride_dr + c.to(tl.int64) * stride_dc,
                 g.to(dlogits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
                    n_cols, stride_xr, stride_yr, eps,
                    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """Layer norm (IS_RMS False): y = (x - mean) * rstd * w + b, rstd = 1/sqrt(var + eps) with the
    biased variance; RMS norm (IS_RMS True): y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps).
    Stores mean (layer norm only) and rstd per row in fp32. Columns contiguous. Grid: (rows,)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    x_row = x_ptr + row * stride_xr
    mean = 0.0
    if not IS_RMS:
        acc = tl.full((BLOCK_N,), 0.0, tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            acc += tl.load(x_row + c, mask=c < n_cols, other=0.0).to(tl.float32)
        mean = tl.reduce(acc, 0, _add) / n_cols
    acc2 = tl.full((BLOCK_N,), 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        x = tl.load(x_row + c, mask=c < n_cols, other=0.0).to(tl.float32)
        d = tl.where(c < n_cols, x - mean, 0.0)
        acc2 += d * d
    var = tl.reduce(acc2, 0, _add) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    if not IS_RMS:
        tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = c < n_cols
        x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_yr + c, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_x_g(dy_ptr, x_ptr, w_ptr, row, c, mask, stride_dyr, stride_xr, HAS_W: tl.constexpr):
    """Columns ``c`` of row ``row``: ``(x, g)`` in fp32, ``g = w * dy`` (``dy`` without weight);
    0 where ``mask`` is false. Both passes of :func:`norm_bwd_dx_kernel` read them."""
    x = tl.load(x_ptr + row * stride_xr + c, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dy_ptr + row * stride_dyr + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        g = g * tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    return x, g


@triton.jit
def norm_bwd_dx_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr,
                       n_cols, stride_dyr, stride_xr, stride_dxr,
                       IS_RMS: tl.constexpr, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx of layer norm / RMS norm for one row. With xhat = (x - mean) * rstd, g = w * dy:
    layer norm dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); RMS dx = rstd * (g - xhat *
    mean(g * xhat)). Grid: (rows,)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    rstd = tl.load(rstd_ptr + row)
    mean = 0.0
    if not IS_RMS:
        mean = tl.load(mean_ptr + row)
    acc_g = tl.full((BLOCK_N,), 0.0, tl.float32)
    acc_gx = tl.full((BLOCK_N,), 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = c < n_cols
        x, g = _norm_bwd_x_g(dy_ptr, x_ptr, w_ptr, row, c, mask, stride_dyr, stride_xr, HAS_W)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        acc_g += g
        acc_gx += g * xhat
    c_g = tl.reduce(acc_g, 0, _add) / n_cols
    c_gx = tl.reduce(acc_gx, 0, _add) / n_cols
    if IS_RMS:
        c_g = 0.0
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = c < n_cols
        x, g = _norm_bwd_x_g(dy_ptr, x_ptr, w_ptr, row, c, mask, stride_dyr, stride_xr, HAS_W)
        xhat = (x - mean) * rstd
        dx = rstd * (g - c_g - xhat * c_gx)
        tl.store(dx_ptr + row * stride_dxr + c, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def column_sum_kernel(a_ptr, x_ptr, mean_ptr, rstd_ptr, out_a_ptr, out_b_ptr,
                      n_rows, n_cols, rows_per_split,
                      stride_ar, stride_ac, stride_xr, stride_xc, stride_os,
                      MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Column sums over a slice of rows. Grid: (cdiv(n_cols, BLOCK_N), splits); split s covers
    rows [s * rows_per_split, (s + 1) * rows_per_split) and writes row s of the outputs
    (``stride_os`` apart; the launcher sums the splits with a second MODE 0 pass).

    MODE 0: out_a[n] = sum_r a[r, n].
    MODE 1 (layer norm weight/bias grads, a = dy): out_a[n] = sum_r dy * (x - mean[r]) * rstd[r],
            out_b[n] = sum_r dy.
    MODE 2 (RMS norm weight grad): out_a[n] = sum_r dy * x * rstd[r].
    """
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < n_cols
    acc_a = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_b = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    r_start = split * rows_per_split
    r_end = tl.minimum(n_rows, r_start + rows_per_split)
    for r0 in range(r_start, r_end, BLOCK_M):
        r = (r0 + offs_m).to(tl.int64)
        mask_r = r < r_end
        mask = mask_r[:, None] & mask_n[None, :]
        a = tl.load(a_ptr + r[:, None] * stride_ar + offs_n[None, :].to(tl.int64) * stride_ac,
                    mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:
            acc_a += a
        else:
            x = tl.load(x_ptr + r[:, None] * stride_xr + offs_n[None, :].to(tl.int64) * stride_xc,
                        mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + r, mask=mask_r, other=0.0)
            if MODE == 1:
                mean = tl.load(mean_ptr + r, mask=mask_r, other=0.0)
                acc_a += a * (x - mean[:, None]) * rstd[:, None]
                acc_b += a
            else:
                acc_a += a * x * rstd[:, None]
    out_off = split.to(tl.int64) * stride_os + offs_n
    tl.store(out_a_ptr + out_off, tl.reduce(acc_a, 0, _add).to(out_a_ptr.dtype.element_ty), mask=mask_n)
    if MODE == 1:
        tl.store(out_b_ptr + out_off, tl.reduce(acc_b, 0, _add).to(out_b_ptr.dtype.element_ty), mask=mask_n)
