"""Compile a whole training step for one accelerator, and predict its time on an offering.

    graph --fuse--> kernels --search each GEMM class, cost the rest--> CompiledStep
    CompiledStep + offering (GPUs per node, nodes, links) --> StepPrediction

A CompiledStep is plain data (JSON-able) so it can be cached on disk (``driver.compile_for``),
keyed (``cache.cache_key``) by the graph's signature, the accelerator's numbers, the cost
model's coefficients and the compiler's fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from typing import Callable

from sftctl.compiler.cache import COMPILER_VERSION
from sftctl.compiler.fusion import Kernel, fuse
from sftctl.compiler.hardware import Accelerator
from sftctl.compiler.ir import Graph
from sftctl.compiler.memory import PeakMemory, peak_memory
from sftctl.compiler.modes import has_tensor_cores, predict_mode
from sftctl.compiler.problem import GemmProblem
from sftctl.compiler.roofline import attention_time_s, mma_dtype, roofline_time_s
from sftctl.compiler.search.gemm import GemmChoice, search_gemm
from sftctl.compiler.target import Target

# Data-parallel gradient all-reduce (sftctl.compiler.collectives: measured alpha-beta per link), as
# PyTorch DDP runs it (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
# Training", VLDB 2020, sections 3.2.3 and 4.2): float32 gradients in buckets of ``bucket_cap_mb``
# = 25 MiB, the first bucket 1 MiB (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), in reverse
# parameter order; a bucket's all-reduce starts on NCCL's stream when its last gradient is ready and
# the collectives run one after another. Buckets hold whole parameters, as torch assigns them
# (``torch.distributed._compute_bucket_assignment_by_size``, which the reducer reruns over the order
# gradients became ready after the first iteration): a bucket closes once it reaches its cap, so a
# parameter larger than the cap (a 30k x 1024 word embedding: 125 MB of float32 gradient) lands
# in one bucket with whatever preceded it. Gradients become ready over backward (about 2/3 of a
# step's compute: backward ~ 2x forward FLOPs) in proportion to the bytes produced, in the reverse
# of the order the forward first reads them, so the parameters read first (the embeddings) are
# ready last and their bucket's all-reduce is exposed whole (:func:`ddp_allreduce_exposed_s`).
BACKWARD_SHARE = 2 / 3
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20
#: Thread blocks (one per SM) an NCCL collective kernel occupies while it overlaps backward: the
#: compute kernels lose those SMs (and their wave quantization) for as long as the collective runs.
#: Published measurement (NVIDIA developer forum, "Compute-Communication Overlap Causes Severe GEMM
#: Performance Degradation because of Tail Effect", 2025: on an H100, ncclAllGather launched 24
#: blocks and a concurrent 132-block GEMM took nearly 2x). We take the SM share, 24 / sm_count,
#: as the compute lost while overlapped by a memory-bound kernel; a compute-bound GEMM loses its
#: wave quantization instead (:func:`overlap_slowdown`: ``ceil(tiles / (SMs - 24))`` waves for
#: ``ceil(tiles / SMs)``, which gives the forum's 2x for a 132-tile GEMM), stated, not fitted.
NCCL_OVERLAP_SMS = 24
# The network when an offering does not say: 10 Gbit/s per node.
DEFAULT_INTER_NODE_BYTES_PER_S = 1.25e9


@dataclasses.dataclass
class KernelPlan:
    """One kernel of the compiled step and where it sits on the roofline.

    ``arithmetic_intensity`` is FLOPs per byte moved; ``bound`` is ``compute`` when that
    intensity is above the accelerator's ridge point (peak FLOP/s over HBM bytes/s), else
    ``memory``; ``roofline_fraction`` is the predicted FLOP/s (or bytes/s) over the roofline's
    attainable value for the kernel.
    """

    index: int
    kind: str
    label: str
    n_ops: int
    time_s: float
    flops: float
    bytes: int
    arithmetic_intensity: float
    bound: str
    roofline_fraction: float
    config: dict | None = None
    candidates: int = 0
    scored: int = 0


@dataclasses.dataclass
class CompiledStep:
    """A step compiled for one accelerator (one device's share of a data-parallel step)."""

    accelerator: str
    compiler_version: str
    graph_signature: str
    kernels: list[KernelPlan]
    compute_time_s: float
    peak_memory: dict
    grad_bytes: int
    candidates: int
    scored: int
    search_s: float
    matmul_precision: str = "highest"
    #: per execution mode (``eager``, ``default``, ``sftensor``): :func:`sftctl.compiler.modes.predict_mode`'s summary
    modes: dict = dataclasses.field(default_factory=dict)
    #: FSDP unit (``blocks.3``; ``""`` the root) -> parameters (elements); see :mod:`sftctl.compiler.sharding`
    param_units: dict = dataclasses.field(default_factory=dict)
    #: elements of each parameter tensor in the order the forward first reads them (DDP's buckets hold whole tensors)
    param_numels: list = dataclasses.field(default_factory=list)

    def mode_time_s(self, mode: str) -> float:
        """Predicted compute seconds of one step in ``mode`` (``sftensor`` is ``compute_time_s``)."""
        if mode == "sftensor" or mode not in self.modes:
            return self.compute_time_s
        return self.modes[mode]["compute_time_s"]

    def mode_peak_bytes(self, mode: str) -> int:
        if mode == "sftensor" or mode not in self.modes:
            return self.peak_memory_bytes
        return self.modes[mode]["peak_bytes"]

    @property
    def peak_memory_bytes(self) -> int:
        return PeakMemory(**self.peak_memory).total_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CompiledStep":
        return cls(**{**d, "kernels": [KernelPlan(**k) for k in d["kernels"]]})


def graph_signature(graph: Graph) -> str:
    """A hash of the graph's ops, shapes, dtypes, attributes and wiring."""
    h = hashlib.sha256()
    for n in graph.nodes:
        attrs = {k: v for k, v in n.attrs.items() if k != "name"}
        h.update(repr((n.op, n.inputs, n.type.shape, n.type.dtype, sorted(attrs.items(), key=str))).encode())
    h.update(repr((graph.outputs, graph.output_roles)).encode())
    return h.hexdigest()[:24]


MATMUL_PRECISIONS = ("highest", "high", "medium")


def _check_matmul_precision(matmul_precision: str) -> None:
    if matmul_precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, got {matmul_precision!r}")


def compile_graph(
    graph: Graph,
    target: Target,
    progress: Callable[[int, int], None] | None = None,
    matmul_precision: str = "highest",
    mma_dtype_map: dict[str, str] | None = None,
) -> CompiledStep:
    """Fuse ``graph`` into kernels, search each GEMM's schedule, cost every kernel on ``target``.

    Args:
        graph: a whole training step (see :mod:`sftctl.compiler.ir`).
        target: the accelerator, its coefficients and peer model (:func:`sftctl.compiler.target.load_target`).
        progress: called with (done, total) GEMM classes as the search advances.
        matmul_precision: how float32 matmuls run, as ``torch.set_float32_matmul_precision``
            says: ``highest`` (torch's default) is IEEE FP32 on the CUDA cores, priced at the
            vector FP32 peak times ``mma_efficiency`` with no tensor-core schedule; ``high`` is
            TF32 on the tensor cores (the schedule search, at the float32 matrix peak); ``medium``
            runs as ``high`` on CUDA (PyTorch has no bfloat16-internal FP32 GEMM there).
        mma_dtype_map: price contractions of one dtype as another (``{"bfloat16": "float16"}``
            answers "what would fp16 give" where bf16 has no tensor cores); the bytes stay.

    Raises:
        ValueError: an unknown ``matmul_precision``.
    """
    _check_matmul_precision(matmul_precision)
    started = time.perf_counter()
    kernels = fuse(graph)
    hw = target.hw
    costs = cost_kernels(graph, kernels, target, matmul_precision=matmul_precision,
                         mma_dtype_map=mma_dtype_map, progress=progress)
    plans, dtype_map = costs.plans, dict(mma_dtype_map or {})
    peak = peak_memory(graph, kernels)
    grad_bytes = sum(n.type.numel for n in graph.inputs_with_role("param")) * 4  # fp32 gradients
    modes = {m: predict_mode(graph, target, m, matmul_precision, dtype_map) for m in ("eager", "default")}
    modes["sftensor"] = predict_mode(graph, target, "sftensor", matmul_precision, dtype_map, kernels=kernels,
                                     kernel_times=[p.time_s for p in plans])
    return CompiledStep(
        accelerator=hw.name,
        compiler_version=COMPILER_VERSION,
        graph_signature=graph_signature(graph),
        kernels=plans,
        compute_time_s=costs.time_s,
        peak_memory=dataclasses.asdict(peak),
        grad_bytes=grad_bytes,
        candidates=costs.candidates,
        scored=costs.scored,
        search_s=time.perf_counter() - started,
        matmul_precision=matmul_precision,
        modes=modes,
        param_units=_param_units(graph),
        param_numels=_params_in_forward_order(graph),
    )


def _params_in_forward_order(graph: Graph) -> list[int]:
    """Elements of each parameter in the order the forward first reads them (the reverse of the
    order backward finishes their gradients, which DDP's rebuilt buckets follow); a parameter no
    node reads comes last."""
    first: dict[int, int] = {}
    for n in graph.nodes:
        for i in n.inputs:
            first.setdefault(i, n.id)
    params = graph.inputs_with_role("param")
    order = sorted(params, key=lambda p: first.get(p.id, len(graph.nodes)))
    return [int(p.type.numel) for p in order]


@dataclasses.dataclass
class KernelCosts:
    """What :func:`cost_kernels` found: one :class:`KernelPlan` per kernel, in kernel order, and
    the GEMM search's candidate counts."""

    plans: list[KernelPlan]
    candidates: int
    scored: int

    @property
    def time_s(self) -> float:
        """The kernels' seconds, summed in kernel order."""
        return sum(p.time_s for p in self.plans)


def cost_kernels(
    graph: Graph,
    kernels: list[Kernel],
    target: Target,
    *,
    matmul_precision: str = "highest",
    mma_dtype_map: dict[str, str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> KernelCosts:
    """The one costing loop: seconds of every kernel of ``graph`` (``kernels = fuse(graph)``) on ``target``.

    Both :func:`compile_graph` and ``backend.analyze_ir`` price through it, so they cannot drift.
    GEMM kernels: each class (:func:`_gemm_class`) searched once (``search/gemm.py``) in the matrix
    units' dtype (``mma_dtype_map`` applied; float64 as float32), IEEE float32 (``highest``) on
    the CUDA cores at the vector peak, a convolution divided by ``conv_efficiency``, never faster
    than the kernel's own bytes at HBM bandwidth; attention kernels as flash attention
    (:func:`attention_time_s`); everything else on the roofline at the vector peak of its
    anchor's dtype (:func:`_roofline_time_s`). Arguments as :func:`compile_graph` takes them.

    Raises:
        ValueError: an unknown ``matmul_precision``.
    """
    _check_matmul_precision(matmul_precision)
    ieee_fp32 = matmul_precision == "highest"
    dtype_map = dict(mma_dtype_map or {})
    hw, coeffs = target.hw, target.coeffs
    gemm_classes: dict[GemmProblem, GemmChoice] = {}
    total_gemm = len({_gemm_class(k.gemm) for k in kernels if k.kind == "gemm"})
    plans: list[KernelPlan] = []
    candidates = scored = 0
    from sftctl.compiler.linalg import library_time_s

    for i, k in enumerate(kernels):
        config, cands, sc = None, 0, 0
        lib = library_time_s(graph, k, target)
        if lib is not None:  # a DFT or a dense solver the frontend spelled in IR ops: cuFFT's / cuSOLVER's time
            t = lib
            plans.append(_kernel_plan(graph, i, k, t, hw, None, 0, 0, ieee_fp32, dtype_map))
            continue
        if k.kind == "gemm":
            dtype = dtype_map.get(k.gemm.dtype, k.gemm.dtype)
            key = _gemm_class(k.gemm)
            if (ieee_fp32 and mma_dtype(dtype) == "float32") or not has_tensor_cores(hw, mma_dtype(dtype)):
                # IEEE FP32 (no TF32), or a 16-bit dtype without tensor cores (bf16 on a T4 or
                # V100): CUDA-core SGEMM at the vector peak, no tensor-core schedule
                t = roofline_time_s(k, target, hw.vector_peak("float32") * coeffs.mma_efficiency)
                plans.append(_kernel_plan(graph, i, k, t, hw, None, 0, 0, ieee_fp32, dtype_map))
                continue
            if key not in gemm_classes:
                problem = dataclasses.replace(k.gemm, dtype=mma_dtype(dtype), out_dtype=_out_dtype(k.gemm.out_dtype))
                choice = search_gemm(problem, hw, coeffs)
                gemm_classes[key] = choice
                candidates += choice.n_candidates
                scored += choice.n_scored
                if progress:
                    progress(len(gemm_classes), total_gemm)
            choice = gemm_classes[key]
            cands, sc = choice.n_candidates, choice.n_scored
            if choice.config is not None:
                t, config = choice.time_s, dict(choice.config)
            else:  # no tiled schedule fits (the host CPU): the plain roofline
                t = roofline_time_s(k, target, hw.matrix_peak(mma_dtype(dtype)) * coeffs.mma_efficiency)
            if graph.nodes[k.anchor].op == "conv":
                t = t / coeffs.conv_efficiency  # implicit GEMM vs a plain GEMM of its size
            # never faster than the kernel's own bytes (an implicit GEMM reads more than its
            # GEMM problem's operands: overlapping windows, strided input gradients)
            t = max(t, roofline_time_s(k, target, hw.matrix_peak(mma_dtype(dtype))))
        elif k.kind == "attention":
            t = attention_time_s(k, target)
        else:
            vector = hw.vector_peak(graph.nodes[k.anchor].type.dtype) * coeffs.vector_efficiency
            t = roofline_time_s(k, target, vector)
        plans.append(_kernel_plan(graph, i, k, t, hw, config, cands, sc, ieee_fp32, dtype_map))
    return KernelCosts(plans=plans, candidates=candidates, scored=scored)


def _param_units(graph: Graph) -> dict[str, int]:
    return param_units([(n.attrs.get("name", ""), n.type.numel) for n in graph.inputs_with_role("param")])


_BLOCK = re.compile(r"^(.*?\.\d+)\.")  # "model.layers.3.mlp.w" -> "model.layers.3"


def param_units(names_numel: list[tuple[str, int]]) -> dict[str, int]:
    """Group parameters into FSDP units as :func:`sftctl.train.prepare` wraps them: each entry of
    a module list (the first dotted component that is a number: ``blocks.3``, ``model.layers.0``)
    is a unit; everything else (embeddings, final norm, head) is the root unit ``""``
    (:mod:`sftctl.compiler.sharding` prices FSDP over these units).

    Args:
        names_numel: (parameter name, number of elements) pairs.

    Returns:
        unit name -> parameters (elements) in it.
    """
    units: dict[str, int] = {}
    for name, numel in names_numel:
        m = _BLOCK.match(name)
        key = m.group(1) if m else ""
        units[key] = units.get(key, 0) + int(numel)
    return units


def _gemm_class(problem: GemmProblem) -> GemmProblem:
    """The GEMM class a kernel's problem is searched under: the problem without its epilogue
    FLOPs, so kernels that differ only in their fused elementwise work share one search (the
    first kernel of a class prices its epilogue for all of them)."""
    return dataclasses.replace(problem, epilogue_flops_per_elem=0.0)


def _out_dtype(dtype: str) -> str:
    """The cost model's name for a GEMM output dtype (float64 and integers are stored as 8/4 bytes)."""
    return {"float64": "float64", "int64": "float64", "int32": "float32", "bool": "int8"}.get(dtype, dtype)


def _kernel_plan(graph: Graph, i: int, k: Kernel, t: float, hw: Accelerator, config, cands: int, sc: int,
                 ieee_fp32: bool = False, dtype_map: dict | None = None) -> KernelPlan:
    moved = k.bytes_read + k.bytes_written
    anchor = graph.nodes[k.anchor]
    if k.kind == "gemm":
        g = k.gemm
        mma = mma_dtype((dtype_map or {}).get(g.dtype, g.dtype))
        peak_flops = hw.vector_peak("float32") if ieee_fp32 and mma == "float32" else hw.matrix_peak(mma)
        label = (f"{'conv' if anchor.op == 'conv' else 'gemm'} {'%dx' % g.batch if g.batch > 1 else ''}"
                 f"{g.m}x{g.n}x{g.k} {g.dtype}") + (
            f" +{len(k.nodes) - 1} fused" if len(k.nodes) > 1 else "")
    elif k.kind == "attention":
        a = k.attention
        peak_flops = hw.matrix_peak(mma_dtype(a["dtype"]))
        heads = f"{a['q_heads']}/{a['kv_heads']}" if a["q_heads"] != a["kv_heads"] else f"{a['q_heads']}"
        label = (f"attention {'bwd' if a['direction'] == 'backward' else 'fwd'} {a['batch']}x{heads}h "
                 f"{a['q_len']}x{a['kv_len']} d{a['head_dim']} {a['dtype']}"
                 + (" causal" if a["causal"] else "") + (" masked" if a["masked"] else "")
                 + (f" dropout {a['dropout_p']:g}" if a["dropout_p"] else ""))
    else:
        peak_flops = hw.vector_peak(anchor.type.dtype)
        ops = [graph.nodes[j].op for j in k.nodes]
        label = f"{k.kind} {'+'.join(dict.fromkeys(ops))}"[:60] + (
            f" x{k.horizontal} tensors (multi-tensor)" if k.horizontal > 1 else f" {list(anchor.type.shape)}")
    intensity = k.flops / moved if moved else float("inf")
    ridge = peak_flops / hw.hbm_bytes_per_s
    attainable = min(peak_flops, intensity * hw.hbm_bytes_per_s)
    achieved = k.flops / t if t > 0 else 0.0
    return KernelPlan(
        index=i, kind=k.kind, label=label, n_ops=len(k.nodes), time_s=float(t), flops=k.flops,
        bytes=moved, arithmetic_intensity=intensity, bound="compute" if intensity >= ridge else "memory",
        roofline_fraction=achieved / attainable if attainable else 0.0,
        config=config, candidates=cands, scored=sc,
    )


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """A step's predicted time and memory on an offering (data parallel over all its devices).

    ``step_time_s`` = compute + ``allreduce_time_s``, the part of the gradient all-reduce that
    does not overlap with backward compute. ``devices_needed`` is 1 when the step fits one device's memory, more when
    it would need sharded parameters and optimizer state, 0 when activations alone do not fit.
    """

    accelerator: str
    world_size: int
    compute_time_s: float
    allreduce_time_s: float
    step_time_s: float
    peak_memory_bytes: int
    memory_capacity_bytes: int
    devices_needed: int
    mode: str = "sftensor"

    @property
    def fits(self) -> bool:
        return self.devices_needed == 1


def ddp_buckets(grad_bytes: float, param_bytes: list[float] | None = None) -> list[float]:
    """DDP's gradient buckets in the order they are reduced (bytes).

    ``param_bytes``: each parameter's gradient bytes in forward order. Walked in reverse
    (the order backward makes them), a parameter joins the open bucket and the bucket closes once
    it holds at least its cap: :data:`DDP_FIRST_BUCKET_BYTES` for the first, then
    :data:`DDP_BUCKET_BYTES` (torch's ``_compute_bucket_assignment_by_size``; a parameter is never
    split). Without ``param_bytes``, ``grad_bytes`` is divided as if into tiny parameters: the
    first cap, then full caps, the remainder last."""
    out: list[float] = []
    cap = float(DDP_FIRST_BUCKET_BYTES)
    if param_bytes:
        open_bytes = 0.0
        for b in reversed(param_bytes):
            open_bytes += float(b)
            if open_bytes >= cap:
                out.append(open_bytes)
                open_bytes, cap = 0.0, float(DDP_BUCKET_BYTES)
        if open_bytes:
            out.append(open_bytes)
        return out
    left = float(grad_bytes)
    while left > 0:
        out.append(min(cap, left))
        left -= out[-1]
        cap = float(DDP_BUCKET_BYTES)
    return out


_GEMM_LABEL = re.compile(r"^(?:gemm|conv) ((?:\d+x){2,3}\d+) ")


def overlap_slowdown(kernels: list[KernelPlan], sm_count: int, nccl_sms: int = NCCL_OVERLAP_SMS) -> float:
    """How much slower the step's kernels run while an NCCL collective holds ``nccl_sms`` of the
    GPU's ``sm_count`` SMs (>= 1; their time-weighted mean).

    A compute-bound GEMM (``bound == "compute"``) runs in waves of one output tile per SM: its
    time scales with ``ceil(tiles / (sm_count - nccl_sms)) / ceil(tiles / sm_count)``, ``tiles``
    from its shape (the label's ``[batch x] m x n x k``) and its schedule's ``BLOCK_M`` x ``BLOCK_N``
    x ``split_k`` (cuBLAS's 128 x 128 when the search chose none). The published case this
    reproduces: on an H100 (132 SMs) a 132-block GEMM took nearly 2x beside ncclAllGather's 24
    blocks (NVIDIA developer forum, "Compute-Communication Overlap Causes Severe GEMM Performance
    Degradation because of Tail Effect", 2025): 2 waves for 1. Every other kernel loses the SMs'
    share, ``1 + nccl_sms / sm_count`` (stated). The kernels of the whole step stand for those of
    backward, which overlap (a transformer's backward GEMMs are its forward's shapes transposed)."""
    from sftctl.compiler.peers import CUBLAS_TILE

    if sm_count <= nccl_sms or not kernels:
        return 1.0 + nccl_sms / max(1, sm_count)
    total = slowed = 0.0
    for k in kernels:
        f = 1.0 + nccl_sms / sm_count
        m = _GEMM_LABEL.match(k.label)
        if k.kind == "gemm" and k.bound == "compute" and m:
            dims = [int(x) for x in m.group(1).split("x")]
            batch, (mm, nn) = (dims[0] if len(dims) == 4 else 1), dims[-3:-1]
            cfg = k.config or {}
            bm, bn = int(cfg.get("BLOCK_M", CUBLAS_TILE[0])), int(cfg.get("BLOCK_N", CUBLAS_TILE[1]))
            tiles = batch * -(-mm // bm) * -(-nn // bn) * int(cfg.get("split_k", 1))
            f = -(-tiles // (sm_count - nccl_sms)) / -(-tiles // sm_count)
        total += k.time_s
        slowed += k.time_s * f
    return slowed / total if total > 0 else 1.0 + nccl_sms / sm_count


def ddp_allreduce_exposed_s(grad_bytes: float, backward_s: float, accelerator: str, sm_count: int,
                            gpus_per_node: int, nodes: int = 1, intra_node_bytes_per_s: float | None = None,
                            inter_node_bytes_per_s: float | None = None, provider: str | None = None,
                            param_bytes: list[float] | None = None, slowdown: float | None = None) -> float:
    """Seconds DDP's gradient all-reduce adds to a step of ``backward_s`` seconds of backward.

    Bucket ``i`` (:func:`ddp_buckets`, of whole parameters when ``param_bytes`` gives them) is
    ready when backward has produced its share of the gradients (``backward_s x bytes so far /
    grad_bytes``, the last bucket at the end of backward); its all-reduce
    (:func:`sftctl.compiler.collectives.time_s`, each paying its latency alpha) starts then or when
    the previous one ends. Exposed = the collectives' end past the end of backward, plus the
    contention: while a collective overlaps backward, its :data:`NCCL_OVERLAP_SMS` SMs are lost
    to compute, ``overlapped x (slowdown - 1)``, ``slowdown`` from :func:`overlap_slowdown`
    (None: the SMs' share, ``1 + NCCL_OVERLAP_SMS / sm_count``). 0 on one device.
    """
    from sftctl.compiler.collectives import time_s as collective_s

    if gpus_per_node * nodes <= 1 or grad_bytes <= 0:
        return 0.0
    buckets = ddp_buckets(grad_bytes, param_bytes)
    grad_bytes = sum(buckets)
    end = done = overlapped = 0.0
    for b in buckets:
        done += b
        ready = backward_s * done / grad_bytes
        t = collective_s("all-reduce", b, accelerator, gpus_per_node, nodes, intra_node_bytes_per_s,
                         inter_node_bytes_per_s, provider)
        start = max(ready, end)
        end = start + t
        overlapped += max(0.0, min(end, backward_s) - start)
    if slowdown is None:
        slowdown = 1.0 + min(1.0, NCCL_OVERLAP_SMS / max(1, sm_count))
    contention = overlapped * max(0.0, slowdown - 1.0)
    return max(0.0, end - backward_s) + contention


def ddp_grad_copy_s(param_numels: list[int], target: Target) -> float:
    """GPU seconds per step of DDP's reducer copying each fresh gradient into its bucket.

    ``optimizer.zero_grad()`` sets gradients to None (``set_to_none=True``, torch's default since
    2.0), so every step autograd makes each ``.grad`` anew and the reducer, finding it is not a view
    of its bucket, writes it there scaled by 1 / world (``Reducer::mark_variable_ready_dense``:
    ``at::mul_out(bucket_view, grad, 1 / div_factor)``; with ``gradient_as_bucket_view`` the grad
    then points at the bucket). One copy kernel per parameter on the compute stream, each its fixed
    time plus 8 bytes per element (read float32, write float32) at the copy class's bandwidth
    (``target.peers.classes["copy"]``, as the foreach optimizer is priced); a step on one device
    has none of it."""
    hw, c = target.hw, target.peers.classes["copy"]
    return sum(c.fixed_s + 8.0 * n / (hw.hbm_bytes_per_s * c.hbm_fraction) for n in param_numels)


def predict(compiled: CompiledStep, target: Target, gpus_per_node: int, nodes: int,
            intra_node_bytes_per_s: float | None, inter_node_bytes_per_s: float | None,
            mode: str = "sftensor", provider: str | None = None) -> StepPrediction:
    """Step time of ``compiled`` on ``nodes`` x ``gpus_per_node`` devices (data parallel), in
    execution ``mode`` (``eager``, ``default`` or ``sftensor``; see :mod:`sftctl.compiler.modes`).

    The gradient all-reduce is DDP's: float32 gradients in 25 MiB buckets, each priced by
    :func:`sftctl.compiler.collectives.time_s` on the accelerator's in-host link (PCIe when
    ``intra_node_bytes_per_s`` says so) and ``provider``'s network, overlapped with backward as
    :func:`ddp_allreduce_exposed_s` says (its contention from the compiled kernels' waves:
    :func:`overlap_slowdown`), plus the reducer's per-parameter copies into the buckets
    (:func:`ddp_grad_copy_s`)."""
    hw = target.hw
    world = gpus_per_node * nodes
    compute = compiled.mode_time_s(mode)
    pm = PeakMemory(**(compiled.modes[mode]["peak_memory"] if mode in compiled.modes else compiled.peak_memory))
    ar = 0.0
    if world > 1:
        numels = list(getattr(compiled, "param_numels", None) or [])
        ar = ddp_allreduce_exposed_s(compiled.grad_bytes, compute * BACKWARD_SHARE, hw.name, hw.sm_count,
                                     gpus_per_node, nodes, intra_node_bytes_per_s,
                                     inter_node_bytes_per_s or DEFAULT_INTER_NODE_BYTES_PER_S, provider,
                                     param_bytes=[4 * n for n in numels] or None,
                                     slowdown=overlap_slowdown(compiled.kernels, hw.sm_count))
        ar += ddp_grad_copy_s(numels, target)
    return StepPrediction(
        accelerator=compiled.accelerator,
        world_size=world,
        compute_time_s=compute,
        allreduce_time_s=ar,
        step_time_s=compute + ar,
        peak_memory_bytes=pm.total_bytes,
        memory_capacity_bytes=hw.memory_bytes,
        devices_needed=pm.devices_needed(hw.memory_bytes),
        mode=mode,
    )
