"""Pipeline parallelism (issue 38 item 3): the plan's ``SFTCTL_PP`` stages cut from the user's
model and run by ``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B``,
Narayanan et al. 2021's one-forward-one-backward schedule over ``SFTCTL_MICRO_BATCHES``
micro-batches, or ``ScheduleInterleaved1F1B`` over ``SFTCTL_PP_INTERLEAVE`` chunks per rank when
``SFTCTL_PP_SCHEDULE=interleaved``), each stage's tensor/data dimensions applied by :func:`sftctl.train.parallel.
parallelize` (FSDP2 over ``dp`` x ``cp``, as torchtitan composes them)::

    lay, mesh = M.layout(), M.build_mesh(M.layout())
    pipe = build_pipeline(model, lay, mesh, loss_fn, apply=parallelize)  # loss_fn(out, target): mean loss
    opt = torch.optim.AdamW(pipe.module.parameters())
    loss = pipe.step(tokens, targets)                   # every rank; the step's mean loss on all

Cutting (:func:`stage_module`): the model's ``sftctl_pipeline_stage(stage, n_stages)`` hook when
it has one, else torchtitan's convention: ``layers`` (ModuleDict keyed by index, or ModuleList),
``tok_embeddings`` on the first stage, ``norm`` and ``output`` on the last, a forward that skips
whichever is None. Layers are split evenly, earlier stages taking the remainder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from sftctl.errors import SpecError
from sftctl.types.layout import Layout

#: the attributes a model must have to be cut into stages without a hook
STAGE_ATTRS = ("tok_embeddings", "layers", "norm", "output")


def stage_layers(n_layers: int, stage: int, n_stages: int) -> range:
    """Indices of the layers stage ``stage`` of ``n_stages`` holds (even split, the first
    ``n_layers % n_stages`` stages one more).

    Raises:
        SpecError: fewer layers than stages."""
    if n_layers < n_stages:
        raise SpecError(f"SFTCTL_PP={n_stages}: the model has {n_layers} layers, fewer than the stages",
                        hint="plan fewer pipeline stages")
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def stage_module(model: Any, stage: int, n_stages: int) -> Any:
    """``model`` cut to pipeline stage ``stage`` of ``n_stages`` in place (the other stages'
    layers deleted; embeddings kept on the first stage, final norm and output on the last).

    Raises:
        SpecError: the model has no ``sftctl_pipeline_stage`` hook and lacks one of
            :data:`STAGE_ATTRS` (the message names which).
    """
    import torch.nn as nn

    hook = getattr(model, "sftctl_pipeline_stage", None)
    if callable(hook):
        return hook(stage, n_stages)
    missing = [a for a in STAGE_ATTRS if not hasattr(model, a)]
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        missing.append("layers as an nn.ModuleDict / nn.ModuleList")
    if missing:
        raise SpecError(f"SFTCTL_PP={n_stages}: {type(model).__name__} cannot be cut into pipeline stages: "
                        f"it has no {', '.join(dict.fromkeys(missing))}",
                        hint="define model.sftctl_pipeline_stage(stage, n_stages) returning the stage's module "
                             "(torchtitan's pipeline_llama does the same), or plan pp=1")
    assert layers is not None
    keep = stage_layers(len(layers), stage, n_stages)
    if isinstance(layers, nn.ModuleDict):
        for i, key in enumerate(list(layers.keys())):
            if i not in keep:
                del layers[key]
    else:  # a ModuleList: keys renumber, so DCP names differ per layout (use a ModuleDict to resume across)
        model.layers = nn.ModuleList([m for i, m in enumerate(layers) if i in keep])
    if stage > 0:
        model.tok_embeddings = None
    if stage < n_stages - 1:
        model.norm = None
        model.output = None
    return model


@dataclass
class Pipeline:
    """A built pipeline: ``module`` (this rank's stage, sharded; under the interleaved schedule an
    ``nn.ModuleList`` of its chunks, so its state-dict names differ from the whole model's), the
    torch ``stage`` (a list of them when interleaved) and ``schedule``, ``first``/``last`` (is this rank's stage first / last), ``group`` (pp)."""

    module: Any
    stage: Any
    schedule: Any
    first: bool
    last: bool
    group: Any

    def step(self, inputs: Any, targets: Any) -> float:
        """One training step's forward and backward over the micro-batches (the caller steps
        the optimizer). ``inputs`` / ``targets``: this data rank's batch (split into micro-batches
        along dim 0; every rank passes them, each stage uses what it needs).

        Returns:
            the mean of the micro-batches' losses, on every rank of the pipeline (the last stage
            broadcasts it), a Python float."""
        import torch
        import torch.distributed as dist

        losses: list = []
        # return_outputs=False: the last stage would otherwise keep every micro-batch's output
        # (the logits: m x micro-batch x seq x vocab, ~134 GB at m=64 with a 128k vocabulary)
        if self.first and self.last:
            self.schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
        elif self.first:
            self.schedule.step(inputs, return_outputs=False)
        elif self.last:
            self.schedule.step(target=targets, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        mean = torch.stack([x.detach() for x in losses]).mean().reshape(1) if losses else \
            torch.zeros(1, dtype=torch.float64)
        mean = mean.to(torch.float64)
        last_rank = dist.get_global_rank(self.group, dist.get_world_size(self.group) - 1)
        dist.broadcast(mean, src=last_rank, group=self.group)
        return float(mean)


def build_pipeline(model: Any, lay: Layout, mesh: Any, loss_fn: Callable[[Any, Any], Any], *,
                   apply: Callable[..., Any], tp_plan: dict[str, Any] | None = None) -> Pipeline:
    """Cut ``model`` to this rank's stage (``mesh["pp"]``'s coordinate), apply ``lay``'s tensor/
    data dimensions to it and wrap it in a ``PipelineStage`` and the 1F1B schedule over
    ``lay.micro_batches`` micro-batches; with ``lay.schedule == "interleaved"`` and
    ``lay.interleave`` = v > 1, the model is cut into ``pp * v`` stages, rank r holding stages
    r, r + pp, ... (ScheduleInterleaved1F1B). ``loss_fn(output, target)`` must average over its
    micro-batch (the schedule then divides the gradients by the micro-batch count, so a step's
    gradient is that of the mean over the batch). ``apply(stage, lay, mesh, tp_plan=)`` applies the
    tensor/data dimensions to a stage: :func:`sftctl.train.parallel.parallelize`, passed in because
    that module's ``prepare`` calls this one.

    Raises:
        SpecError: see :func:`stage_module`; fewer micro-batches than stages (1F1B needs
            ``micro_batches >= pp``).
    """
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    if lay.micro_batches < lay.pp:
        raise SpecError(f"layout {lay.label}: SFTCTL_MICRO_BATCHES={lay.micro_batches} is fewer than the "
                        f"{lay.pp} pipeline stages (1F1B needs at least one micro-batch per stage)",
                        hint=f"set SFTCTL_MICRO_BATCHES>={lay.pp}")
    pp_mesh = mesh["pp"]
    rank = pp_mesh.get_local_rank()
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
        else torch.device("cpu")
    group = pp_mesh.get_group()
    if lay.schedule == "interleaved" and lay.interleave > 1:
        # Narayanan et al. 2021 section 2.2: rank r holds chunks r, r + pp, ... of pp * v stages
        import copy

        import torch.nn as nn
        from torch.distributed.pipelining import ScheduleInterleaved1F1B

        n = lay.pp * lay.interleave
        chunks = [stage_module(copy.deepcopy(model) if j < lay.interleave - 1 else model, rank + j * lay.pp, n)
                  for j in range(lay.interleave)]
        stages = []
        for j, chunk in enumerate(chunks):
            apply(chunk, lay, mesh, tp_plan=tp_plan)
            stages.append(PipelineStage(chunk, rank + j * lay.pp, n, device, group=group))
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=lay.micro_batches, loss_fn=loss_fn)
        return Pipeline(nn.ModuleList(chunks), stages, schedule, rank == 0, rank == lay.pp - 1, group)
    if lay.schedule != "1f1b":
        raise SpecError(f"layout {lay.label}: SFTCTL_PP_SCHEDULE={lay.schedule} with SFTCTL_PP_INTERLEAVE="
                        f"{lay.interleave}: an interleaved schedule needs 2 or more chunks per rank",
                        hint="set SFTCTL_PP_INTERLEAVE>=2, or SFTCTL_PP_SCHEDULE=1f1b")
    module = stage_module(model, rank, lay.pp)
    apply(module, lay, mesh, tp_plan=tp_plan)
    stage = PipelineStage(module, rank, lay.pp, device, group=group)
    schedule = Schedule1F1B(stage, n_microbatches=lay.micro_batches, loss_fn=loss_fn)
    return Pipeline(module, stage, schedule, rank == 0, rank == lay.pp - 1, group)


__all__ = ["Pipeline", "STAGE_ATTRS", "build_pipeline", "stage_layers", "stage_module"]
