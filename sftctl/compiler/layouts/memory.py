"""Memory per rank of a parallel layout: the one model the planner's data-parallel strategies
(:func:`sftctl.compiler.sharding.predict_strategies`) and the layout search
(:func:`sftctl.compiler.layouts.price.price`) both use.

**State** (:func:`sharded_state`, bytes per rank): parameters, gradients and optimizer state of
the parameters a rank holds (a pipeline stage's, ``/ tp``, experts ``/ ep``), then divided by the
data dimension's sharding: DDP keeps all three, ZeRO-1 divides the optimizer state over the shard
group, FSDP (ZeRO-3, torch FSDP2) all three, plus the unit being gathered and the prefetched next
one in the gather dtype and one unit's gradients in the reduce dtype before their
reduce-scatter. How many bytes each parameter costs is the :class:`Precision` the run keeps:
:data:`TORCH_AMP` (what ``sftctl.train`` runs and the planner's compiled step traces: float32
parameters under autocast, float32 gradients, AdamW's two float32 moments) or :data:`MEGATRON`
(Megatron-LM's mixed precision: bf16 weights, float32 main gradients, float32 master + moments).

**Activations** (:func:`activation_bytes_per_layer`, :func:`in_flight_micro_batches`): what a block
saves for backward per micro-batch (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", Table 2, generalised to the block's widths and the compute dtype),
times the micro-batches a pipeline stage holds: ``min(m, p)`` under 1F1B (the first stage warms
up with ``p`` forwards before its first backward), ``p (1 + (p-1)/(p v))`` interleaved (their
section 5); checkpointing keeps each block's input per micro-batch in flight and one block's
activations being recomputed.
"""

from __future__ import annotations

import dataclasses

from sftctl.compiler.layouts.shape import TransformerShape
from sftctl.types.layout import DP_SHARDINGS as SHARDINGS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
#: the capacity factor a run that drops tokens is priced at unless told: 1.25, a value Switch
#: Transformer trains with (Fedus et al. 2021, "Switch Transformers", section 2.2 and Table 1,
#: which compares capacity factors 1.0 and 1.25 with 2.0 for top-2 MoE); GShard (Lepikhin et al.
#: 2020, section 2.2) sizes each expert's buffer the same way, ``capacity_factor x tokens x k / E``
CAPACITY_FACTOR = 1.25


