"""The attention custom op: ``F.scaled_dot_product_attention`` as one op with a flash-attention backward.

While tracing, :class:`_DecomposeSDPA` routes every SDPA call, and the model's own calls of
FlashAttention's ``flash_attn_func``, xformers' ``memory_efficient_attention`` and
``flex_attention`` (:data:`MODEL_CALLS`, tagged with their implementation for pricing), to
``sftctl::attention`` (forward:
O and the row log-sum-exp) whose autograd formula is ``sftctl::attention_backward`` (dQ, dK, dV
from Q, K, V, O, dO, LSE), and ``F.dropout`` to ``aten.native_dropout``; a mask that requires grad
falls back to the materialized math (:func:`_sdpa_math`). The lowerings of the two ops are in
:mod:`.lowerings.attention`.
"""

from __future__ import annotations

import contextlib
import math

import torch


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


def mask_padding(mask: torch.Tensor, rep=None, is_causal: bool = False) -> str:
    """What a boolean SDPA ``attn_mask`` (``[..., L, S]``, True: attend) is on the traced batch:
    ``"none"`` when it removes no key beyond the causal ones (all True, or exactly the causal
    triangle, top-left aligned as SDPA's ``is_causal``: transformers drops such a mask on real
    tensors and calls SDPA with ``is_causal``, so FlashAttention runs and skips the masked
    tiles), ``"padded"`` when it removes more (the batch's ``attention_mask`` pads, or a sliding
    window: SDPA then gets the mask, which rules out flash and cuDNN, and its memory-efficient
    kernel computes every tile: torch ``sdp_utils``' ``check_for_attn_mask``), ``"unknown"`` when
    the trace has no value for it (a batch built on ``meta`` and a model over
    ``REAL_REBUILD_MAX_BYTES``, or an op that cannot run eagerly). ``rep``: the trace's
    :class:`.branches.Representative`, which evaluates a traced mask on the real batch."""
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    value = None
    try:
        if rep is not None and rep.node_of(mask) is not None:
            value = rep.value(mask)
        elif not is_fake(mask) and mask.device.type != "meta":
            value = mask
    except Exception:  # noqa: BLE001 - a value the trace cannot compute: unknown
        value = None
    if value is None or not isinstance(value, torch.Tensor) or value.dim() < 2:
        return "unknown"
    with disable_proxy_modes_tracing(), unset_fake_temporarily(), torch.no_grad():
        v = value.detach().to(torch.bool)
        L, S = v.shape[-2:]
        keep = torch.ones(L, S, dtype=torch.bool).tril()  # SDPA's is_causal: top-left aligned
        if bool(v.all()) or bool((v == keep).all()) or (is_causal and bool((v | ~keep).all())):
            return "none"
    return "padded"


_F_SDPA = torch.nn.functional.scaled_dot_product_attention
_F_DROPOUT = torch.nn.functional.dropout


#: the attention functions models call themselves: (module, attribute, implementation). While
#: tracing, every reference to one of them (the module's attribute and any name a model's module
#: bound with ``from ... import``) is routed to the attention op, tagged with its implementation.
MODEL_CALLS = (
    ("flash_attn", "flash_attn_func", "flash2"),
    ("flash_attn.flash_attn_interface", "flash_attn_func", "flash2"),
    ("flash_attn_interface", "flash_attn_func", "flash3"),
    ("xformers.ops", "memory_efficient_attention", "xformers"),
    ("xformers.ops.fmha", "memory_efficient_attention", "xformers"),
    ("torch.nn.attention.flex_attention", "flex_attention", "flex"),
)


