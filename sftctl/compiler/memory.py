"""Peak device memory of a step from liveness over the kernel schedule.

Model: the step's inputs (parameters, optimizer state, the batch) stay resident for the whole
step. The optimizer updates parameters and state in place (as ``torch.optim.AdamW(fused=True)``
and XLA's buffer donation do), so the step's updated outputs alias their inputs and cost nothing
extra. Every other tensor a kernel writes (activations saved for backward, gradients, temporaries)
is allocated when its kernel runs and freed after the last kernel that reads it. An attention
kernel writes only O and its row log-sum-exp (fusion kind ``attention``), so what lives from the
forward to the backward of attention is Q, K, V (and a mask), O and the LSE: never the S x S
scores, which exist only in the kernel's on-chip tiles, as in flash attention. A dropout keeps its
bool keep-mask (1 byte per element) until backward reads it. Peak is the
resident inputs plus the largest sum of live tensors at any kernel, plus a fixed runtime
reserve that we state, not measure: ``RUNTIME_RESERVE_BYTES``.

As PyTorch's caching allocator counts them (``torch.cuda.max_memory_allocated``): every block is
rounded up to :data:`ALLOCATOR_ROUND_BYTES` (c10/cuda/CUDACachingAllocator.cpp ``round_size``:
512 bytes); a tensor is freed, and its block reused, when its last reader has run (autograd
drops a saved activation when the backward node that reads it runs; gradients live from the
backward kernel that makes them to the optimizer). Blocks the allocator caches but no tensor
holds are not counted against the device: when ``cudaMalloc`` fails the allocator frees its
cached segments and retries (``release_cached_blocks``), so what must fit is the allocated peak
plus what is outside the allocator (the CUDA context, cuBLAS's workspaces).

PyTorch's optimizer step (``foreach_optimizer``, the ``eager`` and ``default`` modes of a traced
torch step): ``torch.optim.AdamW`` on CUDA defaults to its multi-tensor (foreach) form
(``torch.optim.optimizer._default_to_fused_or_foreach``: foreach when every tensor is on CUDA, not
fused), whose ``torch._foreach_sqrt(exp_avg_sqs)`` allocates one tensor per parameter, all at once,
while every gradient is still live (``torch/optim/adam.py`` ``_multi_tensor_adam``; the divide, add
and ``addcdiv`` that follow are in place). So the optimizer's peak is what lives when it starts
(the gradients) plus the bytes of every ``exp_avg_sq``. A small MLP with its 13 M parameters
measured 104.2 MiB of transients (gradients + that list) against 80.1 MiB before this term
(``tests/test_memory_measured.py``).

Measured, not only derived: :mod:`sftctl.compiler.memory_check` runs a real step on the CPU under
torch's profiler and counts every allocation (rounded to the allocator's 512-byte blocks) to get the
peak of live bytes, for comparison with :func:`peak_memory`.

Not modelled (the caching allocator's reserved, as opposed to allocated, bytes): blocks above
``kSmallSize`` (1 MiB) come from segments of ``kLargeBuffer`` (20 MiB, requests of 1-10 MiB) or
rounded to ``kRoundLarge`` (2 MiB), and small blocks from 2 MiB segments (``kSmallBuffer``), all in
c10/cuda/CUDACachingAllocator.cpp. Freed blocks stay cached for reuse, and a block is split only
when what remains exceeds 1 MiB, so ``memory_reserved`` exceeds the allocated peak by the
segments' fragmentation: the allocator returns cached free segments to the device and retries
before an out-of-memory error (``release_cached_blocks``), but a segment a live block pins stays.
PyTorch's docs ("CUDA semantics: optimizing memory usage") name
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` as the remedy for that fragmentation.
"""

from __future__ import annotations

import dataclasses
import re

from sftctl.compiler.fusion import Kernel
from sftctl.compiler.ir import Graph

#: The caching allocator's block granularity (bytes): c10/cuda/CUDACachingAllocator.cpp
#: ``kMinBlockSize = 512`` ("all sizes are rounded to at least 512 bytes").
ALLOCATOR_ROUND_BYTES = 512
#: The CUDA context with lazy module loading (the default since CUDA 12.2 on Linux: NVIDIA CUDA
#: Programming Guide, "Lazy Loading", change history): the Hugging Face "Model training anatomy"
#: walk-through rerun with lazy loading (github.com/ClementBM/sandbox) reads 746 MB used on the
#: device after the first CUDA tensor (the docs' own eager-loading run read 1343 MB). Outside
#: ``max_memory_allocated``, inside the device's memory.
CUDA_CONTEXT_BYTES = 746 * 10**6
#: cuBLAS workspaces PyTorch allocates per handle and stream (``CUBLAS_WORKSPACE_CONFIG``'s
#: default on Hopper, ``:4096:8``: 8 x 4 MiB; older GPUs use less).
CUBLAS_WORKSPACE_BYTES = 32 * 2**20
RUNTIME_RESERVE_BYTES = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES


