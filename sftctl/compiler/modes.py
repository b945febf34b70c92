"""Execution modes: the same traced step, predicted as each way PyTorch can run it on a GPU.

* ``eager`` (``train.compile: none``, what the quickstart and most users run): one kernel per ATen
  op as PyTorch dispatches it, read from the frontend's node tags (``attrs["aten"]``/``"call"``:
  the op before decomposition, so ``native_layer_norm`` is one kernel, not its parts). GEMMs are
  cuBLAS (:func:`cublas_time_s`), attention is SDPA's flash kernel, memory-bound ops run at the
  bandwidth torch's own eager kernels reach (:data:`EAGER_KERNELS`), autocast's casts are kernels
  of their own, and AdamW is PyTorch's multi-tensor (``foreach``) implementation
  (:func:`foreach_adamw_passes`). Graphs without tags (JAX, hand-built) run op by op.
* ``default`` (``train.compile: default``, ``torch.compile`` with Inductor): pointwise and
  reduction ops fuse as :func:`sftctl.compiler.fusion.fuse` fuses them (Inductor's rule: same
  iteration space), but every GEMM stays a library call (Inductor's extern ``mm``/``addmm``;
  activations are not fused into it), attention is flash attention, and what runs outside the
  compiled ``nn.Module`` (the loss a training script computes on the logits, and its backward)
  runs eager, as does the optimizer step (``torch.compile(model)`` does not compile it).
* ``sftensor`` (``train.compile: sftensor``): the search compiler's own kernels: searched GEMM
  schedules with fused epilogues (:func:`sftctl.compiler.step.compile_graph`).

Hardware numbers and where they come from (the target's peer model,
:func:`sftctl.compiler.peers.peer_model`, solves them from the shipped calibration's peers file,
``sftctl/compiler/calibrations/data/h200/peers.jsonl``, through
:func:`sftctl.compiler.calibrated.peer_efficiency`; the constants there are the same solve,
used when no calibration is shipped; other accelerators get the H200's fractions of peak and its
fixed times):

* cuBLAS (tensor-core dtypes): :mod:`sftctl.compiler.gemm_table`: XLA's measured GEMM tables
  (H100, B200; the H200 on the H100's die plus its own ``torch.mm`` timings, ``peers.jsonl``:
  4096^3 = 175.4 us, GPT-2's QKV 8192x2304x768 = 47.7 us) interpolated in log space; beyond them
  and on other accelerators the analytical model fitted to them (split-K, wave quantization, a
  ~5 us GPU floor per kernel). IEEE fp32 (CUDA cores): ``waves x (tile
  FLOPs / (cublas_efficiency x per-SM peak) + cublas_wave_s)`` over 128x128 output tiles, or
  the HBM time of its bytes if larger (the peer model's two coefficients, solved from the same
  two H200 timings).
* Host launches: every kernel is GPU time; the host's dispatch (``hw.launch_overhead_s`` a
  launch) runs ahead of the GPU as a queue (:func:`predict_mode`), so a launch costs step time only
  when the GPU has drained what the host queued (``by_kind["host (GPU waits for launches)"]``).
* Eager memory-bound kernels: bandwidth and a per-kernel fixed time solved from torch's eager
  kernels at two sizes on the same H200 (``peers.jsonl``: layer norm, softmax and bias+GELU at
  8192x768 and 65536x1024, bf16). The bandwidth scales with the accelerator's HBM bandwidth (as a
  fraction of the H200's 4.8 TB/s); the fixed time is taken as is.
"""

from __future__ import annotations

import dataclasses
import math
import re

from sftctl.compiler.fusion import Kernel, _gemm_dims, fuse, regroup, source_of
from sftctl.compiler.hardware import Accelerator
from sftctl.compiler.ir import CONTRACTIONS, LAYOUT, SOURCES, Graph
from sftctl.compiler.memory import peak_memory
from sftctl.compiler.peers import CUBLAS_TILE
from sftctl.compiler.roofline import attention_time_s, roofline_time_s
from sftctl.compiler.target import Target