def _expected_max_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals] by Blom's approximation
    ``Phi^-1((n - 0.375) / (n + 0.25))`` (within 1 % for n = 2..64; 0 for n = 1)."""
    from statistics import NormalDist

    return 0.0 if n <= 1 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def expert_load(shape: TransformerShape, lay, capacity_factor: float | None = None) -> float:
    """Tokens the busiest expert-parallel rank's experts process, as a multiple of the uniform
    top-k share (``tokens x top_k / ep`` per rank): what its expert GEMMs, its all-to-all and its
    routed activations carry, and so the MoE step's time (the slowest rank's).

    ``capacity_factor`` set (a run that drops tokens, GShard / Switch, :data:`CAPACITY_FACTOR` the
    usual value): every expert's buffer is ``capacity_factor`` times the uniform share, filled or
    padded, so every rank carries exactly that. ``None`` (dropless: what ``sftctl.train`` runs,
    and Megatron-Core's and torchtitan's default): no token is dropped, so the busiest rank
    carries the largest of the ``ep`` ranks' routed loads. Its expectation for a router balanced
    in expectation (each token's ``k`` experts a uniform draw without replacement, what the
    auxiliary balance loss aims at): the count of (token, slot) pairs a rank of ``g = E / ep``
    experts receives from ``N = ep x tokens`` tokens is a sum of ``N`` hypergeometric draws
    (mean ``k g / E``, variance ``k (g/E)(1 - g/E)(E - k)/(E - 1)`` each), about normal; the ``ep``
    counts sum to ``N k``, so they are equicorrelated (``-1 / (ep - 1)``), i.e. iid normals of
    variance ``sd^2 / (1 - 1/ep)`` less their mean, and the largest is the mean plus
    ``E[max of ep standard normals] x sd / sqrt(1 - 1/ep)`` (:func:`_expected_max_normal`; a
    Monte Carlo of the routing agrees: tests/test_layouts.py). Times ``shape.expert_capacity`` (the spec's
    ``model.expert_capacity``: the router's skew over uniform a user states; 1.0 by default).
    This is a floor: a trained router's own skew (a popular expert) is only what that setting says.
    ``tokens``: the micro-batch's ``micro_batch x seq_len / cp``, each rank routing its ``1 / tp``.
    1.0 (x ``expert_capacity``) without experts or without expert parallelism (one rank holds
    every expert: its total is fixed).

    Raises:
        ValueError: a capacity factor not above 0.
    """
    if capacity_factor is not None:
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        return float(capacity_factor)
    if not shape.experts or lay.ep <= 1:
        return float(shape.expert_capacity)
    e, k, ep = shape.experts, max(1, shape.top_k), lay.ep
    tokens = lay.micro_batch * shape.seq_len / lay.cp / lay.tp
    frac = (e // ep) / e
    var1 = k * frac * (1 - frac) * ((e - k) / (e - 1) if e > 1 else 0.0)
    mean = tokens * ep * k * frac
    sd = (tokens * ep * var1) ** 0.5
    return float(shape.expert_capacity) * (1.0 + _expected_max_normal(ep) * sd / (1 - 1 / ep) ** 0.5 / mean)


@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes per parameter a run keeps: ``weight_bytes`` (the resident weights), ``grad_bytes``,
    ``optimizer_bytes`` (master copy if any + Adam's two moments); FSDP gathers parameters in
    ``gather_bytes`` and reduce-scatters gradients in ``reduce_bytes``. ``eager_kernels``: the
    block runs torch's eager ops, each saving its own inputs (what the activations keep:
    :func:`activation_bytes_per_layer`), not Megatron-LM's fused kernels."""

    name: str
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    gather_bytes: int = 2
    reduce_bytes: int = 4
    eager_kernels: bool = False

    @property
    def state_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


#: torch mixed precision as sftctl.train runs it (float32 parameters, autocast, float32 gradients,
#: AdamW exp_avg and exp_avg_sq in float32; FSDP2 MixedPrecisionPolicy(param_dtype=bf16,
#: reduce_dtype=float32)): 4 + 4 + 8 = 16 bytes per parameter
TORCH_AMP = Precision("torch-amp", 4, 4, 8, eager_kernels=True)
#: Megatron-LM mixed precision (Rajbhandari et al. 2020, ZeRO, section 3.1: 2 + 2 + 12 with fp16
#: gradients; Megatron keeps float32 main gradients, so 4): 18 bytes per parameter
MEGATRON = Precision("megatron", 2, 4, 12)
PRECISIONS = {p.name: p for p in (TORCH_AMP, MEGATRON)}


def sharded_state(weights: float, grads: float, optimizer: float, sharding: str, group: int, *,
                  unit_params: float = 0.0, gather_bytes: int = 2, reduce_bytes: int = 4) -> dict[str, float]:
    """Bytes per rank of parameters (``weights``), gradients and optimizer state (each the
    unsharded bytes of the parameters this rank's shard group holds) under ``sharding`` over
    ``group`` ranks: ``ddp`` keeps them whole, ``zero1`` divides ``optimizer`` by ``group``,
    ``fsdp`` all three, plus ``gather``: two units of ``unit_params`` parameters gathered in
    ``gather_bytes`` (the unit running and the prefetched next) and one unit's gradients in
    ``reduce_bytes`` (before its reduce-scatter).

    Returns:
        ``{"weights", "grads", "optimizer", "gather"}`` in bytes (floats).
    Raises:
        ValueError: an unknown sharding or a group below 1.
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    if group < 1:
        raise ValueError(f"the shard group must have at least 1 rank, got {group}")
    if sharding == "ddp":
        return {"weights": float(weights), "grads": float(grads), "optimizer": float(optimizer), "gather": 0.0}
    if sharding == "zero1":
        return {"weights": float(weights), "grads": float(grads), "optimizer": optimizer / group, "gather": 0.0}
    gather = 2 * unit_params * gather_bytes + unit_params * reduce_bytes
    return {"weights": weights / group, "grads": grads / group, "optimizer": optimizer / group, "gather": gather}


def in_flight_micro_batches(pp: int, micro_batches: int, interleave: int = 1) -> float:
    """Micro-batches whose activations the first (heaviest) pipeline stage holds at once: ``min(m, p)``
    under 1F1B, ``min(m, p (1 + (p-1)/(p v)))`` interleaved (Korthikanti et al. 2022, section 5);
    1 without pipelining."""
    p, m, v = pp, micro_batches, interleave
    if p <= 1:
        return 1.0
    return float(min(m, p)) if v == 1 else min(float(m), p * (1 + (p - 1) / (p * v)))


def activation_bytes_per_layer(shape: TransformerShape, lay, attention: str = "flash", eager: bool = False,
                               capacity_factor: float | None = None) -> float:
    """Bytes one block saves for backward per micro-batch on one rank (Korthikanti et al. 2022,
    Table 2, ``sbh (10 + 24/t + 5 a s / (h t))`` for a GPT block in 16-bit, generalised), in
    elements of the compute dtype (``e`` bytes) per token: kept whole under tensor parallelism
    without sequence parallelism: two norms' inputs, the attention and MLP inputs (4h), and with
    dropout two 1-byte masks (2h bytes); divided by ``tp``: query/key/value (``qkv_width``), the
    output projection's input (h), the MLP's inner activations (2f: the up projection's output
    and the activation's; gated 3f: gate, up, their product; MoE: ``top_k x`` :func:`expert_load`
    of them, the busiest expert-parallel rank's, ``capacity_factor`` as there);
    unfused attention (``attention="gemm"``) adds the scores and the softmax (``2 a s`` elements)
    and with dropout its 1-byte mask (``a s``), flash attention none. Sequence parallelism divides
    everything by ``tp``; context parallelism the tokens by ``cp``. ``eager`` (torch's eager ops
    instead of Megatron's fused kernels): the attention's output is kept twice (the kernel's
    ``[b, heads, s, d]`` output for its backward and the ``[b, s, h]`` copy the output projection
    reads: + h), and a gated MLP four times f (gate, up, ``silu(gate)`` and the product the down
    projection reads). ``lay`` is a :class:`~sftctl.types.layout.Layout`."""
    t = lay.tp
    e = DTYPE_BYTES.get(shape.dtype, 2)
    tokens = lay.micro_batch * shape.seq_len / lay.cp
    whole = 4 * shape.hidden * e + (2 * shape.hidden if shape.dropout else 0)
    routed = shape.top_k * expert_load(shape, lay, capacity_factor) if shape.experts else 1
    mlp = (4 if eager else 3) if shape.gated_mlp else 2
    split = float(e * (shape.qkv_width + (2 if eager else 1) * shape.hidden + mlp * shape.ffn * routed))
    if attention == "gemm":
        split += (2 * e + (1 if shape.dropout else 0)) * shape.heads * shape.seq_len / lay.cp
    sp = t if (lay.sequence_parallel and t > 1) else 1
    return tokens * (whole / sp + split / t)


def stage_params(shape: TransformerShape, lay) -> tuple[float, float]:
    """(dense, expert) parameters one rank of the heaviest pipeline stage holds: the stage's
    blocks and the embedding (and the head without pipelining), ``/ tp``; experts ``/ ep`` under
    expert parallelism (whole experts), else ``/ tp``."""
    per_stage = shape.layers / lay.pp
    embed = shape.vocab * shape.hidden
    edge = embed * (2 if lay.pp == 1 and not shape.tied_embeddings else 1)
    expert_layer = shape.mlp_params if shape.experts else 0
    dense = per_stage * (shape.layer_params - expert_layer) + edge
    return dense / lay.tp, per_stage * expert_layer / (lay.ep if lay.ep > 1 else lay.tp)


def memory_per_rank(shape: TransformerShape, lay, attention: str = "flash",
                    precision: Precision = TORCH_AMP, capacity_factor: float | None = None) -> dict:
    """Bytes per rank by kind on the heaviest pipeline stage: the first (the embedding,
    :func:`in_flight_micro_batches` micro-batches in flight) or the last (the LM head, one
    micro-batch under 1F1B, and its logits), whichever needs more: ``weights``, ``grads``,
    ``optimizer``, ``gather`` (:func:`sharded_state`: dense parameters sharded over ``dp x cp``,
    experts over ``dp x cp / ep``), ``activations`` (:func:`activation_bytes_per_layer` x the
    stage's blocks x micro-batches in flight), ``logits``
    (the LM head's output, its float32 log-softmax and gradient: ``e + 4 + 4`` bytes per logit,
    ``+ 4`` for the logits' gradient under torch's eager cross-entropy without tensor parallelism),
    ``reserve`` (:data:`sftctl.compiler.memory.RUNTIME_RESERVE_BYTES`). ``capacity_factor``: the MoE
    routing (:func:`expert_load`; None: dropless)."""
    from sftctl.compiler.memory import RUNTIME_RESERVE_BYTES

    pr = precision
    dense, expert = stage_params(shape, lay)
    shard = lay.dp * lay.cp
    expert_shard = max(1, shard // lay.ep)
    expert_layer = shape.mlp_params if shape.experts else 0
    unit = (shape.layer_params - expert_layer) / lay.tp + expert_layer / (lay.ep if lay.ep > 1 else lay.tp)
    kw = dict(gather_bytes=pr.gather_bytes, reduce_bytes=pr.reduce_bytes)
    mem = sharded_state(dense * pr.weight_bytes, dense * pr.grad_bytes, dense * pr.optimizer_bytes, lay.dp_sharding,
                        shard, unit_params=unit, **kw)
    if expert:
        ex = sharded_state(expert * pr.weight_bytes, expert * pr.grad_bytes, expert * pr.optimizer_bytes,
                           lay.dp_sharding, expert_shard, **kw)
        mem = {k: mem[k] + ex[k] for k in mem}
    layer_act = activation_bytes_per_layer(shape, lay, attention, pr.eager_kernels, capacity_factor)
    per_stage = shape.layers / lay.pp
    e = DTYPE_BYTES.get(shape.dtype, 2)

    def acts(in_flight: float) -> float:
        if lay.checkpointing:
            sp = lay.tp if (lay.sequence_parallel and lay.tp > 1) else 1
            block_input = lay.micro_batch * shape.seq_len / lay.cp * shape.hidden * e / sp
            return per_stage * block_input * in_flight + layer_act
        return per_stage * layer_act * in_flight

    tokens = lay.micro_batch * shape.seq_len / lay.cp
    # the logits (e), the float32 log-probabilities and their gradient (4 + 4), and under torch's own
    # cross-entropy the logits' float32 gradient beside them (4); a vocabulary-parallel loss (torch's
    # loss_parallel, Megatron's) computes the softmax gradient in one pass (nll_loss_backward)
    fused_loss = lay.tp > 1 or not pr.eager_kernels
    logits = tokens * shape.vocab / lay.tp * (e + 8 + (0 if fused_loss else 4))
    # the first stage holds the most micro-batches in flight, the last one micro-batch (1F1B: its
    # backward follows each forward) and the logits: the heavier of the two
    first = acts(in_flight_micro_batches(lay.pp, lay.micro_batches, lay.chunks))
    last = acts(1.0 if lay.chunks == 1 else in_flight_micro_batches(lay.pp, lay.micro_batches, lay.chunks))
    if lay.pp > 1 and first > last + logits:
        mem["activations"], mem["logits"] = first, 0.0
    else:
        mem["activations"], mem["logits"] = last, logits
    mem["reserve"] = float(RUNTIME_RESERVE_BYTES)
    return {k: int(v_) for k, v_ in mem.items()}


__all__ = ["CAPACITY_FACTOR", "MEGATRON", "PRECISIONS", "TORCH_AMP", "Precision", "activation_bytes_per_layer",
           "expert_load", "in_flight_micro_batches", "memory_per_rank", "sharded_state", "stage_params"]
