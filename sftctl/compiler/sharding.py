"""Price a compiled step under each data-parallel strategy: DDP or FSDP, with or without
activation checkpointing, on ``nodes`` x ``gpus_per_node`` devices.

Strategies (what :func:`sftctl.train.prepare` runs):

* ``ddp``: every device holds the whole model, its gradients and AdamW state (the compiled step's
  liveness as it is); gradients are all-reduced while backward runs (see
  :func:`sftctl.compiler.step.predict`).
* ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard`` on each block, then on the root), ZeRO-3
  semantics: parameters, gradients and optimizer state are divided over the ``world`` devices of
  the shard group; each block's parameters are all-gathered (in the compute dtype under mixed
  precision) before its forward and again before its backward, and its gradients are
  reduce-scattered after its backward in the job's reduce dtype (torch's
  ``MixedPrecisionPolicy.reduce_dtype``: float32 in :func:`sftctl.train.prepare`, 4 bytes; bf16 in
  a job that asks for it, e.g. fms-fsdp's ``bfSixteen`` policy, 2 bytes: ``reduce_dtype_bytes``).
* activation checkpointing (either strategy): each block keeps only its input during forward and
  recomputes its activations in backward.

Memory per device (bytes): parameters, gradients and optimizer state divided as
:func:`sftctl.compiler.layouts.memory.sharded_state` divides them, the one place the layout
search (:mod:`sftctl.compiler.layouts`) divides them too::

    activations A   = max(0, transient_peak - grad_bytes)     # the liveness peak less the gradients
    ddp             = params + grads + opt_state + batch + A + reserve          (the liveness peak;
                      prepare() sets gradient_as_bucket_view, so DDP's buckets hold the gradients)
    fsdp            = (params + grads + opt_state) / world + batch + A + reserve
                      + 2 * U * param_dtype_bytes      # the gathered unit and the prefetched next one
                      + U * reduce_dtype_bytes         # a unit's gradients before reduce-scatter
    checkpointing   : A -> A * min(1, 2 / L)           # one block's activations being recomputed,
                                                       # plus the saved block inputs (at most as much)

``U`` is the largest FSDP unit (a block, or the root: embeddings, final norm, head) in parameters,
``L`` the number of blocks. The ``2 / L`` is a stated estimate, not a measurement: a block's saved
input (one ``[tokens, hidden]`` tensor) is a small part of what the block saves for backward.

Time per step (seconds), ``c`` the step's compute in the execution mode, forward ``F = c / 3`` and
backward ``B = 2c / 3`` (backward ~ 2x forward FLOPs; the same split as ``step.BACKWARD_SHARE``)::

    AG = sum over units u of all-gather(u * param_dtype_bytes)    # each unit's own collective,
    RS = sum over units u of reduce-scatter(u * reduce_dtype_bytes)  # paying its latency
                         (sftctl.compiler.collectives.time_s: measured alpha + bytes / beta of the
                          in-host link, hierarchical over the network across nodes)
    optimizer          : ddp pays the whole AdamW step o (every device updates every parameter);
                         fsdp pays o / world (each device updates its shard): c -> c - o (1 - 1/world)
    fsdp exposed       = AG / L' + max(0, AG - F)                            # forward
                       + RS / L' + max(0, AG + RS - B')                      # backward
    ddp  exposed       = the gradient all-reduce not hidden behind backward (step.predict)
    checkpointing      : B' = B + F (forward recomputed in backward), step time + F

``L' = L + 1`` units (blocks and root). Overlap assumption: FSDP overlaps each unit's collectives
with the previous unit's compute (all-gathers run on their own CUDA stream; forward prefetch of
the next unit, backward prefetch of the previous unit's all-gather before the current unit's
reduce-scatter: Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
VLDB 2023, sections 3.3 and 6.2; FSDP2's ``fully_shard`` docs: implicit forward prefetch, explicit
backward prefetch of one unit by default), so only the first unit's all-gather and the last unit's
reduce-scatter are exposed, plus whatever communication exceeds the compute it hides behind,
plus the contention of the overlapped part (:func:`fsdp_contention_s`: NCCL's SMs lost to the
compute kernels while the collectives run, as DDP's overlapped all-reduce pays it)::

    fsdp contention    = (min(AG (1 - 1/L'), F) + min(AG + RS (1 - 1/L'), B')) x (slowdown - 1)
"""

