"""The peak memory of a real PyTorch training step, measured on the CPU, to check
:func:`sftctl.compiler.memory.peak_memory` against.

:func:`measured_peak` runs one warm-up step (so AdamW's state exists, as in every later step),
then one step under ``torch.profiler.profile(profile_memory=True)``, which records every
allocation and free of the CPU allocator (``[memory]`` events: bytes, address). Each allocation is
rounded up to the CUDA caching allocator's block, :data:`sftctl.compiler.memory.ALLOCATOR_ROUND_BYTES`
(512 bytes: ``kMinBlockSize`` in c10/cuda/CUDACachingAllocator.cpp), so the running sum is what
``torch.cuda.max_memory_allocated`` would count for the same tensors. The peak is the tensors
alive before the step (parameters, AdamW's two moments, the batch) plus the largest running sum.

Where a CPU step allocates differently from a CUDA one, the measurement runs the CUDA form:

* ``F.dropout`` on the CPU keeps a mask of the input's dtype (``at::native::dropout`` takes its
  fused ``native_dropout`` path only on CUDA: ``is_fused_kernel_acceptable``), 4x the bool mask
  CUDA keeps for float32; :class:`NativeDropout` routes it to ``torch.native_dropout``, CUDA's op.
* SDPA with dropout runs the math path on the CPU (its flash kernel has no dropout), whose
  ``at::dropout`` keeps a float mask: :func:`_math_sdpa` writes the same path with
  ``native_dropout``, as a GPU runs the math path (``model.attention: math``).
* AdamW is the multi-tensor (``foreach=True``) form CUDA uses by default.
* The profiler's threads: one intra-op thread (``torch.set_num_threads(1)``) while measuring, so no
  per-thread scratch buffer enters the count.

Not the same on the CPU, so the caller chooses models where it does not matter: a fused SDPA
kernel is measured as the CPU's flash kernel, so with attention dropout 0; the CPU's autocast op lists differ from CUDA's (CPU autocast keeps softmax in
bfloat16), which the tracer shares, as it traces under CPU autocast.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from sftctl.compiler.memory import allocated_bytes


@dataclasses.dataclass(frozen=True)
class MeasuredPeak:
    """Bytes of a measured step: ``resident_bytes`` alive before it (parameters, AdamW state, the
    batch: each storage once), ``transient_peak_bytes`` the largest sum of what the step itself
    allocated and had not yet freed, both in 512-byte allocator blocks."""

    resident_bytes: int
    transient_peak_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.resident_bytes + self.transient_peak_bytes


def native_dropout_mode():
    """A :class:`torch.overrides.TorchFunctionMode` that runs ``F.dropout`` in training as
    ``torch.native_dropout`` (the CUDA kernel's op: a bool keep-mask saved for backward)."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class NativeDropout(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
                a = {**dict(zip(names, args)), **kwargs}
                if float(a.get("dropout_p") or 0.0) > 0.0:
                    return _math_sdpa(**a)
            if func is F.dropout:
                names = ("input", "p", "training", "inplace")
                a = {**dict(zip(names, args)), **kwargs}
                p, training = float(a.get("p", 0.5)), bool(a.get("training", True))
                if training and 0.0 < p < 1.0:
                    return torch.native_dropout(a["input"], p, True)[0]
            return func(*args, **kwargs)

    return NativeDropout()


def _math_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA's math path as torch writes it (``_scaled_dot_product_attention_math``: q and k each
    scaled by sqrt(scale), the mask added in place, softmax, dropout, the product with V) with
    CUDA's ``native_dropout`` (bool mask) for the CPU's float-mask ``at::dropout``. The CPU runs
    this path for SDPA with dropout (its flash kernel has none); so does a GPU asked for ``math``."""
    import math

    import torch

    if enable_gqa and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    root = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
    attn = (query * root) @ (key.transpose(-2, -1) * root)
    if is_causal:
        keep = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        attn = attn.masked_fill_(~keep, float("-inf"))
    if attn_mask is not None:
        attn = (attn.masked_fill_(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                else attn.add_(attn_mask))
    attn = torch.native_dropout(torch.softmax(attn, -1), float(dropout_p), True)[0]
    return attn @ value


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        s = t.untyped_storage()
        out[s.data_ptr()] = allocated_bytes(s.nbytes())
    return out


def measured_peak(model: Any, batch: Any, loss_fn: Callable[[Any, Any], Any],
                  autocast_dtype: Any = None, lr: float = 3e-4, weight_decay: float = 0.01) -> MeasuredPeak:
    """Measure one training step of ``model`` (real tensors on the CPU) on ``batch``:
    ``loss_fn(model, batch)`` under ``torch.autocast("cpu", dtype=autocast_dtype)`` when given,
    ``backward()``, ``AdamW(foreach=True).step()``, ``zero_grad(set_to_none=True)``.

    Args:
        model: a ``torch.nn.Module`` in train mode, parameters on the CPU.
        batch: any pytree of tensors ``loss_fn`` takes.
        loss_fn: returns the scalar loss.
        autocast_dtype: None (float32) or ``torch.bfloat16``.

    Returns:
        :class:`MeasuredPeak` (bytes).
    """
    import contextlib

    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.utils import _pytree as pytree

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=True)

    def step() -> None:
        ctx = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
        with ctx, native_dropout_mode():
            loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step()  # AdamW's state is created by the first step
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        leaves = [t for t in pytree.tree_leaves(batch) if torch.is_tensor(t)]
        resident = sum(_storages([*model.parameters(), *model.buffers(), *state, *leaves]).values())
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        torch.set_num_threads(threads)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        n = e.nbytes()
        live += allocated_bytes(n) if n > 0 else -allocated_bytes(-n)
        peak = max(peak, live)
    return MeasuredPeak(resident_bytes=resident, transient_peak_bytes=peak)
