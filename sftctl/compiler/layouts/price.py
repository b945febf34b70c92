"""One parallel layout of a :class:`~sftctl.compiler.layouts.shape.TransformerShape` priced per rank.

Ranks are ordered tensor (innermost, stride 1), context, data, pipeline (outermost), as Megatron-LM
and torchtitan's device meshes order them, so a tensor group sits inside a node whenever
``tp <= gpus_per_node`` and pipeline neighbours are ``tp * cp * dp`` ranks apart. Expert groups are
carved out of the data x context ranks (Megatron-Core's expert-data parallelism).

**Compute** (seconds per micro-batch per stage): every GEMM of a block on the sharded shape it runs
on one rank (query/key/value and MLP-up ``n / tp``, attention-output and MLP-down ``k / tp``, tokens
``micro_batch * seq_len / cp``; MoE: ``experts / ep`` grouped GEMMs of the routed tokens at the
busiest expert-parallel rank's load (:func:`sftctl.compiler.layouts.memory.expert_load`: dropless,
as ``sftctl.train`` runs, the expected largest of the ``ep`` ranks' loads; or a GShard / Switch
capacity factor; the MoE step is the slowest rank's), whole experts under expert parallelism (expert tensor degree 1, each rank
routing its ``1 / tp`` of the tokens), ``/ tp`` without it), forward
and its two backward GEMMs (input gradient, weight gradient), each priced by
:func:`sftctl.compiler.gemm_table.gemm_gpu_time_s` (the compiler's library-GEMM price: the
accelerator's measured table or its fitted GEMM model), never a division of a whole step's time.
Attention: ``attention="flash"`` is the compiler's flash-attention kernel price
(:func:`sftctl.compiler.attention.attention_time_s`, ``heads / tp`` heads, ``seq / cp`` queries, the
causal share of the slowest context-parallel rank: :func:`cp_kept_fraction`, the mean under the
zigzag split ``sftctl.train`` runs);
``attention="gemm"`` is Megatron-LM 2021's unfused form (two batched GEMMs and a fused
scale-mask-softmax + dropout moving :data:`SOFTMAX_BYTES_PER_SCORE` bytes per score). The rest
(norms, residual adds, activation, dropout) is memory-bound: :data:`ELEMENTWISE_BYTES_PER_TOKEN`
at the HBM rate (:func:`sftctl.compiler.costmodel.memory_bound_time_s`). The LM head (vocabulary
``/ tp``) and the loss run on the last stage. Activation checkpointing recomputes the forward in
the backward (and its tensor-parallel collectives).

**Collectives**, each :func:`sftctl.compiler.collectives.time_s` (the calibrated model: NVLink/
NVSwitch inside a node, the offering's network across nodes, hierarchical where a group spans
both; a group whose ranks sit on different nodes shares each node's NICs with the node's other
groups): tensor parallel: 2 all-reduces of ``tokens x hidden`` per block forward and 2 backward
(sequence parallel: the same bytes as reduce-scatter + all-gather), exposed (Megatron-LM 2021
does not overlap them; with sequence parallelism and ``tp_comm_overlap`` each is split into
``tp`` chunks whose ``tp - 1`` transfers run under ``(tp-1)/tp`` of the GEMMs they feed, so only
the excess is exposed; an MoE block's pair around the router and its experts stays exposed: the
router needs the whole gathered input before any expert GEMM starts); pipeline: one send of the ``tokens x hidden / tp`` activation each way
per micro-batch per stage boundary (Megatron's scatter/gather split), ``v`` times as many under
the interleaved schedule, exposed; context parallel: the ring passes key/value chunks ``cp - 1``
times forward and twice as much backward, each hop under one of the ``cp`` attention steps
(only the excess over ``(cp-1)/cp`` of the attention is exposed); expert parallel: an all-to-all
dispatch and combine of the busiest rank's routed tokens (:func:`~.memory.expert_load`) each way, exposed, on the link
the expert group crosses (stride ``tp``: inside a node while ``tp x ep`` fits one); data parallel (over ``dp * cp`` ranks): DDP all-reduces float32 gradients once per
step (hidden behind the last micro-batch's backward when ``overlap_grad_reduce``), ZeRO-1
reduce-scatters them and all-gathers the bf16 parameters after the optimizer, FSDP (ZeRO-3)
all-gathers each block's bf16 parameters before its forward and its backward in every
micro-batch (hidden behind the previous block's compute: only the excess and the first block's
are exposed) and reduce-scatters float32 gradients once per step.

**Pipeline bubble** (Narayanan et al. 2021, section 2.2): ``(p - 1) / v`` micro-batch slots of
``t_f + t_b`` idle per step, ``v`` the model chunks per stage (1 for 1F1B), so the bubble's share
of the step is :func:`bubble_fraction` = ``((p-1)/v) / (m + (p-1)/v)``; ``(p-1)/(m+p-1)`` for 1F1B.

**Memory per rank**: :func:`sftctl.compiler.layouts.memory.memory_per_rank`, the one model the
planner's data-parallel strategies share (parameters, gradients and optimizer shards of the
heaviest stage, activations per micro-batch in flight under 1F1B or interleaving, logits, reserve).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

from sftctl.compiler.layouts.memory import (TORCH_AMP, Precision, expert_load, memory_per_rank, stage_params)
from sftctl.compiler.layouts.shape import TransformerShape
from sftctl.types.layout import Layout

#: AdamW's update reads and writes the float32 master, both moments and the gradient and writes
#: the bf16 weight: (4 + 4 + 4) x 2 + 4 + 2 bytes per parameter (a fused, memory-bound pass)
ADAM_BYTES_PER_PARAM = 30
#: memory-bound bytes per token per block outside GEMMs and attention, forward, in units of
#: hidden (``h``) and MLP width (``f``): two norms (read + write 2h each: 8h), two residual adds
#: (12h), two dropouts (read, write, mask: 10h), the activation (bias + GeLU: 4f; SwiGLU's product
#: of two: 6f). Counted from the ops of a GPT/Llama block in bf16; the backward moves twice as much.
ELEMENTWISE_BYTES_PER_TOKEN = {"h": 30, "f": 4, "f_gated": 6}
ELEMENTWISE_KERNELS = {"forward": 8, "backward": 16}
#: Megatron-LM 2021's fused scale-mask-softmax and dropout: bytes per attention score forward
#: (read 2, write 2, dropout read 2, write 2, mask 1) and backward (the same plus the incoming gradient)
SOFTMAX_BYTES_PER_SCORE = {"forward": 9, "backward": 11}


@dataclasses.dataclass(frozen=True)
class Links:
    """Where an offering's collectives run: ``accelerator`` (its catalog name: which in-host link,
    :func:`sftctl.compiler.collectives.host_link`), ``gpus_per_node`` x ``nodes``, the in-host
    link's bytes/s each way (None: the accelerator's measured link), the node's network bytes/s
    (all NICs; None: 10 Gbit/s), ``provider`` (which network: EFA on ``aws``, else InfiniBand/RDMA;
    :func:`sftctl.compiler.collectives.network_link`)."""

    accelerator: str
    gpus_per_node: int
    nodes: int = 1
    intra_node_bytes_per_s: float | None = None
    inter_node_bytes_per_s: float | None = None
    provider: str | None = None

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def collective_s(self, op: str, nbytes: float, group: int, stride: int) -> float:
        """One collective of ``nbytes`` per rank over ``group`` ranks spaced ``stride`` apart
        (rank order: tensor innermost). Seconds."""
        from sftctl.compiler.collectives import time_s

        if group <= 1 or nbytes <= 0:
            return 0.0
        g = self.gpus_per_node
        inter = self.inter_node_bytes_per_s or 1.25e9
        if stride * group <= g:  # inside one node
            return time_s(op, nbytes, self.accelerator, group, 1, self.intra_node_bytes_per_s, None, self.provider)
        per_node = max(1, g // stride)  # members of the group on one node
        nodes = max(2, group // per_node)
        # the node's NICs are shared by the stride / ... groups running at once: this group's share
        share = inter * per_node / g
        return time_s(op, nbytes, self.accelerator, per_node, nodes, self.intra_node_bytes_per_s, share,
                      self.provider)


@dataclasses.dataclass(frozen=True)
class LayoutPrediction:
    """A layout priced on an offering: seconds per step (and its parts), bytes per rank."""

    layout: Layout
    step_time_s: float
    compute_time_s: float  # every micro-batch's forward + backward on the slowest stage, + optimizer
    bubble_time_s: float
    comm_time_s: float  # exposed collectives: tensor, pipeline, context, expert, data parallel
    comm: dict  # seconds per kind: tp, pp, cp, ep, dp (exposed)
    memory_bytes: int
    memory_capacity_bytes: int
    memory: dict  # bytes per rank by kind: weights, grads, optimizer, activations, gather, logits, reserve
    accelerator: str = ""  # the catalog name whose calibrated error factor bounds the step

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_capacity_bytes

    @property
    def step_time_interval_s(self) -> tuple[float, float]:
        """The step time divided and multiplied by the accelerator's calibrated error factor for a
        step with this layout's share of exposed communication
        (:func:`sftctl.compiler.accuracy.interval`), as every other prediction states it."""
        from sftctl.compiler.accuracy import interval

        share = self.comm_time_s / self.step_time_s if self.step_time_s > 0 else 0.0
        return interval(self.accelerator, self.step_time_s, share)

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_time_s / self.step_time_s if self.step_time_s else 0.0

    def to_dict(self) -> dict:
        return {"layout": self.layout.label, **self.layout.to_dict(), "step_time_s": self.step_time_s,
                "compute_time_s": self.compute_time_s, "bubble_time_s": self.bubble_time_s,
                "comm_time_s": self.comm_time_s, "comm": dict(self.comm), "memory_bytes": self.memory_bytes,
                "memory_capacity_bytes": self.memory_capacity_bytes, "memory": dict(self.memory), "fits": self.fits,
                "step_time_interval_s": list(self.step_time_interval_s)}


def bubble_fraction(pp: int, micro_batches: int, interleave: int = 1) -> float:
    """The pipeline bubble's share of a step: ``((p-1)/v) / (m + (p-1)/v)`` (Narayanan et al. 2021,
    section 2.2.1: bubble time ``(p-1)/v`` micro-batch slots against ``m`` of work; 1F1B: ``v = 1``,
    ``(p-1)/(m+p-1)``). Computed in exact fractions.

    Raises:
        ValueError: a degree below 1.
    """
    if min(pp, micro_batches, interleave) < 1:
        raise ValueError(f"pp, micro_batches and interleave must be >= 1, got {pp}, {micro_batches}, {interleave}")
    idle = Fraction(pp - 1, interleave)
    return float(idle / (micro_batches + idle))


# --------------------------------------------------------------------------------------------
# compute


class _Prices:
    """GEMM and memory-bound prices on one target, cached by shape."""

    def __init__(self, target, dtype: str) -> None:
        self.target, self.dtype = target, dtype
        self._gemm: dict[tuple, float] = {}

    def gemm(self, b: int, m: int, n: int, k: int) -> float:
        from sftctl.compiler.costmodel import memory_bound_time_s
        from sftctl.compiler.gemm_table import gemm_gpu_time_s

        key = (b, max(1, m), max(1, n), max(1, k))
        got = self._gemm.get(key)
        if got is None:
            hw = self.target.hw
            got = gemm_gpu_time_s(*key, hw, self.dtype)
            if got is None:  # no GEMM model for this accelerator: the roofline
                b_, m_, n_, k_ = key
                flops = 2.0 * b_ * m_ * n_ * k_
                got = max(flops / hw.matrix_peak(self.dtype),
                          float(memory_bound_time_s(2 * b_ * (m_ * k_ + k_ * n_ + m_ * n_), hw, self.target.coeffs)))
            self._gemm[key] = got
        return got

    def fwd_bwd(self, b: int, m: int, n: int, k: int) -> tuple[float, float]:
        """``x[m,k] @ w[k,n]`` forward; backward: input gradient ``[m,n] @ [n,k]`` and weight
        gradient ``[k,m] @ [m,n]``."""
        return self.gemm(b, m, n, k), self.gemm(b, m, k, n) + self.gemm(b, k, n, m)

    def memory(self, nbytes: float, kernels: int) -> float:
        from sftctl.compiler.costmodel import memory_bound_time_s

        return float(memory_bound_time_s(nbytes, self.target.hw, self.target.coeffs, kernels))


def cp_kept_fraction(seq_len: int, cp: int, load_balance: bool = True) -> float:
    """The share of a context-parallel rank's ``seq_len / cp`` x ``seq_len`` score rectangle its
    causal attention computes, on the rank that computes the most: load-balanced (the zigzag split
    :mod:`sftctl.train.context_parallel` runs by default) every rank the mean,
    ``causal_fraction(seq_len, seq_len)``; contiguous the last rank, which sees ``cp - 1`` chunks
    whole and its own causally: ``((cp - 1) n^2 + n (n + 1) / 2) / (n seq_len)``, ``n = seq_len /
    cp`` (``(2 cp - 1) / cp`` times the mean for long sequences)."""
    from sftctl.compiler.fusion import causal_fraction

    if cp <= 1 or load_balance:
        return causal_fraction(seq_len, seq_len)
    n = seq_len // cp
    return ((cp - 1) * n * n + n * (n + 1) / 2) / (n * seq_len)


def _attention_s(shape: TransformerShape, lay: Layout, prices: _Prices, attention: str,
                 cp_load_balance: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of one block's attention core on one rank for one micro-batch
    (under context parallelism the slowest rank's: :func:`cp_kept_fraction`)."""
    heads = max(1, shape.heads // lay.tp)
    q_len = shape.seq_len // lay.cp
    b = lay.micro_batch
    if attention == "gemm":  # Megatron-LM 2021: Q K^T, softmax, P V as batched GEMMs, causal not skipped
        bh = b * heads
        d = shape.head_dim
        f = prices.gemm(bh, q_len, shape.seq_len, d) + prices.gemm(bh, q_len, d, shape.seq_len)
        bw = (prices.gemm(bh, q_len, d, shape.seq_len) + prices.gemm(bh, shape.seq_len, d, q_len)
              + prices.gemm(bh, q_len, shape.seq_len, d) + prices.gemm(bh, d, shape.seq_len, q_len))
        scores = bh * q_len * shape.seq_len
        return (f + prices.memory(scores * SOFTMAX_BYTES_PER_SCORE["forward"], 1),
                bw + prices.memory(scores * SOFTMAX_BYTES_PER_SCORE["backward"], 1))
    from sftctl.compiler.attention import attention_time_s

    kv = max(1, shape.kv_heads // lay.tp)
    base = {"batch": b, "q_heads": heads, "kv_heads": kv, "q_len": q_len, "kv_len": shape.seq_len,
            "head_dim": shape.head_dim, "v_head_dim": shape.head_dim, "dtype": shape.dtype, "causal": True,
            "kept_fraction": cp_kept_fraction(shape.seq_len, lay.cp, cp_load_balance), "implementation": "auto"}
    return (attention_time_s(base | {"direction": "forward"}, prices.target),
            attention_time_s(base | {"direction": "backward"}, prices.target))


def _block_compute_s(shape: TransformerShape, lay: Layout, prices: _Prices, attention: str,
                     cp_load_balance: bool = True, load: float = 1.0) -> tuple[float, float, float, float]:
    """(forward, backward, forward GEMMs, backward GEMMs) seconds of one block on one rank for one
    micro-batch, backward without recomputation. The GEMM terms are those a tensor-parallel
    all-gather / reduce-scatter can run under (all four of a dense block; the attention's two of
    an MoE block: the router needs the whole gathered input before any expert GEMM starts, so
    the MoE half's collectives cannot be split into the GEMMs they feed). ``load``: the busiest
    expert-parallel rank's routed tokens over the uniform share (:func:`~.memory.expert_load`)."""
    t = lay.tp
    tokens = lay.micro_batch * shape.seq_len // lay.cp
    h, f = shape.hidden, shape.ffn
    gemms = [(1, tokens, math.ceil(shape.qkv_width / t), h),
             (1, tokens, h, math.ceil(shape.heads * shape.head_dim / t))]
    up = f * (2 if shape.gated_mlp else 1)
    if shape.experts:
        local = max(1, shape.experts // lay.ep)
        if lay.ep > 1:  # expert parallel: whole experts (expert tensor degree 1), each rank's 1/tp of the tokens
            per_expert = math.ceil(tokens / t * shape.top_k * lay.ep / shape.experts * load)
            gemms += [(local, per_expert, up, h), (local, per_expert, h, f)]
        else:
            per_expert = math.ceil(tokens * shape.top_k / shape.experts * load)
            gemms += [(local, per_expert, math.ceil(up / t), h), (local, per_expert, h, math.ceil(f / t))]
        gemms.append((1, tokens, shape.experts, h))  # the router
    else:
        gemms += [(1, tokens, math.ceil(up / t), h), (1, tokens, h, math.ceil(f / t))]
    fwd = bwd = 0.0
    gemm_f = gemm_b = 0.0
    for i, g in enumerate(gemms):
        a, b_ = prices.fwd_bwd(*g)
        fwd, bwd = fwd + a, bwd + b_
        if i < 2 or not shape.experts:  # the GEMMs a tensor-parallel collective can run under
            gemm_f, gemm_b = gemm_f + a, gemm_b + b_
    af, ab = _attention_s(shape, lay, prices, attention, cp_load_balance)
    sp = t if (lay.sequence_parallel and t > 1) else 1
    per_token = (ELEMENTWISE_BYTES_PER_TOKEN["h"] * h / sp
                 + ELEMENTWISE_BYTES_PER_TOKEN["f_gated" if shape.gated_mlp else "f"] * f / t
                 * (shape.top_k * load if shape.experts else 1))
    ew = prices.memory(tokens * per_token, ELEMENTWISE_KERNELS["forward"])
    ewb = prices.memory(2 * tokens * per_token, ELEMENTWISE_KERNELS["backward"])
    return fwd + af + ew, bwd + ab + ewb, gemm_f, gemm_b


def _head_compute_s(shape: TransformerShape, lay: Layout, prices: _Prices) -> tuple[float, float]:
    """(forward, backward) seconds of the LM head and the loss on the last stage, one micro-batch:
    a ``vocab / tp`` GEMM and the cross-entropy over its logits (bf16 logits, float32 softmax:
    12 bytes per logit both ways)."""
    tokens = lay.micro_batch * shape.seq_len // lay.cp
    v = math.ceil(shape.vocab / lay.tp)
    f, b = prices.fwd_bwd(1, tokens, v, shape.hidden)
    loss = prices.memory(tokens * v * 12, 3)
    return f + loss / 2, b + loss / 2


# --------------------------------------------------------------------------------------------
# the step


def price(shape: TransformerShape, lay: Layout, target, links: Links, *, attention: str = "flash",
          overlap_grad_reduce: bool = True, tp_comm_overlap: bool = True, prices: _Prices | None = None,
          precision: Precision = TORCH_AMP, cp_load_balance: bool = True,
          capacity_factor: float | None = None) -> LayoutPrediction:
    """``lay`` of ``shape`` on ``links.world`` ranks of ``target`` (a compiler
    :class:`~sftctl.compiler.target.Target`): seconds per step of ``lay.global_batch`` sequences
    and bytes per rank (module docstring). ``attention``: ``flash`` (the compiler's kernel) or
    ``gemm`` (Megatron-LM 2021's unfused attention). ``overlap_grad_reduce``: DDP's gradient
    reduction hidden behind the last micro-batch's backward (Megatron-Core, torch DDP); False: after it.
    ``tp_comm_overlap``: under sequence parallelism each all-gather / reduce-scatter runs under the
    GEMM it feeds or drains (torchtitan's async tensor parallel, Transformer Engine's userbuffers
    overlap), only the excess over the block's GEMM time is exposed; False (Megatron-LM 2021): all exposed.
    ``precision``: the bytes per parameter the run keeps (:mod:`.memory`: sftctl.train's torch
    mixed precision, or Megatron-LM's) and the dtypes FSDP / ZeRO gather and reduce in.
    ``cp_load_balance``: context parallelism's zigzag split (``sftctl.train``'s default,
    :data:`sftctl.train.context_parallel.LOAD_BALANCE`): every rank's attention the mean share;
    False: the contiguous split, priced at its last (slowest) rank's (:func:`cp_kept_fraction`).
    ``capacity_factor``: MoE routing (:func:`~sftctl.compiler.layouts.memory.expert_load`): None
    dropless (``sftctl.train``'s), the busiest expert-parallel rank's expected load; a factor
    (:data:`~sftctl.compiler.layouts.memory.CAPACITY_FACTOR`, 1.25) GShard / Switch buffers of that size.

    Raises:
        ValueError: the layout's world size is not the offering's, or a degree does not divide
            what it splits (heads by tp, layers by pp x interleave, sequence by cp, experts by ep).
    """
    if lay.world != links.world:
        raise ValueError(f"layout {lay.label} has {lay.world} ranks, the offering {links.world}")
    if shape.heads % lay.tp or shape.layers % (lay.pp * lay.chunks) or shape.seq_len % lay.cp:
        raise ValueError(f"layout {lay.label} does not divide {shape}")
    if lay.ep > 1 and (not shape.experts or shape.experts % lay.ep or (lay.dp * lay.cp) % lay.ep):
        raise ValueError(f"layout {lay.label}: ep must divide the experts and dp x cp")
    prices = prices or _Prices(target, shape.dtype)
    t, p, c, d, v, m = lay.tp, lay.pp, lay.cp, lay.dp, lay.chunks, lay.micro_batches
    tokens = lay.micro_batch * shape.seq_len // c
    per_stage = shape.layers // p
    load = expert_load(shape, lay, capacity_factor)
    bf, bb, gf, gb = _block_compute_s(shape, lay, prices, attention, cp_load_balance, load)

    # tensor parallel: 2 all-reduces of the block's [tokens, hidden] activation each way (sequence
    # parallel: all-gather + reduce-scatter, the same bytes), overlapped with the GEMMs they feed
    # when ``tp_comm_overlap``
    act_bytes = tokens * shape.hidden * 2
    tp_ar = links.collective_s("all-reduce", act_bytes, t, 1) if t > 1 else 0.0
    tp_f, tp_b = 2 * tp_ar, 2 * tp_ar
    if tp_comm_overlap and lay.sequence_parallel and t > 1:
        # each pair hides under the GEMMs it feeds, decomposed into t chunks: t - 1 transfers run
        # under t - 1 of the t GEMM chunks, so (t-1)/t of the GEMM time hides them; an MoE block's
        # second pair (around the router and the experts) cannot (see _block_compute_s): exposed
        moe = tp_ar if shape.experts else 0.0
        under = (t - 1) / t
        tp_f, tp_b = max(0.0, tp_f - moe - gf * under) + moe, max(0.0, tp_b - moe - gb * under) + moe
    # context parallel: the ring passes each rank's K and V chunks cp - 1 times (fwd), K, V, dK, dV (bwd)
    cp_f = cp_b = 0.0
    if c > 1:
        kv_bytes = 2 * tokens * max(1, shape.kv_heads // t) * shape.head_dim * 2
        hop = links.collective_s("collective-permute", kv_bytes, 2, t)
        af, ab = _attention_s(shape, lay, prices, attention, cp_load_balance)
        # c attention steps per direction, the c - 1 hops each under one step: (c-1)/c of it hides them
        cp_f = max(0.0, (c - 1) * hop - af * (c - 1) / c)
        cp_b = max(0.0, 2 * (c - 1) * hop - ab * (c - 1) / c)
    # expert parallel: dispatch + combine of the routed tokens, each way, at the busiest rank's
    # load (the all-to-all ends when its largest receiver has its tokens)
    ep_f = ep_b = 0.0
    if shape.experts and lay.ep > 1:
        routed = tokens / t * shape.top_k * load * shape.hidden * 2
        a2a = links.collective_s("all-to-all", routed, lay.ep, t)
        ep_f, ep_b = 2 * a2a, 2 * a2a
    recompute = lay.checkpointing
    block_f = bf
    block_b = bb + (bf if recompute else 0.0)
    hf, hb = _head_compute_s(shape, lay, prices)
    # the slowest stage: the last (its blocks and the head)
    stage_f = per_stage * block_f + hf
    stage_b = per_stage * block_b + hb
    comm_f = per_stage * (tp_f + cp_f + ep_f)
    comm_b = per_stage * (tp_b + cp_b + ep_b + ((tp_f + cp_f + ep_f) if recompute else 0.0))
    slot = stage_f + stage_b + comm_f + comm_b  # one micro-batch through the stage

    # pipeline: the bubble and the point-to-point sends
    bubble = (p - 1) / v * slot
    pp_s = 0.0
    if p > 1:
        send = links.collective_s("collective-permute", act_bytes / t, 2, t * c * d)
        pp_s = (m * v + p - 1) * 2 * send

    # data parallel over dp x cp ranks (stride tp)
    dense, expert = stage_params(shape, lay)
    group = d * c
    egroup = max(1, group // lay.ep)
    optimizer_params = dense + expert
    rb, gbytes = precision.reduce_bytes, precision.gather_bytes
    dp_s = 0.0
    if group > 1:
        def reduce(op: str, nbytes_dense: float, nbytes_expert: float) -> float:
            return (links.collective_s(op, nbytes_dense, group, t)
                    + (links.collective_s(op, nbytes_expert, egroup, t * lay.ep) if nbytes_expert else 0.0))
        hidden_behind = stage_b if overlap_grad_reduce else 0.0
        if lay.dp_sharding == "ddp":
            dp_s = max(0.0, reduce("all-reduce", dense * rb, expert * rb) - hidden_behind)
        elif lay.dp_sharding == "zero1":
            dp_s = (max(0.0, reduce("reduce-scatter", dense * rb, expert * rb) - hidden_behind)
                    + reduce("all-gather", dense * gbytes, expert * gbytes))
            optimizer_params = dense / group + expert / egroup
        else:  # fsdp: per block all-gathers every micro-batch (forward, backward), reduce-scatter once
            blocks = per_stage
            ag = reduce("all-gather", dense * gbytes / blocks, expert * gbytes / blocks)
            rs = reduce("reduce-scatter", dense * rb / blocks, expert * rb / blocks)
            fwd_block = stage_f / blocks
            bwd_block = stage_b / blocks
            per_mb = ag + blocks * (max(0.0, ag - fwd_block) + max(0.0, ag - bwd_block))
            dp_s = m * per_mb + rs + blocks * max(0.0, rs - bwd_block)
            optimizer_params = dense / group + expert / egroup
    optimizer = prices.memory(optimizer_params * ADAM_BYTES_PER_PARAM, 3)

    compute = m * (stage_f + stage_b) + optimizer
    comm = {"tp": m * per_stage * (tp_f + tp_b + (tp_f if recompute else 0.0)),
            "cp": m * per_stage * (cp_f + cp_b + (cp_f if recompute else 0.0)),
            "ep": m * per_stage * (ep_f + ep_b + (ep_f if recompute else 0.0)),
            "pp": pp_s, "dp": dp_s}
    comm_total = sum(comm.values())
    step = compute + bubble + comm_total
    mem = memory_per_rank(shape, lay, attention, precision, capacity_factor)
    return LayoutPrediction(layout=lay, step_time_s=step, compute_time_s=compute, bubble_time_s=bubble,
                            comm_time_s=comm_total, comm=comm, memory_bytes=int(sum(mem.values())),
                            memory_capacity_bytes=int(target.hw.memory_bytes), memory=mem, accelerator=target.name)