from __future__ import annotations

import dataclasses

from sftctl.compiler.step import DEFAULT_INTER_NODE_BYTES_PER_S, overlap_slowdown, predict
from sftctl.compiler.target import Target

PARALLELISMS = ("ddp", "fsdp")
REDUCE_DTYPE_BYTES = 4  # gradients reduce-scattered in float32 (prepare's MixedPrecisionPolicy)
FORWARD_SHARE = 1 / 3


def fsdp_collective_bytes(units: dict[str, int], param_dtype_bytes: int,
                          reduce_dtype_bytes: int = REDUCE_DTYPE_BYTES) -> tuple[list[int], list[int]]:
    """The buffers of FSDP's collectives, one per unit and direction: ``(all-gather bytes,
    reduce-scatter bytes)`` per device, each a list in ``units``' order (``units``: unit name ->
    parameters). A unit's all-gather moves its parameters in the gather dtype
    (``param_dtype_bytes``: 2 under bf16/fp16 mixed precision, 4 in float32), its reduce-scatter
    its gradients in the reduce dtype (``reduce_dtype_bytes``: torch's
    ``MixedPrecisionPolicy.reduce_dtype`` / FSDP1's ``MixedPrecision.reduce_dtype``, 4 for float32,
    2 for bf16). Raises ValueError for a dtype size other than 1, 2, 4 or 8 bytes."""
    for name, b in (("param_dtype_bytes", param_dtype_bytes), ("reduce_dtype_bytes", reduce_dtype_bytes)):
        if b not in (1, 2, 4, 8):
            raise ValueError(f"{name} must be 1, 2, 4 or 8 (bytes of the dtype), not {b!r}")
    return ([int(u) * param_dtype_bytes for u in units.values()],
            [int(u) * reduce_dtype_bytes for u in units.values()])



def fsdp_contention_s(ag: float, rs: float, units: int, forward_s: float, backward_s: float,
                      slowdown: float) -> float:
    """Seconds FSDP's overlapped collectives take from the compute they run beside.

    The prefetched all-gathers (``ag`` seconds in all, one per unit and direction) run beside
    forward, all but the first unit's (``ag (1 - 1/units)``, at most ``forward_s``); in backward
    the all-gathers and all the reduce-scatters but the last unit's (``ag + rs (1 - 1/units)``, at
    most ``backward_s``). While they run, NCCL's :data:`sftctl.compiler.step.NCCL_OVERLAP_SMS` SMs
    are lost to the compute kernels, which run ``slowdown`` (>= 1,
    :func:`sftctl.compiler.step.overlap_slowdown`: a GEMM's waves over the remaining SMs) times
    longer: the same contention DDP's overlapped all-reduce pays
    (:func:`sftctl.compiler.step.ddp_allreduce_exposed_s`), here over most of the step. Zhao et
    al., "PyTorch FSDP", VLDB 2023, section 6.2 (the all-gathers and reduce-scatters overlap compute
    on their own streams, sharing the SMs). 0 without collectives. Seconds in, seconds out."""
    if units < 1 or slowdown <= 1.0 or (ag <= 0 and rs <= 0):
        return 0.0
    overlapped = (min(ag * (1 - 1 / units), max(0.0, forward_s))
                  + min(ag + rs * (1 - 1 / units), max(0.0, backward_s)))
    return overlapped * (slowdown - 1.0)


