"""PyTorch frontend: trace one whole training step (forward, loss, backward, AdamW) into the IR.

``trace_step(model, batch, loss_fn)`` captures the step's joint graph, as AOTAutograd does:

    loss = functional_call(model, params + buffers, batch)     # params require grad
    grads = torch.autograd.grad(loss, params)                  # autograd runs the backward
    params', m', v' = AdamW(params, grads, m, v, step)         # written in torch ops, no_grad

all inside one ``make_fx`` (``tracing_mode="fake"`` by default, so a 1B-parameter model costs no
memory: parameters and the batch may live on the ``meta`` device or be fake tensors), which
records the ATen ops of forward, backward and update below autograd, through
``core_aten_decompositions()`` plus :func:`decomposition_table`'s extras (layer norm, softmax,
GELU, ...). Why this capture: the model runs on plain FakeTensors, exactly as under
``torch.compile``/``torch.export`` (so library code that checks "am I being traced?", such as
transformers' ``is_tracing``, takes its tracing path instead of asking a tensor for its value),
autograd itself derives the backward (every op with a derivative formula works, custom
``autograd.Function`` included), and in-place buffer updates (BatchNorm's running statistics)
are ordinary ATen ops on the buffer inputs, returned as step outputs. ``torch.func.grad``
(the previous capture) hands the model functorch wrapper tensors instead, which libraries cannot
recognize as traced and which forbid in-place updates of closed-over buffers.

``F.scaled_dot_product_attention`` is routed while tracing (:class:`_DecomposeSDPA`) to the custom
op ``sftctl::attention`` (forward: O and the row log-sum-exp) whose autograd formula is
``sftctl::attention_backward`` (dQ, dK, dV from Q, K, V, O, dO, LSE), so attention arrives as the
IR's ``attention`` / ``attention_lse`` / ``attention_grad`` ops: one flash-attention kernel each way,
with no S x S score matrix. All SDPA forms lower: masks (bool or additive, broadcast), ``is_causal``,
``scale``, GQA (``enable_gqa``, K/V kept at their own head count) and ``dropout_p`` (the op draws its
keep-mask from a random stream numbered by call). A mask that requires grad falls back to the
materialized math (:func:`_sdpa_math`). Attention written out by hand (matmul, softmax, matmul;
transformers' ``attn_implementation="eager"``) stays that, as it runs on a GPU.

Dropout (``aten.native_dropout``) lowers to an ``rng_bernoulli`` keep-mask (a bool tensor: what
torch saves for backward, 1 byte per element) and a ``where``; its backward reads the mask.
Sampling inside the step (``rand``, ``randn``, ``randint``, ``normal_``, ``uniform_`` and their
``_like`` forms, e.g. a diffusion model's noise and timesteps) lowers to ``rng_uniform`` draws:
normals by the Box-Muller transform, integers by scaling and truncation.

make_fx records each node's ``nn_module_stack`` and ``stack_trace``: an ATen op without a lowering
raises ``NotImplementedError`` naming the op, the module path and the model's file:line, and a
data-dependent branch (Python control flow on a tensor's value) names the model's line that took it.

The graph (see :mod:`sftctl.compiler.ir`):

* inputs, in this order: role ``param`` (trainable parameters, ``named_parameters()`` order with
  tied parameters once), ``opt_state`` (``<name>.exp_avg`` for each parameter, then
  ``<name>.exp_avg_sq``), ``buffer`` (buffers and frozen parameters), ``step`` (float32 scalar:
  the 1-based number of this step, i.e. torch's ``state["step"]`` after its increment), ``batch``
  (the tensor leaves of ``batch`` in ``torch.utils._pytree`` order). Non-uniform tensor constants
  captured from the program become inputs of role ``constant`` carrying ``attrs["value"]``.
* outputs: ``loss``, then ``param:<name>`` for each parameter, then
  ``opt_state:<name>.exp_avg`` for each, then ``opt_state:<name>.exp_avg_sq`` for each, then
  ``buffer:<name>`` for each buffer the step updated in place (e.g. BatchNorm's ``running_mean``,
  ``running_var``, ``num_batches_tracked`` in train mode), its value after the step.

AdamW is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction, ``eps`` added after the
square root), optionally preceded by ``clip_grad_norm_`` (``grad_clip``); ``lr``, betas, eps and the
weight decay are baked into the graph as constants, the step count is an input. ``weight_decay``
may be a callable ``(name, param) -> float`` for per-parameter groups (e.g. no decay for 1-D).

Mixed precision (``autocast_dtype`` / ``trace_entrypoint(dtype=...)``): parameters, gradients and
AdamW state stay in the model's dtype (float32 master weights) and the loss is computed under
``torch.autocast("cpu", dtype)`` as examples/gpt/train.py does on GPU, so the trace holds the
casts autocast inserts: matmuls (``dot_general``, with the linear layers' bias adds) and the
attention op (q, k, v cast to the autocast dtype, as CUDA autocast does for SDPA; its softmax
statistics in float32 as flash attention keeps them) run in bfloat16/float16, while layer norm,
GELU (computed in float32 by its decomposition) and the loss stay float32. The CPU autocast op lists are
used; for the ops a transformer uses (linear, matmul, bmm, baddbmm) they agree with CUDA's.
This is the one scheme a spec's ``model.dtype`` names in both frontends: the JAX frontend gives
the same float32 master weights and AdamW state with bfloat16/float16 compute
(``frontends/jax.py``, ``compute_dtype``).

Lowering notes: ``cumsum`` is the IR's ``cumsum`` scan and ``flip`` its ``reverse``; ``torch.gather`` / ``scatter`` (take-along-axis forms) become an IR ``gather`` /
``scatter_add`` on the flattened tensor with a computed linear index; ``index`` / ``index_put``
with adjacent index tensors merge the indexed dims the same way; a scatter with one index per row
(``nll_loss`` backward) is a compare against an ``iota`` (elementwise, so it fuses into its
consumer as Inductor's lowering does); other non-accumulating scatters use a
``scatter_add`` of ones as the written mask (exact for unique indices, as torch itself only
defines them).
``convolution`` (N-d, stride, padding, dilation, groups, transposed) and ``convolution_backward``
become IR ``conv`` nodes (input gradient: a ``conv`` of the output gradient dilated by the
stride with the flipped, channel-swapped kernel; weight gradient: a batch-grouped ``conv`` of the
input with the output gradient as kernel). ``max_pool2d_with_indices`` is a ``maximum`` over
strided slices of the -inf-padded input with torch's first-maximum indices, its backward a
``scatter_add``; ``avg_pool2d`` (and ``_adaptive_avg_pool2d`` when the sizes divide) sums strided
slices and divides by torch's window counts, its backward places the gradient back with pads and
reshapes. Batch norm (every ``native_batch_norm`` variant) uses torch's decompositions.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
import time
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from sftctl.compiler.ir import FLOAT_DTYPES, Graph, GraphBuilder, row_major_strides

aten = torch.ops.aten

_IR_DTYPES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
              torch.float16: "float16", torch.int64: "int64", torch.int32: "int32", torch.bool: "bool"}

# extra decompositions on top of core_aten_decompositions(): ops core ATen keeps but the IR spells out
_EXTRA_DECOMPS = (
    "native_layer_norm", "native_group_norm", "gelu", "_softmax", "_log_softmax", "addcmul", "addcdiv", "lerp", "logsumexp", "softplus", "hardtanh",
    "leaky_relu", "elu", "hardswish", "hardsigmoid", "mish", "log_sigmoid_forward", "rsub",
    "masked_fill", "linalg_vector_norm", "norm", "glu", "huber_loss", "smooth_l1_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "xlogy", "logit", "stack", "repeat",
    "tril", "triu", "_unsafe_index", "index_add",
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training",
)


def decomposition_table() -> dict:
    """``core_aten_decompositions()`` plus the extras the lowering relies on, less the ops the
    lowering keeps whole (``native_dropout`` and its backward: a bool keep-mask, as torch saves
    it, instead of the decomposition's float mask)."""
    from torch._decomp import core_aten_decompositions, get_decompositions

    table = dict(core_aten_decompositions())
    table.update(get_decompositions([getattr(aten, n) for n in _EXTRA_DECOMPS if hasattr(aten, n)]))
    for op in _KEEP_WHOLE:
        for overload in op.overloads():
            table.pop(getattr(op, overload), None)
    return table


_KEEP_WHOLE = (aten.native_dropout, aten.native_dropout_backward)


def ir_dtype(dtype: torch.dtype) -> str:
    try:
        return _IR_DTYPES[dtype]
    except KeyError:
        raise NotImplementedError(f"torch frontend: dtype {dtype} has no IR dtype") from None


# ------------------------------------------------------------------------------------------------
# tracing
# ------------------------------------------------------------------------------------------------


class _LossModule(torch.nn.Module):
    """Holds the model so ``functional_call`` can swap its parameters around ``loss_fn``."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable) -> None:
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn

    def forward(self, batch):
        return self._loss_fn(self.model, batch)


def _sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    """``scaled_dot_product_attention`` as matmul, mask, float32 softmax, matmul (materialized).

    Used only where the attention op cannot stand for the call (a mask that needs a gradient,
    as T5's learned position bias: flash kernels give no bias gradient, so this is what runs).
    The softmax runs in float32 and its result is cast back to the query's dtype before the second
    matmul, as flash attention does; dropout applies to the probabilities (``native_dropout``), as
    in torch's math kernel. Rows that a boolean mask masks completely give NaN here, where torch's
    math kernel gives 0.
    """
    L, S = query.shape[-2], key.shape[-2]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(rep, dim=-3)
        value = value.repeat_interleave(rep, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.arange(S, device=query.device)[None, :] <= torch.arange(L, device=query.device)[:, None]
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    if dropout_p:
        probs = _dropout(probs, dropout_p, True)
    return torch.matmul(probs, value)


# --- the attention op: F.scaled_dot_product_attention as one op with a flash-attention backward ---


def _attn_keep(shape, dropout_p: float, rng: int, device) -> torch.Tensor:
    """A keep-mask for attention dropout in real mode (deterministic per ``rng``)."""
    gen = torch.Generator(device="cpu").manual_seed(1_000_003 * int(rng) + 17)
    return (torch.rand(shape, generator=gen) >= dropout_p).to(device)


def _attn_reference(q, k, v, mask, causal: bool, scale: float, dropout_p: float, rng: int):
    """Exact attention in ``q``'s dtype (real mode): (P, dropped P, LSE float32, K, V repeated)."""
    group = q.shape[1] // k.shape[1]
    kr = k.repeat_interleave(group, dim=1) if group != 1 else k
    vr = v.repeat_interleave(group, dim=1) if group != 1 else v
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.matmul(q.to(acc), kr.to(acc).transpose(-2, -1)) * scale
    L, S = s.shape[-2], s.shape[-1]
    if causal:
        keep = torch.arange(S, device=q.device)[None, :] <= torch.arange(L, device=q.device)[:, None]
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(acc)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    p = torch.where(den > 0, e / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(e))
    lse = torch.where(den[..., 0] > 0, torch.log(torch.where(den > 0, den, torch.ones_like(den)))[..., 0] + m[..., 0],
                      torch.full_like(m[..., 0], float("inf")))
    pd, keepm = p, None
    if dropout_p > 0:
        keepm = _attn_keep(p.shape, dropout_p, rng, q.device)
        pd = torch.where(keepm, p / (1 - dropout_p), torch.zeros_like(p))
    return p, pd, lse.to(torch.float32), kr.to(acc), vr.to(acc), keepm, group, acc


@torch.library.custom_op("sftctl::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  causal: bool, scale: float, dropout_p: float, rng: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward (see the IR's ``attention``): q [B,Hq,L,D], k [B,Hkv,S,D], v [B,Hkv,S,Dv],
    mask None or 4-D broadcastable to [B,Hq,L,S] -> (O [B,Hq,L,Dv] in q's dtype, LSE [B,Hq,L] float32)."""
    _, pd, lse, _, vr, _, _, _ = _attn_reference(q, k, v, mask, causal, scale, dropout_p, rng)
    return torch.matmul(pd, vr).to(q.dtype), lse


@_attention_op.register_fake
def _(q, k, v, mask, causal, scale, dropout_p, rng):
    return (q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],)),
            q.new_empty(tuple(q.shape[:-1]), dtype=torch.float32))


@torch.library.custom_op("sftctl::attention_backward", mutates_args=())
def _attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None, o: torch.Tensor, lse: torch.Tensor, causal: bool,
                           scale: float, dropout_p: float, rng: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash-attention backward: (dQ, dK, dV) in the shapes and dtypes of q, k, v."""
    p, pd, _, kr, vr, keepm, group, acc = _attn_reference(q, k, v, mask, causal, scale, dropout_p, rng)
    do_ = do.to(acc)
    dv = torch.matmul(pd.transpose(-2, -1), do_)
    dpd = torch.matmul(do_, vr.transpose(-2, -1))
    dpp = dpd if keepm is None else torch.where(keepm, dpd / (1 - dropout_p), torch.zeros_like(dpd))
    ds = p * (dpp - (dpp * p).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(ds, kr)
    dk = torch.matmul(ds.transpose(-2, -1), q.to(acc))
    if group != 1:
        b, h, s_, _ = dk.shape
        dk = dk.reshape(b, h // group, group, s_, -1).sum(2)
        dv = dv.reshape(b, h // group, group, s_, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_attention_backward_op.register_fake
def _(do, q, k, v, mask, o, lse, causal, scale, dropout_p, rng):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup(ctx, inputs, output):
    q, k, v, mask, causal, scale, dropout_p, rng = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, mask, o, lse)
    ctx.attrs = (causal, scale, dropout_p, rng)


def _attention_grad(ctx, do, dlse):
    q, k, v, mask, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.sftctl.attention_backward(do, q, k, v, mask, o, lse, *ctx.attrs)
    return dq, dk, dv, None, None, None, None, None


_attention_op.register_autograd(_attention_grad, setup_context=_attention_setup)


def _sdpa_to_op(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, *, rng: int = 0):
    """``F.scaled_dot_product_attention`` through ``sftctl::attention`` (4-D [B, H, L, D] form).

    Under autocast, q, k, v (and a float mask) are cast to the autocast dtype, as SDPA is on
    CUDA's lower-precision list. Leading dims other than the head dim are flattened into B; a
    3-D call is one batch of heads. GQA (``enable_gqa``) keeps K and V at their own head count.
    Falls back to :func:`_sdpa_math` (materialized scores) where a mask needs a gradient.
    """
    if attn_mask is not None and attn_mask.requires_grad:
        return _sdpa_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if torch.is_autocast_enabled("cpu"):
        dt = torch.get_autocast_dtype("cpu")
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.to(dt)
    if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
        raise NotImplementedError(f"torch frontend: scaled_dot_product_attention with query {tuple(query.shape)}, "
                                  f"key {tuple(key.shape)}, value {tuple(value.shape)} (needs >= 3 matching dims)")
    lead = tuple(query.shape[:-3])
    hq, L, D = query.shape[-3:]
    hk, S = key.shape[-3], key.shape[-2]
    if hk != hq and not (enable_gqa and hq % hk == 0):
        raise NotImplementedError(f"torch frontend: scaled_dot_product_attention with {hq} query heads and "
                                  f"{hk} key heads without enable_gqa")
    B = math.prod(lead)
    q4 = query.reshape(B, hq, L, D)
    k4 = key.expand(*lead, *key.shape[-3:]).reshape(B, hk, S, D)
    v4 = value.expand(*lead, *value.shape[-3:]).reshape(B, hk, S, value.shape[-1])
    m4 = None
    if attn_mask is not None:
        m = attn_mask
        while m.dim() < max(query.dim(), 4):
            m = m.unsqueeze(0)
        if m.dim() > 4:  # fold the extra leading dims into B
            m = m.expand(*lead, *m.shape[-3:]).reshape(B, *m.shape[-3:])
        m4 = m
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out, _ = torch.ops.sftctl.attention(q4, k4, v4, m4, bool(is_causal), scale, float(dropout_p), int(rng))
    return out.reshape(*lead, hq, L, value.shape[-1])


def _dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as the GPU runs it: ``aten.native_dropout`` (a bool keep-mask saved for
    backward), where torch's CPU path would multiply by a float noise tensor. ``inplace`` returns
    the result instead of writing it into ``input``."""
    if not training or p == 0:
        return input
    return torch.ops.aten.native_dropout(input, float(p), True)[0]


_F_SDPA = torch.nn.functional.scaled_dot_product_attention
_F_DROPOUT = torch.nn.functional.dropout


class _DecomposeSDPA(torch.overrides.TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to the attention op (:func:`_sdpa_to_op`) while
    tracing, numbering the calls so each dropout draws from its own random stream, and
    ``F.dropout`` to ``native_dropout`` (:func:`_dropout`)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _F_SDPA:
            return self.sdpa(*args, **kwargs)
        if func is _F_DROPOUT:
            return _dropout(*args, **kwargs)
        return func(*args, **kwargs)

    def sdpa(self, *args, **kwargs):
        self.calls += 1
        return _sdpa_to_op(*args, **kwargs, rng=self.calls)

    @contextlib.contextmanager
    def patched(self):
        """``F.scaled_dot_product_attention`` and ``F.dropout`` replaced at module level, for as
        long as the context lasts: what routes the calls that activation checkpointing recomputes
        in backward (inside ``torch.autograd.grad`` this mode is off, as a mode is while it
        handles a call). Code holding its own reference to those functions is routed by the mode
        in the forward only."""
        F = torch.nn.functional
        F.scaled_dot_product_attention, F.dropout = self.sdpa, _dropout
        try:
            yield
        finally:
            F.scaled_dot_product_attention, F.dropout = _F_SDPA, _F_DROPOUT


def _adamw(params, grads, ms, vs, step, *, lr, betas, eps, decays, grad_clip):
    b1, b2 = betas
    if grad_clip is not None:
        sq = [torch.sum(g.to(torch.float32) * g.to(torch.float32)) if g.dtype in (torch.bfloat16, torch.float16)
              else torch.sum(g * g) for g in grads]
        total = torch.sqrt(sum(sq[1:], sq[0]))
        coef = torch.clamp(grad_clip / (total + 1e-6), max=1.0)
        grads = [g * coef.to(g.dtype) for g in grads]
    bias1 = 1 - torch.pow(b1, step)
    bias2_sqrt = torch.sqrt(1 - torch.pow(b2, step))
    step_size = lr / bias1
    new_p, new_m, new_v = [], [], []
    for p, g, m, v, wd in zip(params, grads, ms, vs, decays):
        g = g.to(p.dtype)
        m2 = m + (g - m) * (1 - b1)  # exp_avg.lerp_(grad, 1 - beta1)
        v2 = v * b2 + g * g * (1 - b2)  # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
        p2 = p * (1 - lr * wd) if wd else p
        denom = torch.sqrt(v2) / bias2_sqrt.to(v2.dtype) + eps
        p2 = p2 - step_size.to(p.dtype) * (m2 / denom)
        new_p.append(p2)
        new_m.append(m2)
        new_v.append(v2)
    return new_p, new_m, new_v


def _reparametrized(module: torch.nn.Module, state: dict):
    """``module`` with its parameters and buffers swapped for ``state`` (tied names follow), as
    ``torch.func.functional_call`` does, for as long as the context lasts."""
    try:
        from torch.nn.utils.stateless import _reparametrize_module
    except ImportError:  # pragma: no cover - private API moved
        return _reparametrize_fallback(module, state)
    return _reparametrize_module(module, state, tie_weights=True)


@contextlib.contextmanager
def _reparametrize_fallback(module, state):  # pragma: no cover - used only if torch moves the API
    saved = {}
    for name, t in state.items():
        mod_path, _, attr = name.rpartition(".")
        mod = module.get_submodule(mod_path)
        saved[name] = (mod, attr, mod._parameters.get(attr, mod._buffers.get(attr)))
        store = mod._parameters if attr in mod._parameters else mod._buffers
        store[attr] = t
    try:
        yield
    finally:
        for mod, attr, t in saved.values():
            store = mod._parameters if attr in mod._parameters else mod._buffers
            store[attr] = t


def _mutated_inputs(gm: fx.GraphModule, first: int, count: int) -> list[int]:
    """Indices ``0..count-1`` of the placeholders ``first..first+count-1`` that an op of ``gm``
    writes in place (an argument its schema marks as written: ``copy_``, ``add_``, ...). A
    decomposition's ``copy_`` into a running statistic is seen here, where autograd's version
    counter is not (``native_batch_norm`` does not declare its running stats as written)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][first:first + count]
    index = {n: i for i, n in enumerate(placeholders)}
    out: set[int] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        for k, arg in enumerate(n.target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            val = n.args[k] if k < len(n.args) else n.kwargs.get(arg.name)
            if isinstance(val, fx.Node) and val in index:
                out.add(index[val])
    return sorted(out)


def _model_frame(tb) -> str:
    """``file:line (function)`` of the innermost traceback frame in the model's code: the first
    frame, from the inside out, that is not in torch, in this compiler or in the standard library."""
    import os
    import sysconfig
    import traceback

    skip = tuple(os.path.dirname(m) + os.sep for m in (torch.__file__, __file__))
    skip += (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)
    frames = traceback.extract_tb(tb)
    for f in reversed(frames):
        if not os.path.abspath(f.filename).startswith(skip):
            return f"{f.filename}:{f.lineno} ({f.name})"
    return "an unknown place (no frame outside torch)"


def _stack_frame(stack_trace: str | None) -> str | None:
    """The innermost ``file:line`` of an fx node's recorded ``stack_trace`` outside torch."""
    import os
    import re

    if not stack_trace:
        return None
    tdir = os.path.dirname(torch.__file__) + os.sep
    found = None
    for m in re.finditer(r'File "([^"]+)", line (\d+), in (\S+)', stack_trace):
        if not m.group(1).startswith(tdir) and "sftctl/compiler/" not in m.group(1):
            found = f"{m.group(1)}:{m.group(2)} ({m.group(3)})"
    return found


@contextlib.contextmanager
def _module_stack_meta(root: torch.nn.Module):
    """Record each traced node's module path, as ``node.meta["nn_module_stack"]`` (an ordered dict
    ``path -> (path, "module.QualName")``, outermost first, paths relative to ``root``; the
    convention of torch.export), through global module hooks and FX's preserved node meta (much
    cheaper than make_fx's ``record_module_stack`` tracer). Backward nodes get their forward
    node's stack as ``meta["fwd_nn_module_stack"]`` (:func:`_backward_module_stacks`)."""
    from torch.fx import traceback as fx_traceback
    from torch.nn.modules import module as nn_module

    paths: dict[int, str] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), name)
    saved: list = []

    def pre(mod, args):
        path = paths.get(id(mod))
        if path is None:
            return
        stack = fx_traceback.current_meta.get("nn_module_stack")
        saved.append(stack)
        new = dict(stack or {})
        new[path] = (path, f"{type(mod).__module__}.{type(mod).__qualname__}")
        fx_traceback.current_meta["nn_module_stack"] = new

    def post(mod, args, out):
        if id(mod) not in paths or not saved:
            return
        prev = saved.pop()
        if prev is None:
            fx_traceback.current_meta.pop("nn_module_stack", None)
        else:
            fx_traceback.current_meta["nn_module_stack"] = prev

    with fx_traceback.preserve_node_meta():
        h1 = nn_module.register_module_forward_pre_hook(pre)
        h2 = nn_module.register_module_forward_hook(post, always_call=True)
        try:
            yield
        finally:
            h1.remove()
            h2.remove()