MODES = ("eager", "default", "sftensor")
#: ``train.compile`` (spec.py) -> the mode that runs.
COMPILE_TO_MODE = {"none": "eager", "default": "default", "sftensor": "sftensor"}

_TRANSCENDENTAL = frozenset({"exp", "log", "tanh", "erf", "sigmoid", "sin", "cos", "pow", "log1p", "expm1",
                             "rsqrt", "sqrt", "atan"})
_LAYERNORM_OPS = ("native_layer_norm", "native_layer_norm_backward", "native_group_norm",
                  "native_group_norm_backward", "native_batch_norm", "native_batch_norm_backward",
                  "_fused_rms_norm", "_fused_rms_norm_backward")
_SOFTMAX_OPS = ("_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data")
# eager ops whose CUDA implementation is several kernels over different iteration spaces: the
# input gradient, then the weight/bias gradients as column reductions that read dY and X again
# (aten/src/ATen/native/cuda/layer_norm_kernel.cu: layer_norm_grad_input_kernel and
# GammaBetaBackwardCUDAKernel); split where :func:`fuse` splits them
_MULTI_KERNEL_OPS = ("native_layer_norm_backward", "native_group_norm_backward", "native_batch_norm_backward",
                     "_fused_rms_norm_backward")

# torch/csrc/.../cuda/MultiTensorApply.cuh: tensors per launch by list depth, blocks per launch,
# elements per chunk (one block per chunk)
_MTA_MAX_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
_MTA_MAX_BLOCKS = 320
_MTA_CHUNK = 65536


def foreach_adamw_passes(grad_clip: bool) -> list[tuple[str, int, int, int]]:
    """PyTorch's default CUDA AdamW (``foreach``; torch/optim/adam.py ``_multi_tensor_adam`` with
    decoupled weight decay, not capturable, steps on the CPU) as multi-tensor passes over the
    parameter-sized fp32 lists: ``(op, lists read, lists written, list depth)``. With
    ``grad_clip``, ``clip_grad_norm_``'s ``_foreach_norm`` and ``_foreach_mul_`` come first."""
    passes = []
    if grad_clip:
        passes += [("_foreach_norm(grads)", 1, 0, 1), ("_foreach_mul_(grads, clip)", 1, 1, 1)]
    passes += [
        ("_foreach_mul_(params, 1 - lr*wd)", 1, 1, 1),
        ("_foreach_lerp_(exp_avgs, grads)", 2, 1, 2),
        ("_foreach_mul_(exp_avg_sqs, beta2)", 1, 1, 1),
        ("_foreach_addcmul_(exp_avg_sqs, grads, grads)", 2, 1, 3),
        ("_foreach_sqrt(exp_avg_sqs)", 1, 1, 2),
        ("_foreach_div_(denom, bias_correction2_sqrt)", 1, 1, 1),
        ("_foreach_add_(denom, eps)", 1, 1, 1),
        ("_foreach_addcdiv_(params, exp_avgs, denom)", 3, 1, 3),
    ]
    return passes