@dataclasses.dataclass(frozen=True)
class StrategyPrediction:
    """One strategy's predicted step on an offering. Bytes per device, seconds per step."""

    parallelism: str  # "ddp" | "fsdp"
    activation_checkpointing: bool
    world_size: int
    compute_time_s: float  # including recomputation under activation checkpointing
    comm_time_s: float  # exposed communication (all-reduce, or all-gathers + reduce-scatters)
    step_time_s: float
    memory_bytes: int  # peak per device
    memory_capacity_bytes: int
    breakdown: dict  # bytes by kind per device: params, grads, opt_state, activations, gather, batch, reserve

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_capacity_bytes

    @property
    def label(self) -> str:
        return self.parallelism + (" + activation checkpointing" if self.activation_checkpointing else "")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"fits": self.fits}


def predict_strategies(compiled, target: Target, gpus_per_node: int, nodes: int, intra_node_bytes_per_s: float | None,
                       inter_node_bytes_per_s: float | None, mode: str = "sftensor", param_dtype_bytes: int = 4,
                       parallelisms: tuple[str, ...] = PARALLELISMS,
                       checkpointing: tuple[bool, ...] = (False, True),
                       provider: str | None = None,
                       reduce_dtype_bytes: int = REDUCE_DTYPE_BYTES) -> list[StrategyPrediction]:
    """Every (parallelism, activation checkpointing) pair of ``compiled`` (a
    :class:`sftctl.compiler.step.CompiledStep` for one rank's share of the batch) on the offering.

    Args:
        target: the accelerator (``target.hw.memory_bytes`` is the capacity), its coefficients.
        intra_node_bytes_per_s / inter_node_bytes_per_s: the offering's links (None: the defaults
            of :mod:`sftctl.compiler.step`); inter-node is per node and divided over its GPUs.
        param_dtype_bytes: bytes of the dtype parameters are gathered in (2 under bf16/fp16 mixed
            precision, 4 in float32).
        reduce_dtype_bytes: bytes of the dtype FSDP reduce-scatters gradients in (the job's
            ``reduce_dtype``: 4 for float32, as :func:`sftctl.train.prepare` runs; 2 for bf16).
    Raises:
        ValueError: a dtype size other than 1, 2, 4 or 8.
    Returns:
        predictions in the order asked (ddp first), see the module docstring for the arithmetic.
    """
    from sftctl.compiler.collectives import time_s as collective_s
    from sftctl.compiler.layouts.memory import sharded_state

    world = gpus_per_node * nodes
    inter = inter_node_bytes_per_s or DEFAULT_INTER_NODE_BYTES_PER_S
    ddp = predict(compiled, target, gpus_per_node, nodes, intra_node_bytes_per_s, inter_node_bytes_per_s, mode=mode,
                  provider=provider)

    def coll(op: str, nbytes: float) -> float:
        return collective_s(op, nbytes, target.name, gpus_per_node, nodes, intra_node_bytes_per_s, inter, provider)
    pm = compiled.modes[mode]["peak_memory"] if mode in compiled.modes else compiled.peak_memory
    params, opt, batch = pm["params_bytes"], pm["opt_state_bytes"], pm["batch_bytes"]
    reserve, grads = pm["reserve_bytes"], compiled.grad_bytes
    acts = max(0, pm["transient_peak_bytes"] - grads)
    # a foreach optimizer's temporaries (memory.peak_memory): one per parameter of the rank's shard
    foreach = max(0, pm.get("optimizer_transient_bytes", 0) - grads)
    units = dict(getattr(compiled, "param_units", None) or {})
    n_params = grads // 4
    if not units:  # a step compiled before units were recorded: one unit, the worst case
        units = {"": n_params}
    blocks = max(1, sum(1 for k in units if k))
    largest_unit = max(units.values())
    compute = ddp.compute_time_s
    fwd = compute * FORWARD_SHARE
    # the optimizer step: DDP updates every parameter on every device, FSDP each device its shard
    optimizer = float((compiled.modes.get(mode) or {}).get("by_phase", {}).get("optimizer", 0.0))
    # FSDP's collectives, one per unit and direction, each paying its latency
    ag_bytes, rs_bytes = fsdp_collective_bytes(units, param_dtype_bytes, reduce_dtype_bytes)
    ag = sum(coll("all-gather", b) for b in ag_bytes) if world > 1 else 0.0
    rs = sum(coll("reduce-scatter", b) for b in rs_bytes) if world > 1 else 0.0
    slowdown = overlap_slowdown(compiled.kernels, target.hw.sm_count) if world > 1 and "fsdp" in parallelisms else 1.0
    out = []
    for par in parallelisms:
        for ckpt in checkpointing:
            a = int(acts * min(1.0, 2.0 / blocks)) if ckpt else acts
            recompute = fwd if ckpt else 0.0
            base = compute
            st = sharded_state(params, grads, opt, par, world, unit_params=largest_unit,
                               gather_bytes=param_dtype_bytes, reduce_bytes=reduce_dtype_bytes)
            mem = {"params": int(st["weights"]), "grads": int(st["grads"]), "opt_state": int(st["optimizer"]),
                   "activations": a, "gather": int(st["gather"])}
            if par == "ddp":
                comm = ddp.allreduce_time_s
            else:
                base = compute - optimizer * (1 - 1 / world)
                n_units = len(units) if len(units) > 1 else 1
                bwd = compute - fwd + recompute
                comm = (ag / n_units + max(0.0, ag * (1 - 1 / n_units) - fwd)
                        + rs / n_units + max(0.0, ag + rs * (1 - 1 / n_units) - bwd)) if world > 1 else 0.0
                comm += fsdp_contention_s(ag, rs, n_units, fwd, bwd, slowdown)
            # the optimizer's step peaks with its temporaries where they outweigh the activations
            opt_temp = foreach / (world if par == "fsdp" else 1)
            mem |= {"optimizer_temporaries": int(max(0.0, opt_temp - a)), "batch": batch, "reserve": reserve}
            out.append(StrategyPrediction(
                parallelism=par, activation_checkpointing=ckpt, world_size=world,
                compute_time_s=base + recompute, comm_time_s=comm, step_time_s=base + recompute + comm,
                memory_bytes=int(sum(mem.values())), memory_capacity_bytes=int(target.hw.memory_bytes), breakdown=mem,
            ))
    return out


