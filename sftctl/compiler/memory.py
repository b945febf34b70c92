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
reserve (CUDA context, allocator slack) that we state, not measure: ``RUNTIME_RESERVE_BYTES``.
"""

from __future__ import annotations

import dataclasses

from sftctl.compiler.fusion import Kernel
from sftctl.compiler.ir import Graph

# CUDA context and cuBLAS/allocator workspaces; PyTorch's own docs put the CUDA context alone at
# "hundreds of MB"; we reserve 1 GiB as a stated assumption until measured.
RUNTIME_RESERVE_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    """Bytes by kind at the step's peak, and the peak itself (``total_bytes``)."""

    params_bytes: int
    opt_state_bytes: int
    batch_bytes: int
    transient_peak_bytes: int  # activations, gradients and temporaries live at the peak
    reserve_bytes: int
    peak_kernel: int  # index of the kernel at which the peak occurs

    @property
    def resident_bytes(self) -> int:
        return self.params_bytes + self.opt_state_bytes + self.batch_bytes

    @property
    def total_bytes(self) -> int:
        return self.resident_bytes + self.transient_peak_bytes + self.reserve_bytes

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


def peak_memory(graph: Graph, kernels: list[Kernel]) -> PeakMemory:
    """Liveness over ``kernels`` (in execution order) of the tensors they write."""
    by_role: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "input":
            role = n.attrs.get("role", "batch")
            by_role[role] = by_role.get(role, 0) + n.type.nbytes
    outputs = set(graph.outputs)
    last_read: dict[int, int] = {}
    for i, k in enumerate(kernels):
        for r in k.reads:
            last_read[r] = i
    live = 0
    peak, peak_at = 0, 0
    frees: dict[int, int] = {}
    for i, k in enumerate(kernels):
        for w in k.writes:
            if w in outputs:
                continue  # updated in place into its input's buffer (or the scalar loss)
            size = graph.nodes[w].type.nbytes
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
        peak_kernel=peak_at,
    )
