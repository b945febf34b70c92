"""The plan's whole layout applied to the user's model (issue 38 item 3): tensor parallelism
(DTensor ``parallelize_module``), expert parallelism (all-to-all dispatch), and the data dimension
sharded with FSDP2 ``fully_shard`` over ``dp`` (x ``cp``), on the 4-D mesh of
:mod:`sftctl.train.mesh`. Pipeline stages (:mod:`sftctl.train.pipeline`) and context parallelism
(:mod:`sftctl.train.context_parallel`) are applied around it::

    from sftctl.train import mesh as M, parallel
    lay = M.layout()                       # SFTCTL_TP / PP / CP / EP / DP ...
    mesh = M.build_mesh(lay)
    model = parallel.parallelize(model, lay, mesh)   # then build the optimizer

Per-model hooks, as torchtitan's ``parallelize_*`` functions (a model that cannot be split by the
names it uses gets a SpecError naming what is missing and which hook to define):

* ``sftctl_tp_plan()`` -> ``{module path: ColwiseParallel() | RowwiseParallel()}``; default:
  Megatron pairs by name (:func:`sftctl.train.tensor_parallel.default_plan`).
* ``sftctl_blocks()`` -> the repeated blocks (FSDP units); default: ``model.layers`` (a
  ModuleDict or ModuleList) or the largest ModuleList.
* ``sftctl_pipeline_stage(stage, n_stages)`` -> the stage's module: see
  :func:`sftctl.train.pipeline.stage_module`.
* MoE layers for expert parallelism: modules with ``route``/``experts``/``dispatch``, see
  :mod:`sftctl.train.expert_parallel`.

The data dimension is always FSDP2 here, because DDP does not take DTensor (tensor-parallel)
parameters: ``SFTCTL_DP_SHARDING=fsdp`` shards parameters, gradients and optimizer state over
``dp`` x ``cp``; ``ddp`` and ``zero1`` are FSDP2's HSDP on the 2-D mesh ``(dp, cp)``, replicated
over ``dp`` as DDP holds them (sharded over ``cp`` only; zero1's optimizer-only sharding is not
done), parameters kept gathered after forward. Pure data parallelism keeps
:func:`sftctl.train.prepare`'s DDP.
"""

from __future__ import annotations

from typing import Any

from sftctl.errors import SpecError
from sftctl.train.mesh import data_mesh
from sftctl.types.layout import Layout


def model_blocks(model: Any) -> list:
    """The model's repeated blocks: ``model.sftctl_blocks()``, else ``model.layers``' entries (a
    ``ModuleDict`` or ``ModuleList``), else the largest ``ModuleList`` by parameters (as
    :func:`sftctl.train.sharded.blocks`; not imported from there: sharded imports this module)."""
    import torch.nn as nn

    hook = getattr(model, "sftctl_blocks", None)
    if callable(hook):
        return list(hook())
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    lists: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    best = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(best.children())


def parallelize(model: Any, lay: Layout, mesh: Any, *, tp_plan: dict[str, Any] | None = None) -> Any:
    """Apply ``lay``'s tensor, expert and data dimensions to ``model`` (a whole model or one
    pipeline stage) in place, on ``mesh`` (:func:`sftctl.train.mesh.build_mesh`); every rank
    must have built the same initial weights (same seed), which each dimension then shards.

    Order (torchtitan's): tensor parallel on ``mesh["tp"]``; expert parallel (each MoE layer
    keeps its ``n_experts / ep`` experts, FSDP over the ranks that hold the same experts, their
    gradients divided by the whole data world); FSDP2 ``fully_shard`` per block, then the root,
    over ``dp`` x ``cp`` (HSDP for ddp/zero1, see the module doc). Build the optimizer after it.

    Returns:
        the model (the same object).
    Raises:
        SpecError: nothing to split for tp > 1 (define ``sftctl_tp_plan``), no MoE layer for
            ep > 1, widths or experts not divisible by the degree.
    """
    from torch.distributed.fsdp import fully_shard

    if lay.tp > 1:
        from sftctl.train.tensor_parallel import apply_tensor_parallel, default_plan

        if tp_plan is None and lay.ep > 1 and not callable(getattr(model, "sftctl_tp_plan", None)):
            # experts split over ep are not also split over tp (their FSDP mesh is not the
            # tensor-parallel mesh's): each tp rank runs its experts whole
            from sftctl.train.expert_parallel import moe_layers

            inside = tuple(f"{path}.experts." for path, m in model.named_modules()
                           if any(m is moe for moe in moe_layers(model)))
            tp_plan = {k: v for k, v in default_plan(model).items() if not k.startswith(inside)}
        apply_tensor_parallel(model, lay.tp, plan=tp_plan, mesh=mesh["tp"])
    reshard = lay.dp_sharding == "fsdp"
    # fsdp: parameters sharded over dp x cp. ddp / zero1: HSDP on (dp, cp), replicated over dp
    # (as DDP holds them) and sharded over cp only, kept gathered after forward
    dmesh = data_mesh(mesh) if reshard else mesh["dp", "cp"]
    if lay.ep > 1:
        from sftctl.train.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, lay, mesh, reshard_after_forward=reshard)
    units = model_blocks(model)
    if lay.dp * lay.cp > 1 or lay.tp > 1:  # FSDP over a 1-rank data dim still hands DTensor grads to one optimizer
        for b in units:
            fully_shard(b, mesh=dmesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=dmesh, reshard_after_forward=reshard)
    return model