def cublas_time_s(batch: int, m: int, n: int, k: int, bytes_moved: float, peak_flops: float,
                  target: Target, dtype: str | None = None) -> float:
    """GPU seconds of one cuBLAS GEMM (the host's launch is not in it: :func:`predict_mode` runs
    the host's dispatch and the GPU as a queue, so a launch costs time only when the GPU waits).

    With ``dtype`` (the tensor-core path: ``bfloat16``, ``float16``, ``float32`` = TF32,
    ``float8``) the GPU time is :func:`sftctl.compiler.gemm_table.gemm_gpu_time_s`: XLA's
    measured tables (H100, B200; the H200 on the H100's die plus its own cuBLAS peers) in log
    space, the fitted analytical model (split-K, wave quantization, a ~5 us floor per kernel)
    beyond them and on accelerators without a table. Without ``dtype`` (IEEE fp32 on CUDA
    cores), or for a CPU: the peer model's wave-quantized 128x128 tiles at ``cublas_efficiency``
    of ``peak_flops`` plus ``cublas_wave_s`` per wave, never faster than its bytes at HBM speed."""
    hw, pm = target.hw, target.peers
    if dtype is not None:
        from sftctl.compiler.gemm_table import gemm_gpu_time_s

        gpu = gemm_gpu_time_s(batch, m, n, k, hw, dtype)
        if gpu is not None:
            return gpu
    bm, bn = CUBLAS_TILE
    tiles = batch * math.ceil(m / bm) * math.ceil(n / bn)
    tile_s = 2.0 * bm * bn * k / (pm.cublas_efficiency * peak_flops / hw.sm_count)
    memory = bytes_moved / (hw.hbm_bytes_per_s * pm.copy_fraction)
    # split-K, as cuBLAS picks it when the output has fewer tiles than the GPU has SMs (a weight
    # gradient: [256, 256] reduced over 169343 rows): K cut in s slices of at least 256, fp32
    # partials written and read back (the gemm_table model's reduce term); the best s is taken
    compute = math.inf
    s = 1
    while True:
        waves = math.ceil(tiles * s / hw.sm_count)
        reduce_s = (s + 1) * 4.0 * batch * m * n / (hw.hbm_bytes_per_s * pm.copy_fraction) if s > 1 else 0.0
        compute = min(compute, waves * (tile_s / s + pm.cublas_wave_s) + reduce_s)
        if tiles * s >= hw.sm_count or k / (2 * s) < 256:
            break
        s *= 2
    return max(compute, memory)


def eager_memory_time_s(k: Kernel, klass: str, target: Target) -> float:
    """GPU seconds of one eager memory-bound kernel of class ``klass`` (``EAGER_KERNELS``): its
    fixed time plus its bytes at the class's bandwidth, or its vector work if longer. The host's
    dispatch is not in it (:func:`predict_mode` queues it)."""
    hw, c = target.hw, target.peers.classes[klass]
    gpu = c.fixed_s + (k.bytes_read + k.bytes_written) / (hw.hbm_bytes_per_s * c.hbm_fraction)
    vector = k.flops / (hw.vector_peak("float32") * 0.7)
    return max(gpu, c.fixed_s + vector)


# ------------------------------------------------------------------------------------------------
# where nodes come from: phase and module


def node_phases_modules(graph: Graph) -> tuple[list[str], list[str]]:
    """Each node's phase (``forward``, ``backward``, ``optimizer``, or ``""``) and module path.

    Tags come from the frontend (``attrs["phase"]``/``["module"]``: the torch frontend tags
    backward ops with the module whose output gradient autograd reached last). Parameters belong
    to the module that owns them. A node without a module tag (the optimizer's, a frontend that
    does not tag) takes the module of a parameter it reads, else of the backward tensors it reads,
    else of the saved activations it reads."""
    phase = [n.attrs.get("phase", "") for n in graph.nodes]
    module = [""] * len(graph.nodes)
    for n in graph.nodes:
        if n.op == "input":
            if n.attrs.get("role") in ("param", "opt_state", "buffer"):
                name = str(n.attrs.get("name", ""))
                name = re.sub(r"\.(exp_avg|exp_avg_sq)$", "", name)
                module[n.id] = name.rsplit(".", 1)[0] if "." in name else ""
            continue
        if n.op in SOURCES:
            continue
        if "module" in n.attrs and phase[n.id] != "optimizer":
            module[n.id] = n.attrs["module"]  # "" is a real answer: outside the model
            continue
        srcs = [s for s in (source_of(graph, i) for i in n.inputs)
                if graph.nodes[s].op not in ("constant", "iota")]
        params = [module[s] for s in srcs if graph.nodes[s].op == "input" and module[s]]
        back = [module[s] for s in srcs if phase[s] in ("backward", "optimizer") and module[s]]
        fwd = [module[s] for s in srcs if phase[s] == "forward" and module[s]]
        for cands in (params, back, fwd):
            if cands:
                module[n.id] = max(cands, key=len)
                break
        if not phase[n.id]:
            ph = [phase[s] for s in srcs if phase[s]]
            phase[n.id] = "optimizer" if "optimizer" in ph else (ph[-1] if ph else "")
    return phase, module


