"""Every parallel layout of a model on an offering, priced; the one to run.

The space (:func:`layouts`): tensor degree a divisor of the GPUs per node that divides the heads
(tensor parallelism stays inside the NVLink domain, as Megatron-LM's guidance has it: Narayanan
et al. 2021, takeaway #1), pipeline degree a divisor of the blocks, context degree 2-8 only for
sequences of at least :data:`CONTEXT_MIN_TOKENS`, expert degree a divisor of the experts and of
``dp * cp``, the data dimension plain, ZeRO-1 or FSDP, micro-batch sizes 1..8 that divide each
data rank's share of the global batch, activation checkpointing or not, and for ``pp > 1`` the
1F1B or the interleaved schedule (2 or 4 chunks per stage, ``m`` a multiple of ``pp`` as
Megatron-LM requires).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from sftctl.compiler.layouts.memory import TORCH_AMP, Precision
from sftctl.compiler.layouts.price import Layout, LayoutPrediction, Links, _Prices, price
from sftctl.compiler.layouts.shape import TransformerShape

#: context parallelism is considered from this sequence length up (shorter sequences: the ring's
#: per-chunk attention is too small to hide the exchange; torchtitan and Megatron-Core apply CP
#: for long-context training)
CONTEXT_MIN_TOKENS = 8192
MICRO_BATCHES = (1, 2, 4, 8)
INTERLEAVES = (2, 4)
#: a layout with more parallel dimensions replaces a simpler one only when faster by more than
#: this share of the simpler one's step (our policy: inside the model's error it is no gain, and
#: every dimension adds process groups, checkpoint resharding and failure modes)
SIMPLER_MARGIN = 0.05  # the same margin as sftctl.compiler.sharding.SWITCH_MARGIN


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(shape: TransformerShape, links: Links, global_batch: int) -> Iterator[Layout]:
    """Every layout of ``global_batch`` sequences of ``shape`` on ``links.world`` ranks (module
    docstring); none when the batch cannot be split."""
    world, gpn = links.world, links.gpus_per_node
    tps = [t for t in _divisors(gpn) if shape.heads % t == 0 and (shape.kv_heads % t == 0 or t % shape.kv_heads == 0)]
    cps = [1] + ([c for c in (2, 4, 8) if shape.seq_len % c == 0] if shape.seq_len >= CONTEXT_MIN_TOKENS else [])
    for t in tps:
        for p in _divisors(world // t):
            if shape.layers % p:
                continue
            for c in cps:
                if (world // t // p) % c:
                    continue
                d = world // (t * p * c)
                if global_batch % d:
                    continue
                eps = [e for e in _divisors(d * c) if shape.experts and shape.experts % e == 0] or [1]
                per_rank = global_batch // d
                shardings = ("ddp", "zero1", "fsdp") if d * c > 1 else ("ddp",)
                for e in eps:
                    for mb in MICRO_BATCHES:
                        if per_rank % mb:
                            continue
                        m = per_rank // mb
                        schedules = [("1f1b", 1)]
                        if p > 1 and m % p == 0:
                            schedules += [("interleaved", v) for v in INTERLEAVES if shape.layers % (p * v) == 0]
                        for sched, v in schedules:
                            for sh in shardings:
                                for ck in (False, True):
                                    yield Layout(tp=t, pp=p, dp=d, cp=c, ep=e, dp_sharding=sh, micro_batch=mb,
                                                 micro_batches=m, checkpointing=ck, schedule=sched, interleave=v)


def search(shape: TransformerShape, target, links: Links, global_batch: int, *, attention: str = "flash",
           overlap_grad_reduce: bool = True, tp_comm_overlap: bool = True, sequence_parallel: bool = True,
           only: dict | None = None, prices: _Prices | None = None,
           precision: Precision = TORCH_AMP) -> list[LayoutPrediction]:
    """Every layout of :func:`layouts` priced (:func:`~sftctl.compiler.layouts.price.price`),
    fastest first (``attention``, ``overlap_grad_reduce``, ``tp_comm_overlap``: as ``price``;
    ``sequence_parallel``: with tensor parallelism). ``only``: keep the layouts whose attributes equal these (``{"tp": 8, "pp": 4}``);
    ``prices``: a GEMM price cache to share between searches on one target; ``precision``: the
    bytes per parameter the run keeps (:mod:`.memory`).
    """
    prices = prices or _Prices(target, shape.dtype)
    out = []
    for lay in layouts(shape, links, global_batch):
        if only and any(getattr(lay, k) != v for k, v in only.items()):
            continue
        if not sequence_parallel:
            lay = dataclasses.replace(lay, sequence_parallel=False)
        out.append(price(shape, lay, target, links, attention=attention, overlap_grad_reduce=overlap_grad_reduce,
                         tp_comm_overlap=tp_comm_overlap, prices=prices, precision=precision))
    return sorted(out, key=lambda r: r.step_time_s)


def _dims(lay: Layout) -> int:
    """How many parallel dimensions and features a layout uses (fewer is simpler)."""
    return (sum(1 for x in (lay.tp, lay.pp, lay.cp, lay.ep) if x > 1) + (lay.dp_sharding != "ddp")
            + lay.checkpointing + (lay.chunks > 1))


def choose(predictions: list[LayoutPrediction]) -> tuple[LayoutPrediction | None, str]:
    """The fastest layout that fits, preferring one with fewer dimensions within
    :data:`SIMPLER_MARGIN` of it; else (nothing fits) the one needing the least memory. With why, one line.

    Returns:
        (the prediction or None when there are none, the reason).
    """
    gib = 2**30
    if not predictions:
        return None, "no layout splits the batch over these ranks"
    fitting = [r for r in predictions if r.fits]
    if not fitting:
        best = min(predictions, key=lambda r: r.memory_bytes)
        return best, (f"nothing fits: {best.layout.label} needs {best.memory_bytes / gib:.1f} GiB per rank of "
                      f"{best.memory_capacity_bytes / gib:.0f} GiB")
    fastest = min(fitting, key=lambda r: r.step_time_s)
    near = [r for r in fitting if r.step_time_s <= fastest.step_time_s * (1 + SIMPLER_MARGIN)]
    best = min(near, key=lambda r: (_dims(r.layout), r.step_time_s))
    return best, (f"{best.layout.label}: {best.memory_bytes / gib:.1f} of {best.memory_capacity_bytes / gib:.0f} "
                  f"GiB per rank, bubble {best.bubble_fraction:.0%}, exposed comm "
                  f"{best.comm_time_s / best.step_time_s:.0%} of {best.step_time_s:.3g} s/step")
