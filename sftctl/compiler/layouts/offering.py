"""The layout an offering runs a traced step with: the data-parallel strategy the compiled step
chose (:mod:`sftctl.compiler.sharding`), or a model-parallel layout (:mod:`.search`) where that
does not fit or is slower by more than :data:`sftctl.compiler.sharding.SWITCH_MARGIN`.

The compiled step stays the price of plain data parallelism (its kernels are the model's own);
the layout search prices the other layouts from the step's transformer shape
(:func:`~sftctl.compiler.layouts.shape.shape_from_graph`). A step whose shape cannot be read
keeps its strategy, shown as the layout ``dpN`` (+ ``fsdp``).
"""

from __future__ import annotations

import dataclasses

from sftctl.compiler.layouts.price import LayoutPrediction, Links, _Prices, price
from sftctl.compiler.layouts.search import choose, search
from sftctl.compiler.layouts.shape import TransformerShape, shape_from_graph
from sftctl.types.layout import Layout

_SEARCHES: dict[tuple, list[LayoutPrediction]] = {}  # one search per (target, shape, links, batch)
_PRICES: dict[tuple, _Prices] = {}


def strategy_layout(parallelism: str, activation_checkpointing: bool, world: int) -> Layout:
    """The layout of a data-parallel strategy on ``world`` ranks."""
    return Layout(dp=world, dp_sharding="fsdp" if parallelism == "fsdp" and world > 1 else "ddp",
                  checkpointing=bool(activation_checkpointing))


def layout_doc(lay: Layout, source: str, **extra) -> dict:
    """The plan's ``layout`` document: the label, the :class:`~sftctl.types.layout.Layout`
    record's fields (:meth:`~sftctl.types.layout.Layout.to_dict`; ``Layout.from_dict`` reads the
    document back) and where it comes from (``strategy``: the compiled step's DDP/FSDP;
    ``search``: the layout search), with ``extra`` (the search's step time, interval, memory)."""
    return {"label": lay.label, **lay.to_dict(), "source": source, **extra}