def module_group(path: str) -> str:
    """A module path with layer indices folded (``blocks.3.mlp.fc`` -> ``blocks.*.mlp.fc``), so
    a report aggregates the same layer of every block; ``""`` (outside the model) -> ``(loss)``."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", path) if path else "(outside the model)"


# ------------------------------------------------------------------------------------------------
# kernel lists per mode


def _compute_nodes(graph: Graph) -> list[int]:
    return [n.id for n in graph.nodes if n.op not in SOURCES and n.op not in LAYOUT]


def eager_kernels(graph: Graph) -> list[Kernel]:
    """One kernel per dispatched ATen op (IR nodes sharing ``attrs["call"]``); untagged compute
    nodes one kernel each; an RNN layer's nodes (``attrs["rnn"]``) as :func:`fuse` groups them
    (cuDNN's per-step GEMM and fused gates). Norm backwards are their CUDA kernels: input gradient, then the
    parameter gradients (``_MULTI_KERNEL_OPS``). A call that mixes a contraction with elementwise work (``addmm``'s bias)
    is one cuBLAS kernel with that epilogue; a call whose nodes span several contractions is split
    at each."""
    groups: dict[object, list[int]] = {}
    order: list[object] = []
    part: dict[int, int] = {}
    if any(n.attrs.get("aten") in _MULTI_KERNEL_OPS for n in graph.nodes):
        part = {i: gi for gi, k in enumerate(fuse(graph, gemm_epilogues=False, horizontal=False)) for i in k.nodes}
    # cuDNN's RNN layers (frontends/torch/rnn.py): per step a GEMM and one fused pointwise kernel
    fused = ({i: gi for gi, k in enumerate(fuse(graph, horizontal=False)) for i in k.nodes
              if all("rnn" in graph.nodes[j].attrs for j in k.nodes)}
             if any("rnn" in n.attrs for n in graph.nodes) else {})
    for i in _compute_nodes(graph):
        call = graph.nodes[i].attrs.get("call")
        key: object = ("call", call) if call is not None else ("node", i)
        if call is not None and graph.nodes[i].attrs.get("aten") in _MULTI_KERNEL_OPS:
            key = ("call", call, part.get(i))
        if "rnn" in graph.nodes[i].attrs and i in fused:
            key = ("rnn", fused[i])
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(i)
    out: list[list[int]] = []
    for key in order:
        nodes = groups[key]
        gemms = [i for i in nodes if graph.nodes[i].op in CONTRACTIONS]
        if len(gemms) <= 1:
            out.append(nodes)
            continue
        cur: list[int] = []
        for i in nodes:  # several contractions in one call (matmul of 3-D by 3-D ...): one each
            if graph.nodes[i].op in CONTRACTIONS and any(graph.nodes[j].op in CONTRACTIONS for j in cur):
                out.append(cur)
                cur = []
            cur.append(i)
        out.append(cur)
    return regroup(graph, out)


def default_kernels(graph: Graph, phase: list[str], module: list[str]) -> list[Kernel]:
    """Inductor's kernels: :func:`fuse` without GEMM epilogues or horizontal optimizer batching;
    kernels holding any node that runs outside the compiled module (:func:`outside_nodes`: forward
    or backward) are split back into eager ATen calls."""
    outside = outside_nodes(graph, phase, module)
    fused = fuse(graph, gemm_epilogues=False, horizontal=False, barrier=outside)
    groups: list[list[int]] = []
    eager_calls: dict[object, list[int]] = {}  # outside the compiled module: one kernel per ATen call
    for k in fused:
        if k.anchor in outside:
            eager_calls.setdefault(graph.nodes[k.anchor].attrs.get("call"), []).extend(k.nodes)
        else:
            groups.append(list(k.nodes))
    groups.extend(sorted(nodes) for nodes in eager_calls.values())
    groups.sort(key=min)  # program order: each kernel where its first op was traced
    return regroup(graph, groups)


def outside_nodes(graph: Graph, phase: list[str], module: list[str]) -> set[int]:
    """Ids of the tagged forward/backward nodes that run outside ``torch.compile(model)``: the
    loss a script computes on the model's output, and its backward. A node with a module path, or
    that ran in the model's forward (``attrs["in_model"]``: the root module's own ops, whose path is
    ``""`` too), is inside; so is a backward node without a module that reads a gradient an
    inside backward node made (autograd's accumulation of a residual's or a tied weight's
    gradients, which AOTAutograd puts in the compiled backward)."""
    out: set[int] = set()
    inside_bwd: set[int] = set()
    for n in graph.nodes:
        if "call" not in n.attrs or phase[n.id] not in ("forward", "backward"):
            continue
        if module[n.id] or n.attrs.get("in_model"):
            if phase[n.id] == "backward":
                inside_bwd.add(n.id)
            continue
        if phase[n.id] == "backward" and any(source_of(graph, j) in inside_bwd for j in n.inputs):
            inside_bwd.add(n.id)
            continue
        out.add(n.id)
    return out


def kernel_phase_module(graph: Graph, k: Kernel, phase: list[str], module: list[str]) -> tuple[str, str]:
    """A kernel's phase and module: its anchor's (the first node with a phase)."""
    for i in k.nodes:
        if phase[i]:
            return phase[i], module[i]
    return "", module[k.anchor]


def eager_class(graph: Graph, k: Kernel) -> str:
    """Which measured eager kernel class a non-GEMM eager kernel belongs to."""
    aten = str(graph.nodes[k.anchor].attrs.get("aten", ""))
    if aten in _LAYERNORM_OPS:
        return "layernorm"
    if aten in _SOFTMAX_OPS or k.kind == "reduction":
        return "softmax"
    if any(graph.nodes[i].op in _TRANSCENDENTAL for i in k.nodes):
        return "elementwise"
    return "copy"


def foreach_optimizer_time_s(graph: Graph, target: Target, grad_clip: bool) -> tuple[float, int, float]:
    """(GPU seconds, kernel launches, bytes) of PyTorch's foreach AdamW over the graph's
    parameters (fp32 master weights; see :func:`foreach_adamw_passes`). The host's dispatch of
    the launches is not in the seconds (:func:`predict_mode` queues it)."""
    params = graph.inputs_with_role("param")
    if not params:
        return 0.0, 0, 0.0
    n_tensors = len(params)
    list_bytes = sum(p.type.numel for p in params) * 4
    chunks = sum(math.ceil(p.type.numel / _MTA_CHUNK) for p in params)
    hw, c = target.hw, target.peers.classes["copy"]  # multi_tensor_apply: vectorized loads, plain arithmetic
    total_s, launches, moved = 0.0, 0, 0.0
    for _, reads, writes, depth in foreach_adamw_passes(grad_clip):
        n = max(math.ceil(n_tensors / _MTA_MAX_TENSORS[depth]),
                math.ceil(chunks / _MTA_MAX_BLOCKS))
        b = (reads + writes) * list_bytes
        total_s += n * c.fixed_s + b / (hw.hbm_bytes_per_s * c.hbm_fraction)
        launches += n
        moved += b
    return total_s, launches, moved


#: Host seconds of the device-to-host sync ``GradScaler.step`` makes each step (``found_inf.item()``
#: in ``torch/amp/grad_scaler.py`` ``_maybe_opt_step``): the host waits for the GPU to drain its
#: queue, then reads one scalar back. A ``cudaMemcpy`` device-to-host round trip of a few bytes is
#: ~10 us on PCIe (NVIDIA's CUDA C++ Best Practices Guide, "Data Transfer Between Host and
#: Device": small transfers are latency-bound); stated, not fitted.
GRAD_SCALER_SYNC_S = 10e-6


def uses_grad_scaler(graph: Graph) -> bool:
    """Whether the step trains in float16 mixed precision (a contraction reads float16 while the
    parameters are float32), which PyTorch pairs with ``torch.amp.GradScaler``: bf16 needs none."""
    params = graph.inputs_with_role("param")
    if not params or any(p.type.dtype != "float32" for p in params):
        return False
    return any(n.op in CONTRACTIONS and graph.nodes[n.inputs[0]].type.dtype == "float16" for n in graph.nodes)


def grad_scaler_time_s(graph: Graph, target: Target) -> tuple[float, int, float]:
    """(GPU seconds, kernel launches, bytes) of ``GradScaler``'s per-step work before the
    optimizer: ``_amp_foreach_non_finite_check_and_unscale_`` over the fp32 gradients (one
    multi-tensor pass that reads and writes them: depth 1, as ``foreach_adamw_passes`` counts
    launches) and ``_amp_update_scale_`` (one launch). The sync that follows is
    :data:`GRAD_SCALER_SYNC_S` (:func:`predict_mode`)."""
    params = graph.inputs_with_role("param")
    list_bytes = sum(p.type.numel for p in params) * 4
    chunks = sum(math.ceil(p.type.numel / _MTA_CHUNK) for p in params)
    hw, c = target.hw, target.peers.classes["copy"]
    n = max(math.ceil(len(params) / _MTA_MAX_TENSORS[1]), math.ceil(chunks / _MTA_MAX_BLOCKS))
    b = 2 * list_bytes
    return (n + 1) * c.fixed_s + b / (hw.hbm_bytes_per_s * c.hbm_fraction), n + 1, b


def has_grad_clip(graph: Graph, phase: list[str]) -> bool:
    """Whether the traced optimizer clips gradients (a global norm: reductions in its phase)."""
    return any(phase[n.id] == "optimizer" and n.op == "sum" for n in graph.nodes)


# ------------------------------------------------------------------------------------------------
# predictions


def has_tensor_cores(hw: Accelerator, dtype: str) -> bool:
    """Whether ``hw`` has a matrix-unit path for a 16-bit ``dtype`` (``bfloat16``/``float16``):
    its matrix peak for that dtype exceeds its float32 vector peak. The catalog gives a GPU
    without one (bf16 on the T4, sm_75, and the V100, sm_70: tensor cores for fp16 only) its
    float32 CUDA-core rate as the matrix peak. There torch still runs a bf16 matmul (cuBLAS's
    ``cublasGemmEx`` with bf16 operands and fp32 compute on the CUDA cores; bf16 autocast is allowed,
    ``torch.cuda.is_bf16_supported(including_emulation=True)``), so it is priced as IEEE fp32 SGEMM on
    the CUDA cores, never at a tensor-core efficiency. Other dtypes and non-NVIDIA targets: True."""
    if dtype not in ("bfloat16", "float16") or getattr(hw, "vendor", "") != "nvidia":
        return True
    return hw.matrix_peak(dtype) > hw.vector_peak("float32") * 1.01


def _gemm_dtype(graph: Graph, k: Kernel, ieee_fp32: bool, dtype_map: dict, hw: Accelerator | None = None) -> str | None:
    """The matrix-unit path of a library GEMM: its input dtype (float64 runs as float32), or
    None for the CUDA cores: IEEE fp32 (``matmul_precision: highest``, not TF32), and a 16-bit
    dtype ``hw`` has no tensor cores for (:func:`has_tensor_cores`)."""
    dtype = graph.nodes[graph.nodes[k.anchor].inputs[0]].type.dtype
    dtype = dtype_map.get(dtype, dtype)
    mma = "float32" if dtype == "float64" else dtype
    if hw is not None and not has_tensor_cores(hw, mma):
        return None
    return None if ieee_fp32 and mma == "float32" else mma


def _library_gemm_s(graph: Graph, k: Kernel, target: Target, ieee_fp32: bool, dtype_map: dict) -> float:
    """A library GEMM (cuBLAS; a convolution is cuDNN's implicit GEMM, divided by the target's
    ``conv_efficiency`` as the compiler prices its own convolutions)."""
    batch, m, n, kk = _gemm_dims(graph, graph.nodes[k.anchor])
    mma = _gemm_dtype(graph, k, ieee_fp32, dtype_map, target.hw)
    peak = target.hw.vector_peak("float32") if mma is None else target.hw.matrix_peak(mma)
    t = cublas_time_s(batch, m, n, kk, k.bytes_read + k.bytes_written, peak, target, mma)
    if graph.nodes[k.anchor].op == "conv":
        t /= target.coeffs.conv_efficiency
    return t


def _other_kernel_s(graph: Graph, k: Kernel, target: Target, eager: bool) -> float | None:
    """Attention: SDPA's flash kernels in every mode, priced as the compiler prices its attention
    kernels (:func:`sftctl.compiler.roofline.attention_time_s`); None for other kinds."""
    if k.kind == "attention":
        return float(attention_time_s(k, target))
    from sftctl.compiler.linalg import library_time_s

    return library_time_s(graph, k, target)  # cuFFT, cuSOLVER in every mode (None: an ordinary kernel)


def predict_mode(graph: Graph, target: Target, mode: str, matmul_precision: str = "highest",
                 dtype_map: dict | None = None, kernels: list[Kernel] | None = None,
                 kernel_times: list[float] | None = None) -> dict:
    """One mode's prediction for ``graph`` on ``target`` (one device): a JSON-able summary.

    ``kernels``/``kernel_times`` give ``sftensor``'s already costed kernels (from
    :func:`sftctl.compiler.step.compile_graph`); ``eager`` and ``default`` are built here.

    Returns: ``{"compute_time_s", "kernels" (launches), "flops", "bytes", "by_kind", "by_phase",
    "by_module" (seconds each), "peak_memory" (PeakMemory fields), "peak_bytes",
    "live_at_peak" (the largest tensors live at the peak)}``.
    """
    hw, coeffs = target.hw, target.coeffs
    dtype_map = dict(dtype_map or {})
    ieee = matmul_precision == "highest"
    phase, module = node_phases_modules(graph)
    outside = outside_nodes(graph, phase, module) if mode == "default" else set()
    if kernels is None:
        kernels = eager_kernels(graph) if mode == "eager" else default_kernels(graph, phase, module)
    by_kind: dict[str, float] = {}
    by_phase: dict[str, float] = {}
    by_module: dict[str, float] = {}
    flops = moved = 0.0
    launches = 0
    # PyTorch runs its optimizer step eagerly (foreach) in both modes; an untagged graph (JAX: the
    # whole step jitted) keeps the optimizer it was traced with, fused like the rest
    tagged = any("call" in n.attrs for n in graph.nodes)
    optimizer_eager = mode in ("eager", "default") and tagged

    def add(kind: str, ph: str, mod: str | None, t: float) -> None:
        by_kind[kind] = by_kind.get(kind, 0.0) + t
        by_phase[ph or "other"] = by_phase.get(ph or "other", 0.0) + t
        g = module_group(mod) if mod is not None else "(optimizer)"
        by_module[g] = by_module.get(g, 0.0) + t

    # eager and default: the host dispatches each launch (hw.launch_overhead_s) while the GPU runs
    # what is queued; the GPU waits only when the host has fallen behind (a CUDA stream is a FIFO
    # the CPU fills asynchronously). sftensor's kernel_times already carry their launch.
    queued = kernel_times is None
    host_s = gpu_s = 0.0

    def run(t: float, n_launches: int) -> float:
        """Queue ``n_launches`` taking ``t`` GPU seconds; the seconds the GPU waited for the host."""
        nonlocal host_s, gpu_s
        if not queued:
            gpu_s += t
            return 0.0
        host_s += n_launches * hw.launch_overhead_s
        wait = max(0.0, host_s - gpu_s)
        gpu_s = max(gpu_s, host_s) + t
        return wait

    from sftctl.compiler.linalg import is_solver_part

    for i, k in enumerate(kernels):
        if is_solver_part(graph, k):
            continue  # a piece of a cuSOLVER call, priced whole at its first kernel (sftctl.compiler.linalg)
        ph, mod = kernel_phase_module(graph, k, phase, module)
        if optimizer_eager and ph == "optimizer":
            continue  # PyTorch's foreach AdamW, priced as a whole below
        if ph == "optimizer":
            mod = None
        if kernel_times is not None:
            t = kernel_times[i]
        else:
            t = _other_kernel_s(graph, k, target, eager=mode == "eager")
            if t is None and k.kind == "gemm":
                t = _library_gemm_s(graph, k, target, ieee, dtype_map)
            elif t is None and (mode == "eager" or any(j in outside for j in k.nodes)):
                t = eager_memory_time_s(k, eager_class(graph, k), target)
            elif t is None:
                t = roofline_time_s(k, target, hw.vector_peak(graph.nodes[k.anchor].type.dtype)
                                     * coeffs.vector_efficiency)
        n_launch = max(1, k.horizontal) if mode != "sftensor" else 1
        wait = run(t, n_launch)
        if wait:
            add("host (GPU waits for launches)", ph, mod, wait)
        add(k.kind, ph, mod, t)
        flops += k.flops
        moved += k.bytes_read + k.bytes_written
        launches += n_launch
    if optimizer_eager and uses_grad_scaler(graph):
        # GradScaler: unscale and check the gradients, then the host waits for the GPU to read
        # found_inf back, so the optimizer's launches start from an empty queue
        t, n, b = grad_scaler_time_s(graph, target)
        wait = run(t, n)
        add("grad scaler (fp16)", "optimizer", None, t)
        launches += n
        moved += b
        host_s = max(host_s, gpu_s) + GRAD_SCALER_SYNC_S
        wait += max(0.0, host_s - gpu_s)
        gpu_s = max(gpu_s, host_s)
        if wait:
            add("host (GPU waits for launches)", "optimizer", None, wait)
    if optimizer_eager:
        t, n, b = foreach_optimizer_time_s(graph, target, has_grad_clip(graph, phase))
        if n:
            wait = run(t, n)
            if wait:
                add("host (GPU waits for launches)", "optimizer", None, wait)
            add("optimizer (foreach)", "optimizer", None, t)
            launches += n
            moved += b
            flops += 12.0 * sum(p.type.numel for p in graph.inputs_with_role("param"))
    total = gpu_s
    pm = peak_memory(graph, kernels, foreach_optimizer=optimizer_eager)
    return {
        "compute_time_s": total,
        "kernels": launches,
        "flops": flops,
        "bytes": moved,
        "by_kind": _rounded(by_kind),
        "by_phase": _rounded(by_phase),
        "by_module": _rounded(by_module),
        "peak_memory": dataclasses.asdict(pm),
        "peak_bytes": pm.total_bytes,
        "live_at_peak": live_at_peak(graph, kernels, pm.peak_kernel, module),
    }


def _rounded(d: dict[str, float]) -> dict[str, float]:
    return dict(sorted(((k, float(v)) for k, v in d.items()), key=lambda kv: -kv[1]))


def live_at_peak(graph: Graph, kernels: list[Kernel], at: int, module: list[str] | None = None,
                 top: int = 12) -> list[dict]:
    """The largest tensors live when kernel ``at`` runs (liveness as :func:`peak_memory`):
    ``[{"bytes", "shape", "dtype", "op", "aten", "module"}]``, largest first."""
    outputs = set(graph.outputs)
    last_read: dict[int, int] = {}
    for i, k in enumerate(kernels):
        for r in k.reads:
            last_read[r] = i
    live: dict[int, int] = {}
    for i, k in enumerate(kernels[: at + 1]):
        for w in k.writes:
            if w not in outputs:
                live[w] = i
    alive = [w for w, born in live.items() if last_read.get(w, born) >= at]
    alive.sort(key=lambda w: -graph.nodes[w].type.nbytes)
    out = []
    for w in alive[:top]:
        n = graph.nodes[w]
        out.append({"bytes": n.type.nbytes, "shape": list(n.type.shape), "dtype": n.type.dtype, "op": n.op,
                    "aten": str(n.attrs.get("aten", "")), "module": (module[w] if module else "") or "",
                    "phase": str(n.attrs.get("phase", ""))})
    return out