_MESH: dict[Layout, Any] = {}


def layout_mesh(lay: Layout | None = None) -> Any:
    """The mesh of ``lay`` (default: the planned :func:`sftctl.train.mesh.layout`), built once per
    process and reused (``prepare`` and the script's ``context_parallel`` share it)."""
    from sftctl.train.mesh import build_mesh, layout

    lay = lay or layout()
    if lay not in _MESH:
        _MESH[lay] = build_mesh(lay)
    return _MESH[lay]


def prepare_layout(model: Any, lay: Layout, loss_fn: Any = None) -> Any:
    """What :func:`sftctl.train.prepare` does when the plan's layout splits more than the data
    dimension: check the model can take ``lay`` (:func:`check_splittable`), then
    :func:`parallelize` it on :func:`layout_mesh`. Under context parallelism the script runs its
    forward inside ``context_parallel(model, layout_mesh()["cp"], seq_len=...)`` on its
    ``shard_sequence`` of the batch (:mod:`sftctl.train.context_parallel`).

    With pipeline stages (``SFTCTL_PP`` > 1) the schedule runs the forward and backward, so it
    needs the script's ``loss_fn(output, target)`` (the mean over a micro-batch): the result is
    then a :class:`sftctl.train.pipeline.Pipeline` (:func:`~sftctl.train.pipeline.build_pipeline`
    on :func:`layout_mesh`): build the optimizer on its ``module``, call ``pipe.step(inputs,
    targets)`` each step. A spec with ``train.pipeline: true`` promises the script does this.

    Raises:
        SpecError: ``SFTCTL_PP`` > 1 without ``loss_fn`` (the message names it and the spec
            field); see also :func:`check_splittable` and ``build_pipeline``.
    """
    if lay.pp > 1:
        if loss_fn is None:
            raise SpecError(f"layout {lay.label}: pipeline stages need the loss inside the schedule, and "
                            "prepare() was called without loss_fn",
                            hint="pipe = sft.prepare(model, loss_fn=loss_fn); loss = pipe.step(inputs, targets); "
                                 "or set train.pipeline: false so the planner plans pp=1")
        from sftctl.train.pipeline import build_pipeline

        check_splittable(model, lay)
        return build_pipeline(model, lay, layout_mesh(lay), loss_fn, apply=parallelize)
    check_splittable(model, lay)
    return parallelize(model, lay, layout_mesh(lay))


def check_splittable(model: Any, lay: Layout) -> None:
    """Raise SpecError, before any collective, when ``lay`` needs a split ``model`` does not
    offer: no blocks to shard or to stage, nothing tensor-parallel, no MoE layer for ep."""
    if lay.pp > 1 or lay.dp * lay.cp > 1:
        if not model_blocks(model):
            raise SpecError(f"layout {lay.label}: {type(model).__name__} has no repeated blocks "
                            "(no `layers` ModuleDict/ModuleList)",
                            hint="define model.sftctl_blocks() returning its transformer blocks")
    if lay.tp > 1:
        from sftctl.train.tensor_parallel import COLWISE, ROWWISE, default_plan

        if not callable(getattr(model, "sftctl_tp_plan", None)) and not default_plan(model):
            raise SpecError(f"layout {lay.label}: {type(model).__name__} has no Linear named as a tensor-parallel "
                            f"pair ({', '.join(COLWISE[:4])} ... / {', '.join(ROWWISE[:3])} ...)",
                            hint="define model.sftctl_tp_plan() -> {'path.to.linear': ColwiseParallel(), ...}")
    if lay.ep > 1:
        from sftctl.train.expert_parallel import moe_layers

        if not moe_layers(model):
            raise SpecError(f"layout {lay.label}: SFTCTL_EP={lay.ep} but {type(model).__name__} has no MoE layer "
                            "(a module with route(), dispatch() and an `experts` ModuleDict)",
                            hint="plan ep=1 for a dense model, or give its MoE layers that interface")


__all__ = ["check_splittable", "layout_mesh", "model_blocks", "parallelize", "prepare_layout"]