def plan_layout(graph, target, chosen, links: Links, global_batch: int, *, model_parallel: bool = True,
                pipeline: bool = True, shape: TransformerShape | None = None) -> tuple[dict, object | None, str | None]:
    """The layout for ``chosen`` (a :class:`~sftctl.compiler.sharding.StrategyPrediction`) on
    ``links``: (the layout document, the StrategyPrediction that replaces ``chosen`` or None, the
    reason that replaces the strategy's or None). ``model_parallel``: False keeps the data-parallel
    strategy (the spec fixed ``train.parallelism``); ``pipeline`` False leaves out layouts with
    pipeline stages (``sft.prepare`` cannot apply them: the script's own loop must run the schedule,
    :func:`sftctl.train.pipeline.build_pipeline`). ``global_batch``: sequences per step.
    The strategy's own ``dpN`` layout (one micro-batch of ``global_batch / N`` sequences) is priced
    by the layout model too: the strategy fits only if that memory model agrees (one model per rank
    judges both), a layout replaces it when faster than that price by more than the margin, and the
    replacing layout's seconds are scaled by the compiled strategy's over that price (the compiled
    step's kernels calibrate the layout model to this model; ``calibration_scale`` in the document).
    """
    from sftctl.compiler.sharding import SWITCH_MARGIN, StrategyPrediction

    world = links.world
    kept = layout_doc(strategy_layout(chosen.parallelism, chosen.activation_checkpointing, world), "strategy")
    shape = shape or (shape_from_graph(graph) if graph is not None else None)
    if shape is None or not model_parallel or world <= 1:
        return kept, None, None
    key = (target.name, shape, links, int(global_batch))
    prices = _PRICES.setdefault((target.name, shape.dtype), _Prices(target, shape.dtype))
    if key not in _SEARCHES:
        _SEARCHES[key] = search(shape, target, links, int(global_batch), prices=prices)
    best, why = choose([r for r in _SEARCHES[key] if pipeline or r.layout.pp == 1])
    if best is None:
        return kept, None, None
    # the strategy priced by the layout model too (the search's own memory and time): its fit must
    # hold by both (the compiled step's liveness peak can fall where the gradients are and hide the
    # activations' peak), and the search's layouts are compared with it on one model; the compiled
    # step's time over the layout model's calibrates the layout's seconds to this model's kernels
    own = price(shape, Layout(dp=world, dp_sharding="fsdp" if chosen.parallelism == "fsdp" else "ddp",
                              micro_batch=max(1, int(global_batch) // world),
                              checkpointing=bool(chosen.activation_checkpointing)),
                target, links, prices=prices)
    if chosen.fits and own.memory_bytes > chosen.memory_capacity_bytes:
        chosen = dataclasses.replace(chosen, memory_bytes=max(chosen.memory_bytes, own.memory_bytes))
    scale = chosen.step_time_s / own.step_time_s if own.step_time_s > 0 and chosen.step_time_s > 0 else 1.0
    lay = best.layout
    data_only = lay.tp == lay.pp == lay.cp == lay.ep == 1
    if chosen.fits and (data_only or best.step_time_s >= own.step_time_s * (1 - SWITCH_MARGIN)):
        return kept, None, None
    if not best.fits:
        return layout_doc(lay, "search", fits=False, memory_bytes=best.memory_bytes), None, None
    step = best.step_time_s * scale
    replaced = StrategyPrediction(
        parallelism="fsdp" if lay.dp_sharding != "ddp" else "ddp", activation_checkpointing=lay.checkpointing,
        world_size=world, compute_time_s=(best.compute_time_s + best.bubble_time_s) * scale,
        comm_time_s=best.comm_time_s * scale, step_time_s=step, memory_bytes=best.memory_bytes,
        memory_capacity_bytes=best.memory_capacity_bytes, breakdown=dict(best.memory))
    gib = 2**30
    why += (f"; {chosen.label} would need {chosen.memory_bytes / gib:.1f} GiB" if not chosen.fits
            else f"; {chosen.label} {chosen.step_time_s:.3g} s/step")
    lo, hi = best.step_time_interval_s
    return layout_doc(lay, "search", step_time_s=step, step_time_interval_s=[lo * scale, hi * scale],
                      layout_model_step_time_s=best.step_time_s, calibration_scale=scale,
                      bubble_fraction=best.bubble_fraction, comm=dict(best.comm), memory=dict(best.memory)), \
        replaced, why


def launch_env(layout: dict | Layout | None, world: int | None = None) -> dict[str, str]:
    """The node environment that realises a plan's ``layout`` (its document or the record); {}
    without one: ``SFTCTL_TP``, ``SFTCTL_PP``, ``SFTCTL_CP``, ``SFTCTL_EP``, ``SFTCTL_DP``
    (degrees), ``SFTCTL_DP_SHARDING`` (ddp, zero1, fsdp), ``SFTCTL_MICRO_BATCHES``,
    ``SFTCTL_PP_SCHEDULE`` (1f1b, interleaved), ``SFTCTL_PP_INTERLEAVE`` (:mod:`sftctl.settings`
    declares them; the controller exports them to every node, ``run --dry-run`` shows them in
    node 0's env). ``world``: the ranks the job runs on now; fewer than the layout's (an elastic
    resume after a lost node could not be replaced) export :meth:`~sftctl.types.layout.Layout.
    resized` to them.

    Raises:
        SpecError: ``world`` cannot hold the layout's tensor degree (see ``Layout.resized``).
    """
    from sftctl import settings

    if not layout:
        return {}
    lay = layout if isinstance(layout, Layout) else Layout.from_dict(layout)
    if world is not None and world != lay.world:
        lay = lay.resized(world)
    return settings.node_env(tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep, dp=lay.dp, dp_sharding=lay.dp_sharding,
                             micro_batches=lay.micro_batches, pp_schedule=lay.schedule, pp_interleave=lay.interleave)


__all__ = ["launch_env", "layout_doc", "plan_layout", "strategy_layout"]