def allocated_bytes(nbytes: int) -> int:
    """Bytes the caching allocator hands out for a tensor of ``nbytes``: rounded up to
    :data:`ALLOCATOR_ROUND_BYTES` (0 stays 0)."""
    return -(-int(nbytes) // ALLOCATOR_ROUND_BYTES) * ALLOCATOR_ROUND_BYTES


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    """Bytes by kind at the step's peak, and the peak itself (``total_bytes``)."""

    params_bytes: int
    opt_state_bytes: int
    batch_bytes: int
    transient_peak_bytes: int  # activations, gradients and temporaries live at the forward/backward peak
    reserve_bytes: int
    peak_kernel: int  # index of the kernel at which the peak occurs
    #: what lives when a foreach optimizer allocates its list (the gradients, its sqrt temporaries):
    #: 0 without one (``peak_memory(foreach_optimizer=False)``)
    optimizer_transient_bytes: int = 0

    @property
    def resident_bytes(self) -> int:
        return self.params_bytes + self.opt_state_bytes + self.batch_bytes

    @property
    def total_bytes(self) -> int:
        return self.resident_bytes + max(self.transient_peak_bytes, self.optimizer_transient_bytes) + self.reserve_bytes

    def devices_needed(self, capacity_bytes: float) -> int:
        """Devices needed if parameters, gradients and optimizer state were sharded across them
        (ZeRO-3 / FSDP) while each device keeps its own activations: 1 if it fits as is."""
        if self.total_bytes <= capacity_bytes:
            return 1
        sharded = self.params_bytes * 2 + self.opt_state_bytes  # parameters, gradients, state
        per_device_fixed = self.total_bytes - sharded
        if per_device_fixed >= capacity_bytes:
            return 0  # activations alone do not fit: no number of devices helps
        n = 2
        while per_device_fixed + sharded / n > capacity_bytes:
            n *= 2
        return n


def peak_memory(graph: Graph, kernels: list[Kernel], foreach_optimizer: bool = False) -> PeakMemory:
    """Liveness over ``kernels`` (in execution order) of the tensors they write.

    ``foreach_optimizer``: the optimizer runs as PyTorch's foreach AdamW (see the module
    docstring): at the first kernel of the ``optimizer`` phase, the bytes of every
    ``exp_avg_sq`` (one ``_foreach_sqrt`` output per parameter) are live on top of what lives then,
    ``optimizer_transient_bytes``, apart from the forward/backward peak (``transient_peak_bytes``)
    because sharding divides the one and not the other; the step's peak is the larger.
    """
    foreach_bytes = 0
    if foreach_optimizer:
        foreach_bytes = sum(allocated_bytes(n.type.nbytes) for n in graph.inputs_with_role("opt_state")
                            if str(n.attrs.get("name", "")).endswith(".exp_avg_sq"))
    optimizer_at = next((i for i, k in enumerate(kernels)
                         if graph.nodes[k.anchor].attrs.get("phase") == "optimizer"), None) if foreach_bytes else None
    by_role: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "input":
            role = n.attrs.get("role", "batch")
            by_role[role] = by_role.get(role, 0) + allocated_bytes(n.type.nbytes)
    outputs = set(graph.outputs)
    last_read: dict[int, int] = {}
    for i, k in enumerate(kernels):
        for r in k.reads:
            last_read[r] = i
    live = 0
    peak, peak_at = 0, 0
    math_scores = _math_attention_bytes(graph)
    frees: dict[int, int] = {}
    optimizer_transient = 0
    for i, k in enumerate(kernels):
        if i == optimizer_at:
            optimizer_transient = live + foreach_bytes
        for w in k.writes:
            if w in outputs:
                continue  # updated in place into its input's buffer (or the scalar loss)
            size = allocated_bytes(graph.nodes[w].type.nbytes) + math_scores.get(w, 0)
            live += size
            frees[last_read.get(w, i)] = frees.get(last_read.get(w, i), 0) + size
        if live > peak:
            peak, peak_at = live, i
        live -= frees.pop(i, 0)
    return PeakMemory(
        params_bytes=by_role.get("param", 0),
        opt_state_bytes=by_role.get("opt_state", 0),
        batch_bytes=sum(v for r, v in by_role.items() if r not in ("param", "opt_state")),
        transient_peak_bytes=peak,
        reserve_bytes=RUNTIME_RESERVE_BYTES,
        peak_kernel=optimizer_at if optimizer_at is not None and optimizer_transient > peak else peak_at,
        optimizer_transient_bytes=optimizer_transient,
    )


def _math_attention_bytes(graph: Graph) -> dict[int, int]:
    """Attention output id -> the S x S bytes SDPA's math path keeps for backward, for each
    attention node whose implementation is ``math`` (``model.attention: math``; an implementation
    the kernel tables resolve elsewhere is a fused kernel, which keeps none).

    torch's ``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/attention.cpp)
    writes ``softmax(q k^T + mask)`` and, with dropout, ``at::dropout`` of it (on CUDA the fused
    ``native_dropout``: its output and a bool keep-mask); autograd saves the softmax output for its
    backward and the dropped probabilities for the ``matmul`` with V. Both are [B, Hq, L, S] in
    the attention's dtype, the mask 1 byte an element; they live as long as O does (until the
    attention's backward reads it), so they ride on O's lifetime here."""
    from sftctl.compiler.fusion import attention_shape

    out: dict[int, int] = {}
    for n in graph.nodes:
        if n.op != "attention" or n.attrs.get("impl") != "math":
            continue
        a = attention_shape(graph, n)
        elems = a["batch"] * a["q_heads"] * a["q_len"] * a["kv_len"]
        item = max(1, n.type.nbytes // max(1, n.type.numel))
        dropout = a["dropout_p"] > 0
        out[n.id] = allocated_bytes(elems * item) * (2 if dropout else 1) + (allocated_bytes(elems) if dropout else 0)
    return out


#: How each kernel :func:`sftctl.compiler.attention.resolve` names is written in a plan's memory line.
_ATTENTION_NAMES = {"flash2": "FlashAttention-2", "flash3": "FlashAttention-3", "cudnn": "cuDNN SDPA",
                    "efficient": "SDPA memory-efficient", "math": "SDPA math", "triton": "Triton flash attention",
                    "xformers": "xformers", "flex": "FlexAttention", "aotriton": "AOTriton flash attention"}


def attention_assumed(graph: Graph, accelerator: str) -> str | None:
    """The attention the peak memory of ``graph`` assumes on ``accelerator``, in words for the
    plan's memory line (None: the step has no attention).

    A fused attention node (SDPA, flash_attn, xformers, FlexAttention) is priced as the kernel
    :func:`sftctl.compiler.attention.resolve` says runs there, which keeps only O and its row
    log-sum-exp between forward and backward (no S x S scores). Without one, a 4-D softmax (the
    ``eager`` attention of Hugging Face models: ``softmax(QK^T)`` written out) keeps its S x S
    probabilities, and its dropout mask, for backward."""
    from sftctl.compiler.attention import resolve
    from sftctl.compiler.fusion import attention_shape

    node = next((n for n in graph.nodes if n.op == "attention"), None)
    if node is not None:
        a = attention_shape(graph, node)
        version = None
        if isinstance(a.get("torch"), str) and re.fullmatch(r"\d+\.\d+", a["torch"]):
            major, minor = a["torch"].split(".")
            version = (int(major), int(minor))
        impl = resolve(a["implementation"], accelerator, dtype=a["dtype"], head_dim=a["head_dim"],
                       bias=a["bias"], torch_version=version)
        what = _ATTENTION_NAMES.get(impl, impl)
        # the batch's attention_mask (sftctl.compiler.attention.with_padding): pads, or unknown
        pads = {"padded": "; the batch pads: SDPA gets the mask and computes every tile",
                "unknown": "; the mask's values are unknown at trace time: priced unpadded"}.get(a.get("padding") or "", "")
        if impl == "math":
            return f"{what} ({a['q_len']} x {a['kv_len']} probabilities kept for backward{pads})"
        return f"{what} (no {a['q_len']} x {a['kv_len']} scores kept{pads})"
    for n in graph.nodes:
        if "_softmax" in str(n.attrs.get("aten", "")) and len(n.type.shape) == 4 and n.type.shape[-1] > 1:
            s = n.type.shape
            return f"eager softmax(QK^T) ({s[-2]} x {s[-1]} scores kept for backward)"
    return None