class _DecomposeSDPA(torch.overrides.TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to the attention op (:func:`_sdpa_to_op`) while
    tracing, numbering the calls so each dropout draws from its own random stream, and
    ``F.dropout`` to ``native_dropout`` (:func:`_dropout`). Calls of :data:`MODEL_CALLS` go the
    same way; ``impls`` maps such a call's number (the attention nodes' ``rng``) to
    ``(implementation, alibi)``."""

    def __init__(self, rep=None) -> None:
        super().__init__()
        self.calls = 0
        self.impls: dict[int, tuple[str, bool]] = {}
        #: call number -> :func:`mask_padding`'s verdict, for SDPA calls given a boolean mask
        self.padding: dict[int, str] = {}
        self.rep = rep  # a .branches.Representative: the mask's value on the traced batch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _F_SDPA:
            return self.sdpa(*args, **kwargs)
        if func is _F_DROPOUT:
            return _dropout(*args, **kwargs)
        return func(*args, **kwargs)

    def sdpa(self, *args, impl: str | None = None, alibi: bool = False, **kwargs):
        self.calls += 1
        if impl is not None:
            self.impls[self.calls] = (impl, alibi)
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        causal = bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))
        if impl is None and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            self.padding[self.calls] = mask_padding(mask, self.rep, causal)
        return _sdpa_to_op(*args, **kwargs, rng=self.calls)

    def flash_attn_func(self, impl: str):
        """FlashAttention's ``flash_attn_func`` (q, k, v ``[B, S, H, D]``, GQA by head counts)."""
        def call(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, *args, alibi_slopes=None, **kwargs):
            out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
                            is_causal=bool(causal), scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2],
                            impl=impl, alibi=alibi_slopes is not None)
            return out.transpose(1, 2)
        return call

    def memory_efficient_attention(self, query, key, value, attn_bias=None, p=0.0, scale=None, *args, **kwargs):
        """xformers' ``memory_efficient_attention`` (``[B, M, H, K]``): a ``LowerTriangularMask``
        bias is the causal mask, a tensor bias an additive mask."""
        causal = attn_bias is not None and "LowerTriangular" in type(attn_bias).__name__
        mask = attn_bias if isinstance(attn_bias, torch.Tensor) else None
        if attn_bias is not None and mask is None and not causal:
            raise NotImplementedError(f"torch frontend: memory_efficient_attention with attn_bias "
                                      f"{type(attn_bias).__name__} (None, a tensor or LowerTriangularMask)")
        out = self.sdpa(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask,
                        dropout_p=p, is_causal=causal, scale=scale, enable_gqa=query.shape[2] != key.shape[2],
                        impl="xformers")
        return out.transpose(1, 2)

    def flex_attention(self, query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                       return_lse=False, kernel_options=None, **kwargs):
        """``flex_attention`` (``[B, H, L, D]``) as one attention kernel: ``score_mod`` is pointwise
        work inside the kernel (its cost is in FlexAttention's rate); a ``block_mask`` whose
        mask_mod is named ``*causal*`` is the causal mask, any other is priced dense (all tiles)."""
        if return_lse or kwargs.get("return_aux") is not None:
            raise NotImplementedError("torch frontend: flex_attention with return_lse / return_aux")
        causal = block_mask is not None and "causal" in getattr(getattr(block_mask, "mask_mod", None),
                                                                "__name__", "").lower()
        return self.sdpa(query, key, value, is_causal=causal, scale=scale, enable_gqa=enable_gqa, impl="flex")

    def _model_call_routes(self) -> dict:
        """Original function -> its router, for the :data:`MODEL_CALLS` already imported."""
        import sys

        routes = {}
        for module, name, impl in MODEL_CALLS:
            fn = getattr(sys.modules.get(module), name, None)
            if fn is None or fn in routes:
                continue
            if name == "flash_attn_func":
                routes[fn] = self.flash_attn_func(impl)
            else:
                routes[fn] = getattr(self, name)
        return routes

    @contextlib.contextmanager
    def patched(self):
        """``F.scaled_dot_product_attention`` and ``F.dropout`` replaced at module level, for as
        long as the context lasts: what routes the calls that activation checkpointing recomputes
        in backward (inside ``torch.autograd.grad`` this mode is off, as a mode is while it
        handles a call). Code holding its own reference to those functions is routed by the mode
        in the forward only. The :data:`MODEL_CALLS` already imported are swapped in every
        module's namespace that binds them (``from flash_attn import flash_attn_func``), and
        back."""
        import sys

        F = torch.nn.functional
        F.scaled_dot_product_attention, F.dropout = self.sdpa, _dropout
        routes = self._model_call_routes()
        swapped = []  # (namespace, name, original): every binding of a routed model call
        for mod in list(sys.modules.values()) if routes else ():
            ns = getattr(mod, "__dict__", None)
            if not isinstance(ns, dict):
                continue
            for name, value in list(ns.items()):
                try:
                    route = routes.get(value)
                except Exception:  # noqa: BLE001 - an unhashable (or oddly hashing) module attribute
                    continue
                if route is not None:
                    swapped.append((ns, name, value))
                    ns[name] = route
        try:
            yield
        finally:
            F.scaled_dot_product_attention, F.dropout = _F_SDPA, _F_DROPOUT
            for ns, name, value in swapped:
                ns[name] = value