#: A strategy other than plain DDP replaces a DDP that fits only when it is predicted faster by
#: more than this fraction of DDP's step. Our policy, not a measurement: a gain inside the model's
#: own error (a few per cent at best, calibrations/accuracy) is no gain, and sharding or
#: recomputation adds collectives, sharded checkpoints and a resume that must reshard.
SWITCH_MARGIN = 0.05


def choose(predictions: list[StrategyPrediction]) -> tuple[StrategyPrediction, str]:
    """The fastest strategy that fits, else the one with the least memory; and why, in one line.
    Plain DDP (no activation checkpointing) is kept while it fits unless another strategy is
    predicted faster by more than :data:`SWITCH_MARGIN` of its step (ties: the listed order, DDP
    and no checkpointing first).

    Returns:
        (the strategy, the reason).
    """
    gib = 2**30
    fitting = [p for p in predictions if p.fits]
    plain = next((p for p in predictions if p.parallelism == "ddp" and not p.activation_checkpointing), None)
    if not fitting:
        best = min(predictions, key=lambda p: p.memory_bytes)
        return best, (f"nothing fits: {best.label} needs {best.memory_bytes / gib:.1f} GiB per device "
                      f"of {best.memory_capacity_bytes / gib:.0f} GiB")
    best = min(fitting, key=lambda p: p.step_time_s)
    if plain is not None and plain.fits and best.step_time_s >= plain.step_time_s * (1 - SWITCH_MARGIN):
        best = plain
    if plain is not None and best is plain:
        return best, f"ddp fits ({best.memory_bytes / gib:.1f} of {best.memory_capacity_bytes / gib:.0f} GiB per device)"
    why = f"{best.label}: {best.memory_bytes / gib:.1f} of {best.memory_capacity_bytes / gib:.0f} GiB per device"
    if plain is not None and not plain.fits:
        why += f"; ddp would need {plain.memory_bytes / gib:.1f} GiB"
    elif plain is not None:
        why += f", {best.step_time_s * 1e3:.1f} vs ddp's {plain.step_time_s * 1e3:.1f} ms/step"
    return best, why
