"""Tensor parallelism for the user's model (issue 38): the plan's ``SFTCTL_TP`` applied with torch
DTensor's ``parallelize_module`` (Megatron-LM's split, Shoeybi et al. 2019, section 3: the first
Linear of each pair column-wise, the second row-wise, so each pair needs one all-reduce forward
and one backward).

    from sftctl.train.tensor_parallel import apply_tensor_parallel, tensor_parallel_degree
    if tensor_parallel_degree() > 1:
        model = apply_tensor_parallel(model, tensor_parallel_degree())

:func:`default_plan` finds the pairs by the names models give them (Llama/Mistral ``q_proj``,
``k_proj``, ``v_proj`` / ``o_proj`` and ``gate_proj``, ``up_proj`` / ``down_proj``; GPT-2's
``c_attn`` / ``c_proj`` is a Conv1D and not split; nanoGPT/torchtitan ``w1``, ``w3`` / ``w2``;
``fc1`` / ``fc2``; ``up`` / ``down``). Attention that reshapes by a fixed head count (``view(b, s,
n_heads, d)``) must read its local head count (``n_heads // tp``) or take ``view(b, s, -1, d)``, as
torchtitan's models do; a model whose layers have other names passes its own ``plan`` (module
path -> ``ColwiseParallel()`` / ``RowwiseParallel()``), as torchtitan's ``parallelize_*``
functions do (or defines ``sftctl_tp_plan()`` returning it). :mod:`sftctl.train.parallel`
composes this with the data, pipeline, context and expert dimensions of the plan's layout.
"""

from __future__ import annotations

from typing import Any, Mapping

from sftctl import settings
from sftctl.errors import SpecError

#: child names whose Linear is split along its output features (the first of a pair)
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "fc1", "up", "query", "key", "value")
#: child names whose Linear is split along its input features (the second of a pair)
ROWWISE = ("o_proj", "down_proj", "w2", "fc2", "down", "out_proj", "dense")


def tensor_parallel_degree(environ: Mapping[str, str] | None = None) -> int:
    """The plan's tensor-parallel degree (``SFTCTL_TP``, 1 when unset).

    Raises:
        SettingError: a malformed value (exit 2).
    """
    return int(settings.get("SFTCTL_TP", environ))


def default_plan(model: Any) -> dict[str, Any]:
    """``parallelize_module``'s plan for ``model``: every ``torch.nn.Linear`` named in
    :data:`COLWISE` column-wise, in :data:`ROWWISE` row-wise (module path -> style)."""
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for path, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or not path:
            continue
        leaf = path.rsplit(".", 1)[-1]
        if leaf in COLWISE:
            plan[path] = ColwiseParallel()
        elif leaf in ROWWISE:
            plan[path] = RowwiseParallel()
    return plan


def apply_tensor_parallel(model: Any, tp: int, plan: dict[str, Any] | None = None, device_type: str | None = None,
                          mesh: Any = None):
    """``model`` split over ``tp`` ranks by ``plan`` (the model's ``sftctl_tp_plan()`` when it
    has one, else :func:`default_plan`). ``mesh``: the 1-D tensor-parallel ``DeviceMesh`` (e.g.
    ``build_mesh(layout)["tp"]`` of :mod:`sftctl.train.mesh`, composed with data/pipeline/context
    dimensions); None: the whole default process group is the tensor-parallel group.
    ``device_type``: ``cuda`` when CUDA is available, else ``cpu`` (gloo). Returns the model (its
    split parameters are DTensors).

    Raises:
        SpecError: ``tp`` is not the world size, the plan is empty (no Linear pair to split: name
            what the model calls its layers in a plan), or a split Linear's features do not
            divide by ``tp``.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    world = mesh.size() if mesh is not None else (dist.get_world_size() if dist.is_initialized() else 1)
    if tp != world:
        raise SpecError(f"SFTCTL_TP={tp}: tensor parallelism over {tp} ranks needs {tp} ranks in the process group, "
                        f"found {world}", hint="run with --nproc-per-node equal to the plan's tp, or plan tp=1")
    if plan is None:
        hook = getattr(model, "sftctl_tp_plan", None)
        plan = hook() if callable(hook) else default_plan(model)
    if not plan:
        raise SpecError(f"SFTCTL_TP={tp}: {type(model).__name__} has no Linear named as a tensor-parallel pair "
                        f"({', '.join(COLWISE[:4])} ... / {', '.join(ROWWISE[:3])} ...)",
                        hint="pass apply_tensor_parallel(model, tp, plan={'path.to.linear': ColwiseParallel(), ...})")
    modules = dict(model.named_modules())
    for path, style in plan.items():
        mod = modules.get(path)
        if mod is None:
            raise SpecError(f"tensor-parallel plan: {type(model).__name__} has no module {path!r}",
                            hint="name modules as model.named_modules() does")
        if isinstance(mod, torch.nn.Linear):
            features = mod.out_features if isinstance(style, ColwiseParallel) else mod.in_features
            if features % tp:
                raise SpecError(f"tensor-parallel plan: {path} has {features} features, not divisible by tp={tp}",
                                hint="choose a tp that divides the model's widths")
    device = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if mesh is None:
        mesh = init_device_mesh(device, (tp,), mesh_dim_names=("tp",))
    return parallelize_module(model, mesh, plan)


__all__ = ["COLWISE", "ROWWISE", "apply_tensor_parallel", "default_plan", "tensor_parallel_degree"]