def _tag_backward(loss: torch.Tensor) -> None:
    """Let backward nodes carry their forward op's autograd sequence number (AOTAutograd's hooks)."""
    try:
        from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks
    except ImportError:  # private API moved: backward nodes go without module paths
        return
    if loss.grad_fn is not None:
        setup_stacktrace_preservation_hooks([loss.grad_fn])


def _backward_module_stacks(gm: fx.GraphModule) -> None:
    """Give each backward node (``meta["autograd_backward"]``) the ``nn_module_stack`` of the
    forward node with its autograd ``seq_nr``, as ``meta["fwd_nn_module_stack"]`` (what
    AOTAutograd's ``copy_fwd_metadata_to_bw_nodes`` does for its joint graphs)."""
    fwd: dict[int, dict] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and not n.meta.get("autograd_backward") and "seq_nr" in n.meta:
            if n.meta.get("nn_module_stack"):
                fwd.setdefault(n.meta["seq_nr"], n.meta["nn_module_stack"])
    for n in gm.graph.nodes:
        if n.meta.get("autograd_backward") and n.meta.get("seq_nr") in fwd:
            n.meta["fwd_nn_module_stack"] = fwd[n.meta["seq_nr"]]


@contextlib.contextmanager
def _model_errors():
    """Turn a data-dependent branch met while tracing into a NotImplementedError that names the
    model's line that took it and what to try."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode,
            RuntimeError) as e:
        if isinstance(e, RuntimeError) and "_local_scalar_dense" not in str(e):
            raise  # only real-mode make_fx's "value out of a tracing tensor" is a data-dependent branch
        what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NotImplementedError(
            f"torch frontend: the model's code at {_model_frame(e.__traceback__)} needs a tensor's value "
            f"while tracing ({type(e).__name__}: {what}); the step is traced without data, so Python "
            "control flow or shapes cannot depend on tensor values: compute it from the batch's shape, "
            "use torch.where instead of an if, or move it out of the step"
            + ("; with fake=False the model sees real tensors, so libraries that take another path when "
               "traced (transformers' masks) do not: trace with fake=True" if isinstance(e, RuntimeError) else "")
        ) from e


def trace_step(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    *,
    optimizer: str = "adamw",
    lr: float = 3e-4,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | Callable[[str, torch.Tensor], float] = 0.01,
    grad_clip: float | None = None,
    fake: bool = True,
    autocast_dtype: str | torch.dtype | None = None,
) -> tuple[Graph, dict[str, Any]]:
    """Trace one training step of ``model`` on ``batch`` into an IR graph.

    Args:
        model: the module; its parameters may be real, fake or on the ``meta`` device (``meta``
            needs ``fake=True``).
        batch: any pytree of tensors (and constants) that ``loss_fn`` takes.
        loss_fn: ``loss_fn(model, batch) -> scalar``.
        optimizer: only ``"adamw"``.
        lr, betas, eps, weight_decay, grad_clip: AdamW hyperparameters (see the module docstring).
        fake: trace with fake tensors (no memory, no compute); False runs the step for real while
            tracing (small models; needed for tensor constants whose values the graph must hold).
        autocast_dtype: None, or ``bfloat16``/``float16`` to run the loss under ``torch.autocast``.

    Returns:
        ``(graph, meta)``: ``meta`` has ``params`` / ``opt_state`` / ``buffers`` (name -> input node
        id), ``step`` (id), ``batch`` (ids, pytree order), ``batch_names``, ``param_names``,
        ``outputs`` (role -> index into ``graph.outputs``), ``n_params``, ``hyper``, ``fx_nodes``,
        ``trace_s``, ``lower_s``.

    Raises:
        NotImplementedError: an ATen op, dtype or form the lowering does not support (named).
        ValueError: an unknown optimizer, or meta tensors with ``fake=False``.
    """
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if optimizer != "adamw":
        raise ValueError(f"optimizer must be 'adamw', got {optimizer!r}")
    if isinstance(autocast_dtype, str):
        autocast_dtype = None if autocast_dtype == "float32" else getattr(torch, autocast_dtype)
    wrapper = _LossModule(model, loss_fn)
    named = list(wrapper.named_parameters())  # tied parameters once
    trainable = [(n, p) for n, p in named if p.requires_grad]
    frozen = [(n, p) for n, p in named if not p.requires_grad] + list(wrapper.named_buffers())
    pnames = [n[len("model."):] for n, _ in trainable]
    bnames = [n[len("model."):] for n, _ in frozen]
    decays = [float(weight_decay(n, p) if callable(weight_decay) else weight_decay)
              for n, (_, p) in zip(pnames, trainable)]
    leaves, spec = pytree.tree_flatten(batch)
    tpos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    batch_paths = [pytree.keystr(k) for k, _ in pytree.tree_flatten_with_path(batch)[0]]
    batch_names = ["batch" + batch_paths[i] for i in tpos]

    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

        mode = FakeTensorMode()

        def to_input(t: torch.Tensor) -> torch.Tensor:
            if is_fake(t) or t.device.type == "meta":
                with mode:
                    dev = "cpu" if t.device.type == "meta" else t.device
                    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev)
            return mode.from_tensor(t.detach())

        def zeros_like(t: torch.Tensor) -> torch.Tensor:
            return to_input(t)
    else:
        def to_input(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "meta":
                raise ValueError("meta tensors need fake=True")
            return t.detach().clone()

        def zeros_like(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(t.detach())

    p_in = [to_input(p).requires_grad_(True) for _, p in trainable]
    m_in = [zeros_like(p) for _, p in trainable]
    v_in = [zeros_like(p) for _, p in trainable]
    b_in = [to_input(b) for _, b in frozen]
    s_in = to_input(torch.ones((), dtype=torch.float32)) if fake else torch.ones((), dtype=torch.float32)
    x_in = [to_input(leaves[i]) for i in tpos]

    def step_fn(params, ms, vs, bufs, step, xs):
        # The joint graph, as AOTAutograd builds it: the forward runs under autograd on tensors
        # that require grad, torch.autograd.grad runs its backward, and make_fx records the ATen
        # ops of both below autograd. The model sees plain (fake) tensors, not functorch wrappers.
        vals = list(leaves)
        for i, x in zip(tpos, xs):
            vals[i] = x
        b = pytree.tree_unflatten(vals, spec)
        state = {**{"model." + n: t for n, t in zip(pnames, params)},
                 **{"model." + n: t for n, t in zip(bnames, bufs)}}
        ctx = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
        # The module holds the traced parameters through forward AND backward (functional_call's
        # swap would end with the forward), so activation checkpointing's recomputation in
        # backward (torch.utils.checkpoint, transformers' gradient_checkpointing) runs on them too.
        # Phases for the execution-mode predictions (sftctl.compiler.modes), as node.meta["custom"].
        route = _DecomposeSDPA()
        with _reparametrized(wrapper, state), route.patched():
            with torch.enable_grad(), ctx, route, fx_traceback.annotate({"phase": "forward"}):
                loss = wrapper(b)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                 + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
            _tag_backward(loss)
            with fx_traceback.annotate({"phase": "backward"}):
                grads = list(torch.autograd.grad(loss, list(params), allow_unused=True)) if params else []
                grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        with torch.no_grad(), fx_traceback.annotate({"phase": "optimizer"}):
            new_p, new_m, new_v = _adamw([p.detach() for p in params], grads, ms, vs, step, lr=lr, betas=betas,
                                         eps=eps, decays=decays, grad_clip=grad_clip)
        return loss.detach(), new_p, new_m, new_v, list(bufs)

    t0 = time.perf_counter()
    with sdpa_kernel(SDPBackend.MATH), _model_errors(), _module_stack_meta(wrapper):
        gm = make_fx(step_fn, decomposition_table=decomposition_table(),
                     tracing_mode="fake" if fake else "real")(p_in, m_in, v_in, b_in, s_in, x_in)
    _backward_module_stacks(gm)
    t1 = time.perf_counter()
    gm.graph.eliminate_dead_code()
    mutated = _mutated_inputs(gm, first=3 * len(pnames), count=len(bnames))
    n = len(pnames)
    roles = (
        [("param", nm) for nm in pnames] + [("opt_state", nm + ".exp_avg") for nm in pnames]
        + [("opt_state", nm + ".exp_avg_sq") for nm in pnames] + [("buffer", nm) for nm in bnames]
        + [("step", "step")] + [("batch", nm) for nm in batch_names]
    )
    out_roles = (["loss"] + [f"param:{nm}" for nm in pnames] + [f"opt_state:{nm}.exp_avg" for nm in pnames]
                 + [f"opt_state:{nm}.exp_avg_sq" for nm in pnames] + [f"buffer:{bnames[i]}" for i in mutated])
    keep = list(range(1 + 3 * len(pnames))) + [1 + 3 * len(pnames) + i for i in mutated]
    graph, input_ids = _Lowering(gm).run(roles, out_roles, keep_outputs=keep)
    t2 = time.perf_counter()
    ids = dict(zip(range(len(roles)), input_ids))
    meta: dict[str, Any] = {
        "params": {nm: ids[i] for i, nm in enumerate(pnames)},
        "opt_state": {**{nm + ".exp_avg": ids[n + i] for i, nm in enumerate(pnames)},
                      **{nm + ".exp_avg_sq": ids[2 * n + i] for i, nm in enumerate(pnames)}},
        "buffers": {nm: ids[3 * n + i] for i, nm in enumerate(bnames)},
        "step": ids[3 * n + len(bnames)],
        "batch": [ids[3 * n + len(bnames) + 1 + i] for i in range(len(batch_names))],
        "batch_names": batch_names,
        "param_names": pnames,
        "outputs": {r: i for i, r in enumerate(out_roles)},
        "n_params": sum(p.numel() for _, p in trainable),
        "hyper": {"optimizer": optimizer, "lr": lr, "betas": tuple(betas), "eps": eps,
                  "weight_decay": dict(zip(pnames, decays)), "grad_clip": grad_clip,
                  "autocast_dtype": str(autocast_dtype).replace("torch.", "") if autocast_dtype else None},
        "fx_nodes": len(gm.graph.nodes),
        "trace_s": t1 - t0,
        "lower_s": t2 - t1,
    }
    return graph, meta


def trace_entrypoint(entrypoint: str, workdir: str, batch_size: int, dtype: str = "float32", *,
                     fake: bool = True, mixed_precision: bool = True, **step_kwargs: Any) -> tuple[Graph, dict]:
    """Import ``file.py:function`` (relative to ``workdir``), build and trace its training step.

    ``function(batch_size=..., dtype=...)`` must return ``(model, example_batch, loss_fn)``. With
    ``mixed_precision`` (the default) and a ``dtype`` of bfloat16/float16 the model is built in
    float32 (master weights, as examples/gpt/train.py trains) and the loss traced under autocast to
    ``dtype``; with ``mixed_precision=False`` it is built in ``dtype`` and traced as is. With
    ``fake`` the build runs under ``torch.device("meta")`` (no parameter memory; falls back to a
    real build if the function cannot build on meta). ``step_kwargs`` go to :func:`trace_step`.
    """
    from sftctl.compiler.frontends import load_entrypoint

    fn = load_entrypoint(entrypoint, workdir)
    amp = mixed_precision and dtype != "float32"
    build_dtype = "float32" if amp else dtype
    built_on = "real"
    if fake:
        try:
            with torch.device("meta"):
                model, batch, loss_fn = fn(batch_size=batch_size, dtype=build_dtype)
            built_on = "meta"
        except Exception:  # noqa: BLE001 - any failure on meta: build for real
            model, batch, loss_fn = fn(batch_size=batch_size, dtype=build_dtype)
    else:
        model, batch, loss_fn = fn(batch_size=batch_size, dtype=build_dtype)
    graph, meta = trace_step(model, batch, loss_fn, fake=fake, autocast_dtype=dtype if amp else None,
                             **step_kwargs)
    meta.update(entrypoint=entrypoint, dtype=dtype, built_on=built_on,
                precision=f"autocast {dtype}, float32 master weights" if amp else dtype)
    return graph, meta


# ------------------------------------------------------------------------------------------------
# lowering: ATen FX graph -> IR
# ------------------------------------------------------------------------------------------------




def _norm_dims(dims, rank: int) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return tuple(range(rank))
    return tuple(sorted(d % rank if rank else 0 for d in dims))


class _Lowering(GraphBuilder):
    """Lowers a make_fx ATen graph to an IR :class:`Graph`, one handler per ATen op packet."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm
        self.env: dict[fx.Node, Any] = {}
        self._node: fx.Node | None = None
        self._rng = 1 << 20  # random streams of dropout ops (attention dropout uses its call number)

    def bcast(self, i: int, shape) -> int:
        """numpy-style (trailing-aligned) explicit broadcast."""
        shape = tuple(int(s) for s in shape)
        src = self.shape(i)
        if src == shape:
            return i
        n = self.g.nodes[i]
        if n.op == "constant":
            return self.const(n.attrs["value"], shape, n.type.dtype)
        dims = tuple(range(len(shape) - len(src), len(shape)))
        return self.add("broadcast_in_dim", [i], shape, self.dtype(i), shape=shape, dims=dims)

    def iota(self, shape, axis: int, dtype: str = "int64") -> int:
        return self.add("iota", [], shape, dtype, axis=axis)

    def slice_dim(self, i: int, dim: int, start: int, stop: int, step: int = 1) -> int:
        shape = self.shape(i)
        if start == 0 and stop == shape[dim] and step == 1:
            return i
        starts = [0] * len(shape)
        limits = list(shape)
        steps = [1] * len(shape)
        starts[dim], limits[dim], steps[dim] = start, stop, step
        out = list(shape)
        out[dim] = len(range(start, stop, step))
        return self.add("slice", [i], out, self.dtype(i), start=tuple(starts), limit=tuple(limits),
                        step=tuple(steps))

    # --- fx helpers --------------------------------------------------------------------------
    @staticmethod
    def val(n: fx.Node):
        v = n.meta.get("val")
        if v is None:
            raise NotImplementedError(f"torch frontend: fx node {n.name} has no meta['val']")
        return v

    def out(self) -> tuple[tuple[int, ...], str]:
        v = self.val(self._node)
        return tuple(int(s) for s in v.shape), ir_dtype(v.dtype)

    def arg(self, a, dtype: str | None = None) -> int:
        """An operand as an IR id: an fx node (cast to ``dtype``) or a Python scalar constant."""
        if isinstance(a, _Id):
            return self.cast(int(a), dtype) if dtype else int(a)
        if isinstance(a, fx.Node):
            i = self.env[a]
            if not isinstance(i, int):
                raise NotImplementedError(f"torch frontend: tuple value {a.name} used as a tensor")
            return self.cast(i, dtype) if dtype else i
        if isinstance(a, (bool, int, float)):
            return self.const(a, (), dtype or ("bool" if isinstance(a, bool) else
                                               "int64" if isinstance(a, int) else "float32"))
        raise NotImplementedError(f"torch frontend: operand {a!r} of {self._node.target}")

    def _meta_of(self, a):
        if isinstance(a, _Id):
            return torch.empty((1,), dtype=getattr(torch, self.dtype(int(a))), device="meta")
        if isinstance(a, fx.Node):
            v = a.meta["val"]
            return torch.empty(() if v.dim() == 0 else (1,), dtype=v.dtype, device="meta")
        return a

    def promote(self, a, b) -> str:
        return ir_dtype(torch.result_type(self._meta_of(a), self._meta_of(b)))

    # --- driver ------------------------------------------------------------------------------
    def run(self, roles: list[tuple[str, str]], out_roles: list[str],
            keep_outputs: list[int] | None = None) -> tuple[Graph, list[int]]:
        """Lower the graph; ``keep_outputs`` selects (by flat index) the outputs that ``out_roles``
        names (all of them by default)."""
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(roles):
            raise RuntimeError(f"traced graph has {len(placeholders)} inputs, expected {len(roles)}")
        input_ids = []
        for n, (role, name) in zip(placeholders, roles):
            v = self.val(n)
            i = self.add("input", [], tuple(v.shape), ir_dtype(v.dtype), role=role, name=name)
            self.env[n] = i
            input_ids.append(i)
        outputs: list[int] = []
        for n in self.gm.graph.nodes:
            self._node = n
            if n.op == "placeholder":
                continue
            if n.op == "get_attr":
                self.env[n] = self._tensor_constant(n)
            elif n.op == "call_function":
                first = len(self.g.nodes)
                self.env[n] = self._call(n)
                self._tag(n, first)
            elif n.op == "output":
                flat = pytree.tree_leaves(n.args[0])
                if keep_outputs is not None:
                    flat = [flat[i] for i in keep_outputs]
                outputs = [self.arg(a) for a in flat]
            else:
                raise NotImplementedError(f"torch frontend: fx node kind {n.op} ({n.name})")
        if len(outputs) != len(out_roles):
            raise RuntimeError(f"traced step has {len(outputs)} outputs, expected {len(out_roles)}")
        self.g.outputs = outputs
        self.g.output_roles = list(out_roles)
        return self.g.compact(input_ids)

    def _tag(self, n: fx.Node, first: int) -> None:
        """Tag the IR nodes lowered from FX node ``n`` (ids ``first``..) with where they came from:
        ``aten`` (the ATen op eager PyTorch dispatches, before decomposition: ``native_layer_norm``,
        not its parts), ``call`` (one number per dispatched op instance: the FX nodes of one
        decomposed call share it), ``phase`` (forward, backward, optimizer) and ``module`` (the
        nn.Module path inside the model, from ``nn_module_stack``; a backward op has its forward
        op's; ``""`` outside the model). Untagged FX nodes (no preserved meta) leave the IR nodes
        untagged."""
        if first == len(self.g.nodes):
            return
        orig = n.meta.get("original_aten")
        custom = n.meta.get("custom") or {}
        if orig is None and not custom:
            return
        phase = "backward" if n.meta.get("autograd_backward") else custom.get("phase", "")
        stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack") or {}
        module = list(stack.values())[-1][0] if stack else ""
        module = "" if module == "model" else module.removeprefix("model.")
        target = orig if orig is not None else n.target
        aten = getattr(target, "_schema", None)
        aten = aten.name.split("::")[-1] if aten is not None else str(target)
        key = (aten, n.meta.get("seq_nr")) if orig is not None and orig is not n.target else n.name
        if key != getattr(self, "_call_key", None):
            self._call_key = key
            self._calls = getattr(self, "_calls", 0) + 1
        tags = {"aten": aten, "call": self._calls, "phase": phase, "module": module}
        for i in range(first, len(self.g.nodes)):
            attrs = self.g.nodes[i].attrs
            for k, v in tags.items():
                attrs.setdefault(k, v)

    def _tensor_constant(self, n: fx.Node) -> int:
        t = getattr(self.gm, n.target)
        if not isinstance(t, torch.Tensor):
            raise NotImplementedError(f"torch frontend: non-tensor attribute {n.target}")
        from torch._subclasses.fake_tensor import is_fake

        dtype = ir_dtype(t.dtype)
        if is_fake(t) and getattr(t, "constant", None) is not None:
            t = t.constant  # a fake tensor made from a real constant keeps it
        if is_fake(t) or t.device.type == "meta":
            raise NotImplementedError(f"torch frontend: tensor constant {n.target} has no value in fake mode")
        flat = t.detach().reshape(-1)
        if flat.numel() == 0 or bool((flat == flat[0]).all()):
            return self.const(flat[0].item() if flat.numel() else 0, tuple(t.shape), dtype)
        value = t.detach().cpu().to(torch.float64 if dtype in FLOAT_DTYPES else t.dtype).numpy()
        return self.add("input", [], tuple(t.shape), dtype, role="constant", name=str(n.target), value=value)

    def _call(self, n: fx.Node):
        target = n.target
        if target is operator.getitem:
            seq = self.env[n.args[0]]
            item = seq[n.args[1]]
            if item is None:
                raise NotImplementedError(f"torch frontend: output {n.args[1]} of {n.args[0].target} is not supported")
            return item
        if not isinstance(target, torch._ops.OpOverload):
            raise NotImplementedError(f"torch frontend: unsupported call {target} ({n.name})")
        packet = target._schema.name.split("::")[-1]
        inplace = packet.endswith("_") and not packet.startswith("_") and target._schema.is_mutable
        handler = getattr(self, "op_" + (packet[:-1] if inplace else packet), None)
        if target.namespace == "sftctl":
            handler = getattr(self, "op_sftctl_" + packet, None)
        elif target.namespace != "aten":
            handler = None
        if handler is None:
            raise NotImplementedError(
                f"torch frontend: ATen op {target} has no IR lowering{self.where(n)}; try an equivalent "
                "written with supported ops, a different module or attn_implementation, or add a "
                "handler op_" + packet + " to sftctl/compiler/frontends/torch.py")
        out = handler(n, *n.args, **n.kwargs)
        if inplace and isinstance(n.args[0], fx.Node):
            # in-place op: later readers of the mutated tensor see the new value (views of it
            # taken before the mutation are not updated; make_fx graphs rarely have them)
            self.env[n.args[0]] = out
        return out

    def unsupported(self, n: fx.Node, why: str = ""):
        raise NotImplementedError(f"torch frontend: ATen op {n.target} {why}".rstrip() + self.where(n))

    @staticmethod
    def where(n: fx.Node) -> str:
        """`` (in module <path> (<type>), at <file:line>)`` for an fx node, from make_fx's
        ``nn_module_stack`` and ``stack_trace``; empty when neither was recorded."""
        parts = []
        stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack") or {}
        if stack:
            path, typ = list(stack.values())[-1]
            typ = getattr(typ, "__name__", str(typ).rsplit(".", 1)[-1].rstrip("'>"))
            path = "" if path == "model" else path.removeprefix("model.")  # as model.named_modules() names it
            parts.append(f"in module {path} ({typ})" if path else f"in the model's own forward ({typ})")
        frame = _stack_frame(n.meta.get("stack_trace"))
        if frame:
            parts.append(f"at {frame}")
        return f" ({', '.join(parts)})" if parts else ""

    # --- elementwise -------------------------------------------------------------------------
    def _unary(self, irop: str, n, x):
        shape, dtype = self.out()
        return self.add(irop, [self.arg(x, dtype)], shape, dtype)

    def op_logical_not(self, n, x):
        shape, _ = self.out()
        return self.add("logical_not", [self.arg(x)], shape, "bool")

    def op_isnan(self, n, x):
        shape, _ = self.out()
        i = self.arg(x)
        return self.add("ne", [i, i], shape, "bool")

    def _abs_vs_inf(self, irop: str, x):
        shape, _ = self.out()
        i = self.arg(x)
        a = self.add("abs", [i], self.shape(i), self.dtype(i))
        return self.add(irop, [a, self.const(float("inf"), (), self.dtype(i))], shape, "bool")

    def op_isinf(self, n, x):
        return self._abs_vs_inf("eq", x)

    def op_isfinite(self, n, x):  # |x| < inf: false for inf and nan
        return self._abs_vs_inf("lt", x)

    def op_bitwise_not(self, n, x):
        if self.val(x).dtype != torch.bool:
            self.unsupported(n, "on integers")
        return self.op_logical_not(n, x)

    def _arith(self, irop: str, a, b):
        shape, dtype = self.out()
        return self.add(irop, [self.arg(a, dtype), self.arg(b, dtype)], shape, dtype)

    def op_add(self, n, a, b, alpha=1):
        if alpha != 1:
            b = self._scaled(b, alpha)
        return self._arith("add", a, b)

    def op_sub(self, n, a, b, alpha=1):
        if alpha != 1:
            b = self._scaled(b, alpha)
        return self._arith("sub", a, b)

    def _scaled(self, b, alpha):
        _, dtype = self.out()
        bi = self.arg(b, dtype)
        return _Id(self.binary("mul", bi, self.const(alpha, (), dtype), dtype))

    def op_mul(self, n, a, b):
        return self._arith("mul", a, b)

    def op_div(self, n, a, b, rounding_mode=None):
        if rounding_mode is not None:
            self.unsupported(n, f"with rounding_mode={rounding_mode!r}")
        return self._arith("div", a, b)

    def op_remainder(self, n, a, b):
        """Python-style modulo on integers: ``a - trunc(a / b) * b``, plus ``b`` where signs differ."""
        shape, dtype = self.out()
        if dtype in FLOAT_DTYPES:
            self.unsupported(n, "on floating point (the IR has no floor)")
        x, y = self.arg(a, dtype), self.arg(b, dtype)
        r = self.binary("sub", x, self.binary("mul", self.binary("div", x, y), y))
        zero = self.const(0, (), dtype)
        differ = self.binary("ne", self.binary("lt", r, zero, "bool"), self.binary("lt", y, zero, "bool"), "bool")
        fix = self.binary("logical_and", self.binary("ne", r, zero, "bool"), differ, "bool")
        return self.add("where", [fix, self.binary("add", r, y), r], shape, dtype)

    def op_pow(self, n, a, b):
        return self._arith("pow", a, b)

    def op_maximum(self, n, a, b):
        return self._arith("maximum", a, b)

    def op_minimum(self, n, a, b):
        return self._arith("minimum", a, b)

    def op_clamp(self, n, x, min=None, max=None):  # noqa: A002 - ATen's names
        shape, dtype = self.out()
        y = self.arg(x, dtype)
        if min is not None:
            y = self.add("maximum", [y, self.arg(min, dtype)], shape, dtype)
        if max is not None:
            y = self.add("minimum", [y, self.arg(max, dtype)], shape, dtype)
        return y

    def op_clamp_min(self, n, x, m):
        return self.op_clamp(n, x, min=m)

    def op_clamp_max(self, n, x, m):
        return self.op_clamp(n, x, max=m)

    def _compare(self, irop: str, a, b):
        shape, _ = self.out()
        dt = self.promote(a, b)
        return self.add(irop, [self.arg(a, dt), self.arg(b, dt)], shape, "bool")

    def _logical(self, irop: str, n, a, b):
        shape, _ = self.out()
        return self.add(irop, [self.arg(a), self.arg(b)], shape, "bool")

    def op_logical_and(self, n, a, b):
        return self._logical("logical_and", n, a, b)

    def op_logical_or(self, n, a, b):
        return self._logical("logical_or", n, a, b)

    def op_logical_xor(self, n, a, b):
        shape, _ = self.out()
        return self.add("ne", [self.cast(self.arg(a), "bool"), self.cast(self.arg(b), "bool")], shape, "bool")

    def _bitwise(self, irop, n, a, b):
        if self.val(n).dtype != torch.bool:
            self.unsupported(n, "on integers")
        return self._logical(irop, n, a, b)

    def op_bitwise_and(self, n, a, b):
        return self._bitwise("logical_and", n, a, b)

    def op_bitwise_or(self, n, a, b):
        return self._bitwise("logical_or", n, a, b)

    def op_bitwise_xor(self, n, a, b):
        if self.val(n).dtype != torch.bool:
            self.unsupported(n, "on integers")
        return self.op_logical_xor(n, a, b)

    def op_where(self, n, c, a=None, b=None):
        if a is None:
            self.unsupported(n, "(the nonzero form)")
        shape, dtype = self.out()
        return self.add("where", [self.arg(c), self.arg(a, dtype), self.arg(b, dtype)], shape, dtype)

    def op_masked_fill(self, n, x, mask, value):
        shape, dtype = self.out()
        return self.add("where", [self.arg(mask), self.arg(value, dtype), self.arg(x, dtype)], shape, dtype)

    # --- casts and identities ----------------------------------------------------------------
    def op__to_copy(self, n, x, **kw):
        shape, dtype = self.out()
        return self.cast(self.arg(x), dtype)

    def _identity(self, n, x, *args, **kw):
        return self.env[x]

    op_clone = op_alias = op_detach = op_lift_fresh_copy = op_contiguous = _identity

    def op__assert_tensor_metadata(self, n, *args, **kw):
        return None

    def op_copy(self, n, dst, src, non_blocking=False):
        shape, dtype = self.out()
        return self.bcast(self.cast(self.arg(src), dtype), shape)

    # --- sources -----------------------------------------------------------------------------
    def _fill(self, value):
        shape, dtype = self.out()
        return self.const(value, shape, dtype)

    def op_full(self, n, size, value, **kw):
        return self._fill(value)

    def op_full_like(self, n, x, value, **kw):
        return self._fill(value)

    def op_new_full(self, n, x, size, value, **kw):
        return self._fill(value)

    def op_scalar_tensor(self, n, value, **kw):
        return self._fill(value)

    def op_fill(self, n, x, value):
        if isinstance(value, fx.Node):
            shape, dtype = self.out()
            return self.bcast(self.cast(self.arg(value), dtype), shape)
        return self._fill(value)

    def op_zeros(self, n, *a, **kw):
        return self._fill(0)

    op_zeros_like = op_new_zeros = op_empty = op_empty_like = op_new_empty = op_empty_strided = op_zeros
    op_new_empty_strided = op_empty_permuted = op_zeros

    def op_ones(self, n, *a, **kw):
        return self._fill(1)

    op_ones_like = op_new_ones = op_ones

    def op_arange(self, n, *args, **kw):
        nums = [a for a in args if isinstance(a, (int, float))]
        start, step = 0, 1
        if len(nums) == 2:
            start = nums[0]
        elif len(nums) >= 3:
            start, step = nums[0], nums[2]
        shape, dtype = self.out()
        i = self.iota(shape, 0, dtype)
        if step != 1:
            i = self.binary("mul", i, self.const(step, (), dtype))
        if start != 0:
            i = self.binary("add", i, self.const(start, (), dtype))
        return i

    # --- reductions --------------------------------------------------------------------------
    def _reduce(self, irop: str, x, dims, keepdim: bool, in_dtype: str | None = None):
        shape, dtype = self.out()
        xi = self.arg(x, in_dtype or dtype)
        rank = len(self.shape(xi))
        axes = _norm_dims(dims, rank)
        if rank == 0 or not axes:
            return self.reshape(self.cast(xi, dtype), shape)
        y = self.add(irop, [xi], shape, in_dtype or dtype, axes=axes, keepdim=bool(keepdim))
        return self.cast(y, dtype)

    def op_sum(self, n, x, dim=None, keepdim=False, dtype=None):
        return self._reduce("sum", x, dim, keepdim)

    def op_mean(self, n, x, dim=None, keepdim=False, dtype=None):
        shape, odt = self.out()
        s = self._reduce("sum", x, dim, keepdim)
        xs = self.val(x).shape
        count = math.prod(xs[d] for d in _norm_dims(dim, len(xs))) if len(xs) else 1
        return self.binary("div", s, self.const(count, (), odt))

    def op_amax(self, n, x, dim=(), keepdim=False):
        return self._reduce("max", x, dim, keepdim)

    def op_amin(self, n, x, dim=(), keepdim=False):
        return self._reduce("min", x, dim, keepdim)

    def op_max(self, n, x, *rest, **kw):
        if rest or kw:
            if isinstance(rest[0] if rest else None, fx.Node):
                return self.op_maximum(n, x, rest[0])
            self.unsupported(n, "(values with indices)")
        return self._reduce("max", x, None, False)

    def op_min(self, n, x, *rest, **kw):
        if rest or kw:
            if isinstance(rest[0] if rest else None, fx.Node):
                return self.op_minimum(n, x, rest[0])
            self.unsupported(n, "(values with indices)")
        return self._reduce("min", x, None, False)

    def op_any(self, n, x, dim=None, keepdim=False):
        return self._reduce("max", x, dim, keepdim, in_dtype="bool")

    def op_all(self, n, x, dim=None, keepdim=False):
        return self._reduce("min", x, dim, keepdim, in_dtype="bool")

    def _var_mean(self, x, dim, correction, keepdim):
        shape, dtype = self.out_at(0)
        xi = self.arg(x, dtype)
        xs = self.shape(xi)
        axes = _norm_dims(dim, len(xs))
        count = math.prod(xs[d] for d in axes)
        kshape = tuple(1 if d in axes else s for d, s in enumerate(xs))
        s = self.add("sum", [xi], kshape, dtype, axes=axes, keepdim=True)
        mean = self.binary("div", s, self.const(count, (), dtype))
        d = self.binary("sub", xi, mean)
        ss = self.add("sum", [self.binary("mul", d, d)], shape, dtype, axes=axes, keepdim=bool(keepdim))
        corr = 1 if correction is None else correction
        var = self.binary("div", ss, self.const(max(count - corr, 0), (), dtype))
        return var, self.reshape(mean, shape)

    def out_at(self, k: int) -> tuple[tuple[int, ...], str]:
        v = self.val(self._node)
        v = v[k] if isinstance(v, (tuple, list)) else v
        return tuple(int(s) for s in v.shape), ir_dtype(v.dtype)

    def op_var_mean(self, n, x, dim=None, *, correction=None, keepdim=False, **kw):
        if "unbiased" in kw:
            correction = 1 if kw["unbiased"] else 0
        if isinstance(dim, bool):
            correction, dim = (1 if dim else 0), None
        return list(self._var_mean(x, dim, correction, keepdim))

    def op_var(self, n, x, dim=None, *, correction=None, keepdim=False, **kw):
        return self.op_var_mean(n, x, dim, correction=correction, keepdim=keepdim, **kw)[0]

    # --- contractions ------------------------------------------------------------------------
    def _dot(self, a: int, b: int, lb, rb, lc, rc, dtype: str) -> int:
        sa, sb = self.shape(a), self.shape(b)
        shape = ([sa[d] for d in lb] + [sa[d] for d in range(len(sa)) if d not in lb and d not in lc]
                 + [sb[d] for d in range(len(sb)) if d not in rb and d not in rc])
        return self.add("dot_general", [a, b], shape, dtype, lhs_batch=tuple(lb), rhs_batch=tuple(rb),
                        lhs_contract=tuple(lc), rhs_contract=tuple(rc))

    def op_mm(self, n, a, b):
        _, dtype = self.out()
        return self._dot(self.arg(a), self.arg(b), (), (), (1,), (0,), dtype)

    def op_bmm(self, n, a, b):
        _, dtype = self.out()
        return self._dot(self.arg(a), self.arg(b), (0,), (0,), (2,), (1,), dtype)

    def op_mv(self, n, a, b):
        _, dtype = self.out()
        return self._dot(self.arg(a), self.arg(b), (), (), (1,), (0,), dtype)

    def op_dot(self, n, a, b):
        _, dtype = self.out()
        return self._dot(self.arg(a), self.arg(b), (), (), (0,), (0,), dtype)

    def _addmm(self, n, bias, prod: int, beta, alpha):
        shape, dtype = self.out()
        if alpha != 1:
            prod = self.binary("mul", prod, self.const(alpha, (), dtype))
        c = self.arg(bias, dtype)
        if beta == 0:
            return prod
        if beta != 1:
            c = self.binary("mul", c, self.const(beta, (), dtype))
        return self.add("add", [prod, c], shape, dtype)

    def op_addmm(self, n, bias, a, b, beta=1, alpha=1):
        return self._addmm(n, bias, self.op_mm(n, a, b), beta, alpha)

    def op_baddbmm(self, n, bias, a, b, beta=1, alpha=1):
        return self._addmm(n, bias, self.op_bmm(n, a, b), beta, alpha)

    # --- convolution -------------------------------------------------------------------------
    def _conv(self, x: int, w: int, dtype: str, *, stride, padding, lhs_dilation, rhs_dilation,
              fgc: int = 1, bgc: int = 1) -> int:
        """An IR ``conv`` node (shape inferred); ``padding`` as (low, high) pairs."""
        from sftctl.compiler.ir import conv_output_spatial

        xs, ws = self.shape(x), self.shape(w)
        nsp = len(xs) - 2
        attrs = dict(stride=tuple(stride), padding=tuple((int(lo), int(hi)) for lo, hi in padding),
                     lhs_dilation=tuple(lhs_dilation), rhs_dilation=tuple(rhs_dilation),
                     feature_group_count=int(fgc), batch_group_count=int(bgc))
        sp = conv_output_spatial(xs[2:], ws[2:], attrs["stride"], attrs["padding"], attrs["lhs_dilation"],
                                 attrs["rhs_dilation"])
        assert len(sp) == nsp
        return self.add("conv", [x, w], (xs[0] // bgc, ws[0]) + sp, dtype, **attrs)

    @staticmethod
    def _per_dim(v, nsp: int) -> list[int]:
        v = list(v) if isinstance(v, (list, tuple)) else [v]
        return [int(x) for x in (v * nsp if len(v) == 1 else v)]

    def _conv_input_grad(self, gy: int, w: int, dtype: str, in_spatial, stride, padding, dilation, groups: int,
                         output_padding=None) -> int:
        """The transposed convolution: the gradient w.r.t. the input of ``conv(x, w)`` (and the
        forward of ``ConvTranspose``), a ``conv`` of ``gy`` dilated by the stride with the
        flipped kernel whose in/out channels are swapped per group. Returns ``[N, C, *in_spatial]``."""
        ws = self.shape(w)
        o, cg, ks = ws[0], ws[1], ws[2:]
        nsp = len(ks)
        wt = self.reshape(w, (groups, o // groups, cg) + tuple(ks))
        wt = self.transpose(wt, (0, 2, 1) + tuple(range(3, 3 + nsp)))
        wt = self.reshape(wt, (groups * cg, o // groups) + tuple(ks))
        wt = self.add("reverse", [wt], self.shape(wt), self.dtype(wt), axes=tuple(range(2, 2 + nsp)))
        out_sp = self.shape(gy)[2:]
        pads = []
        for d in range(nsp):
            lo = dilation[d] * (ks[d] - 1) - padding[d]
            hi = in_spatial[d] - 1 - stride[d] * (out_sp[d] - 1) + padding[d]
            pads.append((lo, hi))
        return self._conv(gy, wt, dtype, stride=[1] * nsp, padding=pads, lhs_dilation=stride,
                          rhs_dilation=dilation, fgc=groups)

    def _conv_weight_grad(self, x: int, gy: int, dtype: str, kernel, stride, padding, dilation, groups: int) -> int:
        """The gradient w.r.t. the weight of ``conv(x, w)``: a ``conv`` of the input (batch and
        channels swapped) with the output gradient as the kernel, batch-grouped by ``groups``.
        Returns ``[O, C / groups, *kernel]``."""
        xs, out_sp = self.shape(x), self.shape(gy)[2:]
        nsp = len(kernel)
        rest = tuple(range(2, 2 + nsp))
        xt = self.transpose(x, (1, 0) + rest)
        gt = self.transpose(gy, (1, 0) + rest)
        pads = [(padding[d], dilation[d] * (kernel[d] - 1) + stride[d] * (out_sp[d] - 1) + 1 - xs[2 + d] - padding[d])
                for d in range(nsp)]
        g = self._conv(xt, gt, dtype, stride=dilation, padding=pads, lhs_dilation=[1] * nsp, rhs_dilation=stride,
                       bgc=groups)
        return self.transpose(g, (1, 0) + rest)

    def op_convolution(self, n, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
        shape, dtype = self.out()
        xi, wi = self.arg(x, dtype), self.arg(w, dtype)
        nsp = len(self.shape(xi)) - 2
        stride, padding, dilation = (self._per_dim(v, nsp) for v in (stride, padding, dilation))
        if transposed:
            y = self._conv_input_grad(xi, wi, dtype, shape[2:], stride, padding, dilation, groups)
        else:
            y = self._conv(xi, wi, dtype, stride=stride, padding=[(p, p) for p in padding], lhs_dilation=[1] * nsp,
                           rhs_dilation=dilation, fgc=groups)
        if tuple(self.shape(y)) != shape:
            self.unsupported(n, f"(lowered shape {self.shape(y)} != {shape})")
        if bias is not None:
            b = self.reshape(self.arg(bias, dtype), (1, shape[1]) + (1,) * nsp)
            y = self.binary("add", y, b)
        return y

    def op_convolution_backward(self, n, gy, x, w, bias_sizes, stride, padding, dilation, transposed,
                                output_padding, groups, output_mask):
        gyi = self.arg(gy)
        xi, wi = self.arg(x), self.arg(w)
        nsp = len(self.shape(xi)) - 2
        stride, padding, dilation = (self._per_dim(v, nsp) for v in (stride, padding, dilation))
        outs: list[int | None] = [None, None, None]
        # a transposed convolution is the adjoint of the convolution with the same weight: its
        # input gradient is that convolution, its weight gradient has input and output swapped
        if output_mask[0]:
            gx_shape, gx_dt = self.out_at(0)
            gyc, wc = self.cast(gyi, gx_dt), self.cast(wi, gx_dt)
            outs[0] = (self._conv(gyc, wc, gx_dt, stride=stride, padding=[(p, p) for p in padding],
                                  lhs_dilation=[1] * nsp, rhs_dilation=dilation, fgc=groups) if transposed else
                       self._conv_input_grad(gyc, wc, gx_dt, gx_shape[2:], stride, padding, dilation, groups))
        if output_mask[1]:
            gw_dt = self.out_at(1)[1]
            a, b = (gyi, xi) if transposed else (xi, gyi)
            outs[1] = self._conv_weight_grad(self.cast(a, gw_dt), self.cast(b, gw_dt), gw_dt,
                                             self.shape(wi)[2:], stride, padding, dilation, groups)
        if output_mask[2]:
            gb_shape, gb_dt = self.out_at(2)
            axes = (0,) + tuple(range(2, 2 + nsp))
            outs[2] = self.add("sum", [self.cast(gyi, gb_dt)], gb_shape, gb_dt, axes=axes, keepdim=False)
        for k, o in enumerate(outs):
            if o is not None and tuple(self.shape(o)) != self.out_at(k)[0]:
                self.unsupported(n, f"(output {k}: lowered shape {self.shape(o)} != {self.out_at(k)[0]})")
        return outs

    # --- pooling -----------------------------------------------------------------------------
    def _pool_geometry(self, in_sp, out_sp, kernel, stride, padding, dilation):
        """Per spatial dim (low pad, high pad) so that ``out_sp`` windows fit (ceil_mode's extra
        window included; a negative high pad crops)."""
        return [(padding[d], (out_sp[d] - 1) * stride[d] + dilation[d] * (kernel[d] - 1) + 1 - in_sp[d] - padding[d])
                for d in range(len(in_sp))]

    def _taps(self, xp: int, out_sp, kernel, stride, dilation):
        """(tap index tuple, strided window view [.., *out_sp]) for every kernel tap of padded ``xp``."""
        lead = len(self.shape(xp)) - len(kernel)
        for tap in itertools.product(*(range(k) for k in kernel)):
            v = xp
            for d, t in enumerate(tap):
                start = t * dilation[d]
                v = self.slice_dim(v, lead + d, start, start + stride[d] * (out_sp[d] - 1) + 1, stride[d])
            yield tap, v

    def _pad_spatial(self, x: int, pads, value) -> int:
        xs = self.shape(x)
        lead = len(xs) - len(pads)
        if not any(lo or hi for lo, hi in pads):
            return x
        low = (0,) * lead + tuple(lo for lo, _ in pads)
        high = (0,) * lead + tuple(hi for _, hi in pads)
        shape = xs[:lead] + tuple(s + lo + hi for s, (lo, hi) in zip(xs[lead:], pads))
        return self.add("pad", [x], shape, self.dtype(x), low=low, high=high, value=value)

    def _pool_args(self, x: int, kernel_size, stride, padding, dilation, n_out_sp):
        nsp = n_out_sp
        kernel = self._per_dim(kernel_size, nsp)
        stride = self._per_dim(stride, nsp) if stride not in (None, [], ()) else list(kernel)
        return kernel, stride, self._per_dim(padding, nsp), self._per_dim(dilation, nsp)

    def op_max_pool2d_with_indices(self, n, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        """Max over each window of the -inf-padded input (strided slices, one per tap, and
        ``maximum``); indices (int64, flat over the input's spatial dims) follow torch: the
        first tap holding the maximum wins."""
        (shape, dtype), (ishape, idt) = self.out_at(0), self.out_at(1)
        xi = self.arg(x, dtype)
        xs = self.shape(xi)
        nsp = 2
        in_sp, out_sp = xs[-nsp:], shape[-nsp:]
        kernel, stride, padding, dilation = self._pool_args(xi, kernel_size, stride, padding, dilation, nsp)
        pads = self._pool_geometry(in_sp, out_sp, kernel, stride, padding, dilation)
        xp = self._pad_spatial(xi, pads, float("-inf"))
        best = idx = None
        for tap, v in self._taps(xp, out_sp, kernel, stride, dilation):
            # flat input position of this tap for every output position
            pos = None
            for d in range(nsp):
                term = self.iota(tuple(out_sp), d, "int64")
                term = self.binary("add", self.binary("mul", term, self.const(stride[d], (), "int64")),
                                   self.const(tap[d] * dilation[d] - padding[d], (), "int64"))
                term = self.binary("mul", term, self.const(math.prod(in_sp[d + 1:]), (), "int64"))
                pos = term if pos is None else self.binary("add", pos, term)
            pos = self.bcast(pos, shape)
            if best is None:
                best, idx = v, pos
                continue
            better = self.add("gt", [v, best], shape, "bool")
            idx = self.add("where", [better, pos, idx], shape, "int64")
            best = self.add("maximum", [best, v], shape, dtype)
        return [best, self.cast(idx, idt)]

    def op_max_pool2d_with_indices_backward(self, n, gy, x, kernel_size, stride, padding, dilation, ceil_mode,
                                            indices):
        """The output gradient added at each window's argmax: a ``scatter_add`` over the
        flattened spatial dims (as torch's kernel does)."""
        shape, dtype = self.out()
        gyi = self.arg(gy, dtype)
        gs = self.shape(gyi)
        nsp = 2
        lead = gs[:-nsp]
        flat_out, flat_in = math.prod(gs[-nsp:]), math.prod(shape[-nsp:])
        g2 = self.reshape(gyi, lead + (flat_out,))
        i2 = self.reshape(self.arg(indices, "int64"), lead + (flat_out,))
        zero = _Id(self.const(0, lead + (flat_in,), dtype))
        sc = self._scatter_flat(zero, len(lead), i2, g2, lead + (flat_in,), dtype)
        return self.reshape(sc, shape)

    def _scatter_flat(self, zero, dim: int, idx: int, src: int, xs, dtype: str) -> int:
        flat = self._take_along_index(xs, dim, idx)
        total = (math.prod(xs),)
        return self.reshape(self.add("scatter_add", [self.reshape(src, (math.prod(self.shape(src)),)),
                                                     self.reshape(flat, (math.prod(self.shape(flat)),))],
                                     total, dtype, axis=0, size=total[0]), xs)

    def _avg_divisor(self, in_sp, out_sp, kernel, stride, padding, pads, count_include_pad, divisor_override,
                     dtype: str):
        """The divisor of every window: ``divisor_override``, else the taps inside the input
        (plus its zero padding when ``count_include_pad``), as torch's kernels count them."""
        if divisor_override:
            return self.const(divisor_override, (), dtype)
        if all(lo == padding[d] and hi == padding[d] for d, (lo, hi) in enumerate(pads)) and (
                count_include_pad or not any(padding)):
            return self.const(math.prod(kernel), (), dtype)
        if count_include_pad:  # padding counts, ceil_mode's overflow beyond it does not
            ones = self.const(1, tuple(s + 2 * p for s, p in zip(in_sp, padding)), dtype)
            mask = self._pad_spatial(ones, [(0, hi - p) for (lo, hi), p in zip(pads, padding)], 0.0)
        else:
            mask = self._pad_spatial(self.const(1, tuple(in_sp), dtype), pads, 0.0)
        total = None
        for _, v in self._taps(mask, out_sp, kernel, stride, [1] * len(kernel)):
            total = v if total is None else self.binary("add", total, v)
        return total

    def op_avg_pool2d(self, n, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                      divisor_override=None):
        shape, dtype = self.out()
        xi = self.arg(x, dtype)
        nsp = 2
        in_sp, out_sp = self.shape(xi)[-nsp:], shape[-nsp:]
        kernel, stride, padding, dilation = self._pool_args(xi, kernel_size, stride, padding, 1, nsp)
        pads = self._pool_geometry(in_sp, out_sp, kernel, stride, padding, dilation)
        xp = self._pad_spatial(xi, pads, 0.0)
        total = None
        for _, v in self._taps(xp, out_sp, kernel, stride, dilation):
            total = v if total is None else self.binary("add", total, v)
        div = self._avg_divisor(in_sp, out_sp, kernel, stride, padding, pads, count_include_pad, divisor_override,
                                dtype)
        return self.binary("div", total, div)

    def _place_strided(self, g: int, sp_axis: int, tap: int, stride: int, size: int) -> int:
        """``g`` along ``sp_axis`` moved to positions ``tap + stride * i`` of a zero tensor of
        length ``size`` on that axis (the transpose of a strided slice), with reshapes and pads."""
        gs = self.shape(g)
        count = gs[sp_axis]
        if stride > 1:
            g = self.reshape(g, gs[:sp_axis + 1] + (1,) + gs[sp_axis + 1:])
            low = [0] * (len(gs) + 1)
            high = [0] * (len(gs) + 1)
            high[sp_axis + 1] = stride - 1
            shp = gs[:sp_axis + 1] + (stride,) + gs[sp_axis + 1:]
            g = self.add("pad", [g], shp, self.dtype(g), low=tuple(low), high=tuple(high), value=0.0)
            g = self.reshape(g, gs[:sp_axis] + (count * stride,) + gs[sp_axis + 1:])
        cur = self.shape(g)[sp_axis]
        low = [0] * len(gs)
        high = [0] * len(gs)
        low[sp_axis], high[sp_axis] = tap, size - tap - cur
        if tap == 0 and size == cur:
            return g
        shp = gs[:sp_axis] + (size,) + gs[sp_axis + 1:]
        return self.add("pad", [g], shp, self.dtype(g), low=tuple(low), high=tuple(high), value=0.0)

    def op_avg_pool2d_backward(self, n, gy, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                               divisor_override):
        shape, dtype = self.out()
        gyi = self.arg(gy, dtype)
        nsp = 2
        rank = len(shape)
        in_sp, out_sp = shape[-nsp:], self.shape(gyi)[-nsp:]
        kernel, stride, padding, dilation = self._pool_args(gyi, kernel_size, stride, padding, 1, nsp)
        pads = self._pool_geometry(in_sp, out_sp, kernel, stride, padding, dilation)
        div = self._avg_divisor(in_sp, out_sp, kernel, stride, padding, pads, count_include_pad, divisor_override,
                                dtype)
        g = self.binary("div", gyi, div)
        padded = [s + lo + hi for s, (lo, hi) in zip(in_sp, pads)]
        total = None
        for tap in itertools.product(*(range(k) for k in kernel)):
            v = g
            for d in range(nsp):
                v = self._place_strided(v, rank - nsp + d, tap[d], stride[d], padded[d])
            total = v if total is None else self.binary("add", total, v)
        for d, (lo, _) in enumerate(pads):  # drop the padding
            total = self.slice_dim(total, rank - nsp + d, lo, lo + in_sp[d])
        return total

    def op__adaptive_avg_pool2d(self, n, x, output_size):
        shape, _ = self.out()
        xs = self.val(x).shape
        if any(i % o for i, o in zip(xs[-2:], shape[-2:])):
            self.unsupported(n, f"(input {tuple(xs[-2:])} not a multiple of output {shape[-2:]})")
        k = [i // o for i, o in zip(xs[-2:], shape[-2:])]
        return self.op_avg_pool2d(n, x, k, k, 0)

    def op__adaptive_avg_pool2d_backward(self, n, gy, x):
        shape, _ = self.out()
        gs = self.val(gy).shape
        if any(i % o for i, o in zip(shape[-2:], gs[-2:])):
            self.unsupported(n, f"(input {shape[-2:]} not a multiple of output {tuple(gs[-2:])})")
        k = [i // o for i, o in zip(shape[-2:], gs[-2:])]
        return self.op_avg_pool2d_backward(n, gy, x, k, k, 0, False, True, None)

    # --- layout ------------------------------------------------------------------------------
    def op_view(self, n, x, size):
        if not isinstance(size, (list, tuple)):
            self.unsupported(n, "(dtype view)")
        shape, _ = self.out()
        return self.reshape(self.arg(x), shape)

    op__unsafe_view = op_reshape = op_view

    def op_unsqueeze(self, n, x, dim):
        shape, _ = self.out()
        return self.reshape(self.arg(x), shape)

    def op_squeeze(self, n, x, *dims):
        shape, _ = self.out()
        return self.reshape(self.arg(x), shape)

    def op_permute(self, n, x, dims):
        i = self.arg(x)
        rank = len(self.shape(i))
        return self.transpose(i, [d % rank for d in dims])

    def op_t(self, n, x):
        i = self.arg(x)
        return self.transpose(i, (1, 0)) if len(self.shape(i)) == 2 else i

    def op_transpose(self, n, x, d0, d1):
        i = self.arg(x)
        rank = len(self.shape(i))
        perm = list(range(rank))
        d0, d1 = d0 % rank, d1 % rank
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return self.transpose(i, perm)

    def op_expand(self, n, x, size, implicit=False):
        shape, _ = self.out()
        return self.bcast(self.arg(x), shape)

    def op_slice(self, n, x, dim=0, start=None, end=None, step=1):
        i = self.arg(x)
        size = self.shape(i)[dim]
        s, e, st = slice(start, end, step).indices(size)
        return self.slice_dim(i, dim % len(self.shape(i)), s, max(e, s), st)

    def op_select(self, n, x, dim, index):
        i = self.arg(x)
        rank = len(self.shape(i))
        dim %= rank
        index %= self.shape(i)[dim]
        shape, _ = self.out()
        return self.reshape(self.slice_dim(i, dim, index, index + 1), shape)

    def op_split_with_sizes(self, n, x, sizes, dim=0):
        i = self.arg(x)
        dim %= len(self.shape(i))
        outs, start = [], 0
        for s in sizes:
            outs.append(self.slice_dim(i, dim, start, start + s))
            start += s
        return outs

    def op_split(self, n, x, split_size, dim=0):
        i = self.arg(x)
        dim %= len(self.shape(i))
        size = self.shape(i)[dim]
        if isinstance(split_size, (list, tuple)):
            return self.op_split_with_sizes(n, x, split_size, dim)
        sizes = [min(split_size, size - s) for s in range(0, size, split_size)] or [0]
        return self.op_split_with_sizes(n, x, sizes, dim)

    def op_unbind(self, n, x, dim=0):
        i = self.arg(x)
        rank = len(self.shape(i))
        dim %= rank
        out_shape = self.shape(i)[:dim] + self.shape(i)[dim + 1:]
        return [self.reshape(self.slice_dim(i, dim, k, k + 1), out_shape) for k in range(self.shape(i)[dim])]

    def op_cat(self, n, tensors, dim=0):
        shape, dtype = self.out()
        ids = [self.arg(t, dtype) for t in tensors]
        ids = [i for i in ids if self.shape(i) != (0,) or len(shape) == 1]
        if len(ids) == 1:
            return ids[0]
        return self.add("concatenate", ids, shape, dtype, axis=dim % len(shape))

    def op_constant_pad_nd(self, n, x, pad, value=0):
        shape, dtype = self.out()
        i = self.arg(x)
        rank = len(self.shape(i))
        low, high = [0] * rank, [0] * rank
        for k in range(len(pad) // 2):
            low[rank - 1 - k], high[rank - 1 - k] = pad[2 * k], pad[2 * k + 1]
        if not any(low) and not any(high):
            return i
        return self.add("pad", [i], shape, dtype, low=tuple(low), high=tuple(high), value=float(value)
                        if dtype in FLOAT_DTYPES else int(value))

    # --- data movement -----------------------------------------------------------------------
    def op_embedding(self, n, weight, indices, *rest):
        shape, dtype = self.out()
        return self.add("gather", [self.arg(weight), self.arg(indices)], shape, dtype, axis=0)

    def op_index_select(self, n, x, dim, index):
        shape, dtype = self.out()
        i = self.arg(x)
        return self.add("gather", [i, self.arg(index)], shape, dtype, axis=dim % len(self.shape(i)))

    def _nonneg(self, idx: int, size: int) -> int:
        """``idx + size`` where negative (python-style wrap), int64."""
        idx = self.cast(idx, "int64")
        neg = self.binary("lt", idx, self.const(0, (), "int64"), "bool")
        wrapped = self.binary("add", idx, self.const(size, (), "int64"))
        return self.add("where", [neg, wrapped, idx], self.shape(idx), "int64")

    def _linear_index(self, idxs: list[int], sizes: list[int], bshape) -> int:
        """Row-major linear index into dims of ``sizes`` from per-dim index tensors (broadcast to ``bshape``)."""
        strides = row_major_strides(sizes)
        flat = None
        for idx, size, stride in zip(idxs, sizes, strides):
            term = self._nonneg(idx, size)
            if stride != 1:
                term = self.binary("mul", term, self.const(stride, (), "int64"))
            flat = term if flat is None else self.binary("add", flat, term)
        return self.bcast(flat, bshape)

    def _advanced(self, x: int, indices) -> tuple[int, list[int], tuple[int, ...]]:
        """For ``x[indices]`` (adjacent tensor indices): (first indexed dim k, index ids, broadcast shape)."""
        pos = [k for k, t in enumerate(indices) if t is not None]
        if not pos or pos != list(range(pos[0], pos[0] + len(pos))):
            raise NotImplementedError(f"torch frontend: ATen op {self._node.target} with non-adjacent index tensors")
        ids = [self.arg(indices[k]) for k in pos]
        if any(self.dtype(i) == "bool" for i in ids):
            raise NotImplementedError(f"torch frontend: ATen op {self._node.target} with a boolean mask index")
        bshape = tuple(torch.broadcast_shapes(*[self.shape(i) for i in ids]))
        return pos[0], ids, bshape

    def op_index(self, n, x, indices):
        shape, dtype = self.out()
        xi = self.arg(x)
        k, ids, bshape = self._advanced(xi, indices)
        xs = self.shape(xi)
        if len(ids) == 1:
            return self.add("gather", [xi, ids[0]], shape, dtype, axis=k)
        merged = xs[k:k + len(ids)]
        flat = self._linear_index(ids, list(merged), bshape)
        x2 = self.reshape(xi, xs[:k] + (math.prod(merged),) + xs[k + len(ids):])
        return self.add("gather", [x2, flat], shape, dtype, axis=k)

    op__unsafe_index = op_index

    def _written_mask(self, flat: int, axis: int, shape, idx_shape_full) -> int:
        ones = self.const(1, idx_shape_full, "int32")
        cnt = self.add("scatter_add", [ones, flat], shape, "int32", axis=axis, size=shape[axis])
        return self.binary("gt", cnt, self.const(0, (), "int32"), "bool")

    def op_index_put(self, n, x, indices, values, accumulate=False):
        shape, dtype = self.out()
        xi = self.arg(x, dtype)
        xs = self.shape(xi)
        k, ids, bshape = self._advanced(xi, indices)
        m = len(ids)
        merged = xs[k:k + m]
        flat = ids[0] if m == 1 else self._linear_index(ids, list(merged), bshape)
        flat = self.bcast(flat, bshape)
        target = xs[:k] + bshape + xs[k + m:]
        vals = self.bcast(self.arg(values, dtype), target)
        mshape = xs[:k] + (math.prod(merged),) + xs[k + m:]
        sc = self.add("scatter_add", [vals, flat], mshape, dtype, axis=k, size=mshape[k])
        sc = self.reshape(sc, xs)
        if accumulate:
            return sc if self.is_const(xi, 0) else self.binary("add", xi, sc)
        if self.is_const(xi, 0):
            return sc
        mask = self.reshape(self._written_mask(flat, k, mshape, target), xs)
        return self.add("where", [mask, sc, xi], xs, dtype)

    def _take_along_index(self, xs, dim: int, idx: int) -> int:
        ishape = self.shape(idx)
        strides = row_major_strides(xs)
        flat = self._nonneg(idx, xs[dim])
        if strides[dim] != 1:
            flat = self.binary("mul", flat, self.const(strides[dim], (), "int64"))
        for d in range(len(ishape)):
            if d == dim or ishape[d] == 1:
                continue
            term = self.iota(ishape, d, "int64")
            if strides[d] != 1:
                term = self.binary("mul", term, self.const(strides[d], (), "int64"))
            flat = self.binary("add", flat, term)
        return flat

    def op_gather(self, n, x, dim, index, sparse_grad=False):
        shape, dtype = self.out()
        xi = self.arg(x)
        xs = self.shape(xi)
        dim %= max(len(xs), 1)
        flat = self._take_along_index(xs, dim, self.arg(index))
        return self.add("gather", [self.reshape(xi, (math.prod(xs),)), flat], shape, dtype, axis=0)

    def _scatter(self, n, x, dim, index, src, mode: str):
        shape, dtype = self.out()
        xi = self.arg(x, dtype)
        xs = self.shape(xi)
        dim %= max(len(xs), 1)
        idx = self.arg(index)
        ishape = self.shape(idx)
        if len(ishape) == len(xs) and ishape[dim] == 1 and all(
                ishape[d] == xs[d] for d in range(len(xs)) if d != dim):
            # one index per row (nll_loss backward, one-hot targets): a compare against the
            # position along ``dim``, elementwise, so it fuses into its consumer as Inductor's
            # lowering does, instead of a materialized "written" mask of the whole tensor
            pos = self.iota(tuple(xs[d] if d == dim else 1 for d in range(len(xs))), dim, "int64")
            hit = self.binary("eq", pos, self._nonneg(idx, xs[dim]), "bool")
            if isinstance(src, (fx.Node, _Id)):
                s = self.arg(src, dtype)
                for d, size in enumerate(ishape):
                    s = self.slice_dim(s, d, 0, size)
            else:
                s = self.const(src, (), dtype)
            if mode == "add":
                contrib = self.add("where", [hit, s, self.const(0, (), dtype)], xs, dtype)
                return contrib if self.is_const(xi, 0) else self.binary("add", xi, contrib)
            return self.add("where", [hit, s, xi], xs, dtype)
        flat = self._take_along_index(xs, dim, idx)
        total = (math.prod(xs),)
        if isinstance(src, (fx.Node, _Id)):
            s = self.arg(src, dtype)
            for d, size in enumerate(ishape):
                s = self.slice_dim(s, d, 0, size)
        else:
            s = self.const(src, ishape, dtype)
        if mode == "add":
            sc = self.reshape(self.add("scatter_add", [s, flat], total, dtype, axis=0, size=total[0]), xs)
            return sc if self.is_const(xi, 0) else self.binary("add", xi, sc)
        mask = self.reshape(self._written_mask(flat, 0, total, ishape), xs)
        if isinstance(src, (fx.Node, _Id)):
            new = self.reshape(self.add("scatter_add", [s, flat], total, dtype, axis=0, size=total[0]), xs)
        else:
            new = self.const(src, (), dtype)
        return self.add("where", [mask, new, xi], xs, dtype)

    def op_scatter(self, n, x, dim, index, src, reduce=None):
        if reduce is not None:
            self.unsupported(n, f"with reduce={reduce!r}")
        return self._scatter(n, x, dim, index, src, "set")

    def op_scatter_add(self, n, x, dim, index, src):
        return self._scatter(n, x, dim, index, src, "add")

    def op_slice_scatter(self, n, x, src, dim=0, start=None, end=None, step=1):
        shape, dtype = self.out()
        xi = self.arg(x, dtype)
        rank = len(shape)
        dim %= rank
        s, e, st = slice(start, end, step).indices(shape[dim])
        if st != 1:
            self.unsupported(n, "with step != 1")
        si = self.arg(src, dtype)
        low, high = [0] * rank, [0] * rank
        low[dim], high[dim] = s, shape[dim] - max(e, s)
        padded = si if not any(low) and not any(high) else self.add(
            "pad", [si], shape, dtype, low=tuple(low), high=tuple(high),
            value=0.0 if dtype in FLOAT_DTYPES else (False if dtype == "bool" else 0))
        if self.is_const(xi, 0) or (s == 0 and e >= shape[dim]):
            return padded
        ishape = tuple(shape[d] if d == dim else 1 for d in range(rank))
        pos = self.iota(ishape, dim, "int64")
        inside = self.binary("logical_and", self.binary("ge", pos, self.const(s, (), "int64"), "bool"),
                             self.binary("lt", pos, self.const(e, (), "int64"), "bool"), "bool")
        return self.add("where", [inside, padded, xi], shape, dtype)

    def op_select_scatter(self, n, x, src, dim, index):
        shape, _ = self.out()
        dim %= len(shape)
        index %= shape[dim]
        si = self.arg(src)
        s_shape = tuple(shape[:dim]) + (1,) + tuple(shape[dim + 1:])
        return self.op_slice_scatter(n, x, _Id(self.reshape(si, s_shape)), dim, index, index + 1)

    def op_cumsum(self, n, x, dim, *, dtype=None):
        shape, odt = self.out()
        xi = self.arg(x, odt)
        if not shape:
            return xi
        return self.add("cumsum", [xi], shape, odt, axis=dim % len(shape))

    def op_flip(self, n, x, dims):
        shape, _ = self.out()
        i = self.arg(x)
        axes = tuple(sorted({d % len(shape) for d in dims if shape[d % len(shape)] > 1})) if shape else ()
        return self.add("reverse", [i], shape, self.dtype(i), axes=axes) if axes else i

    # --- random ops ---------------------------------------------------------------------------
    def op_native_dropout(self, n, x, p, train):
        """(x * keep / (1 - p), keep) with keep ~ Bernoulli(1 - p): an ``rng_bernoulli`` mask,
        saved for backward as torch saves it (bool, 1 byte per element)."""
        shape, dtype = self.out_at(0)
        xi = self.arg(x, dtype)
        if not train or p == 0:
            return [xi, self.const(True, shape, "bool")]
        if p >= 1:
            return [self.const(0, shape, dtype), self.const(False, shape, "bool")]
        self._rng += 1
        keep = self.add("rng_bernoulli", [], shape, "bool", p=1.0 - float(p), rng=self._rng)
        scaled = self.binary("mul", xi, self.const(1.0 / (1.0 - float(p)), (), dtype))
        return [self.add("where", [keep, scaled, self.const(0, (), dtype)], shape, dtype), keep]

    def op_native_dropout_backward(self, n, grad, mask, scale):
        shape, dtype = self.out()
        g = self.binary("mul", self.arg(grad, dtype), self.const(float(scale), (), dtype))
        return self.add("where", [self.arg(mask, "bool"), g, self.const(0, (), dtype)], shape, dtype)

    def _bernoulli(self, n, p):
        shape, dtype = self.out()
        if isinstance(p, fx.Node):
            self.unsupported(n, "with a tensor of probabilities")
        self._rng += 1
        keep = self.add("rng_bernoulli", [], shape, "bool", p=float(p), rng=self._rng)
        return self.cast(keep, dtype)

    def _uniform(self, shape, dtype: str, low=0.0, high=1.0) -> int:
        """U[low, high) of ``shape`` (float ``dtype``) from a fresh random stream."""
        self._rng += 1
        u = self.add("rng_uniform", [], shape, dtype, rng=self._rng)
        if high - low != 1.0:
            u = self.binary("mul", u, self.const(high - low, (), dtype))
        if low != 0.0:
            u = self.binary("add", u, self.const(low, (), dtype))
        return u

    def _normal(self, shape, dtype: str, mean=0.0, std=1.0) -> int:
        """N(mean, std^2) by Box-Muller: sqrt(-2 log(1 - u1)) * cos(2 pi u2)."""
        u1, u2 = self._uniform(shape, dtype), self._uniform(shape, dtype)
        one = self.const(1.0, (), dtype)
        r = self.add("sqrt", [self.binary("mul", self.add("log", [self.binary("sub", one, u1)], shape, dtype),
                                          self.const(-2.0, (), dtype))], shape, dtype)
        z = self.binary("mul", r, self.add("cos", [self.binary("mul", u2, self.const(2 * math.pi, (), dtype))],
                                           shape, dtype))
        if std != 1.0:
            z = self.binary("mul", z, self.const(std, (), dtype))
        if mean != 0.0:
            z = self.binary("add", z, self.const(mean, (), dtype))
        return z

    def _float_out(self, n):
        shape, dtype = self.out()
        if dtype not in FLOAT_DTYPES:
            self.unsupported(n, f"with dtype {dtype}")
        return shape, dtype

    def op_rand(self, n, *args, **kw):
        return self._uniform(*self._float_out(n))

    op_rand_like = op_rand

    def op_randn(self, n, *args, **kw):
        return self._normal(*self._float_out(n))

    op_randn_like = op_randn

    def op_uniform(self, n, x, low=0.0, high=1.0, *, generator=None):
        return self._uniform(*self._float_out(n), float(low), float(high))

    def op_normal(self, n, x, mean=0.0, std=1.0, *, generator=None):
        if isinstance(x, fx.Node) and not isinstance(mean, fx.Node) and not isinstance(std, fx.Node):
            return self._normal(*self._float_out(n), float(mean), float(std))
        self.unsupported(n, "with tensor mean or std")

    def op_randint(self, n, *args, **kw):
        """``randint(high, size)`` / ``randint(low, high, size)``: low + trunc(u * (high - low))."""
        nums = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        low, high = (0, nums[0]) if len(nums) == 1 else (nums[0], nums[1])
        shape, dtype = self.out()
        u = self._uniform(shape, "float32", 0.0, float(high - low))
        i = self.cast(u, dtype)  # truncation toward zero: u >= 0
        return self.binary("add", i, self.const(low, (), dtype)) if low else i

    op_randint_like = op_randint

    def op_bernoulli(self, n, x, p=None, *, generator=None):
        if p is None:
            self.unsupported(n, "with a tensor of probabilities")
        return self._bernoulli(n, p)

    # --- attention -----------------------------------------------------------------------------
    def op_sftctl_attention(self, n, q, k, v, mask, causal, scale, dropout_p, rng):
        """``sftctl::attention`` -> IR ``attention`` (O) and ``attention_lse`` (LSE)."""
        (oshape, odt), (lshape, ldt) = self.out_at(0), self.out_at(1)
        ops = [self.arg(q, odt), self.arg(k, odt), self.arg(v, odt)]
        if mask is not None:
            ops.append(self.arg(mask))
        attrs = dict(causal=bool(causal), scale=float(scale), dropout_p=float(dropout_p), rng=int(rng))
        return [self.add("attention", ops, oshape, odt, **attrs), self.add("attention_lse", ops, lshape, ldt, **attrs)]

    def op_sftctl_attention_backward(self, n, do, q, k, v, mask, o, lse, causal, scale, dropout_p, rng):
        """``sftctl::attention_backward`` -> three IR ``attention_grad`` nodes (dQ, dK, dV)."""
        _, dt = self.out_at(0)
        ops = [self.arg(q, dt), self.arg(k, dt), self.arg(v, dt), self.arg(o, dt), self.arg(do, dt), self.arg(lse)]
        if mask is not None:
            ops.append(self.arg(mask))
        attrs = dict(causal=bool(causal), scale=float(scale), dropout_p=float(dropout_p), rng=int(rng))
        return [self.add("attention_grad", ops, self.out_at(j)[0], self.out_at(j)[1], wrt=w, **attrs)
                for j, w in enumerate("qkv")]


class _Id(int):
    """An IR id passed where an fx node is expected (an operand already lowered)."""


def _install_elementwise() -> None:
    unary = {"abs": "abs", "neg": "neg", "exp": "exp", "log": "log", "tanh": "tanh", "rsqrt": "rsqrt",
             "sqrt": "sqrt", "relu": "relu", "sigmoid": "sigmoid", "erf": "erf", "reciprocal": "reciprocal",
             "sin": "sin", "cos": "cos", "sign": "sign", "log1p": "log1p", "expm1": "expm1"}
    for name, irop in unary.items():
        setattr(_Lowering, "op_" + name, lambda self, n, x, _op=irop: self._unary(_op, n, x))
    for name in ("eq", "ne", "lt", "le", "gt", "ge"):
        setattr(_Lowering, "op_" + name, lambda self, n, a, b, _op=name: self._compare(_op, a, b))


_install_elementwise()


