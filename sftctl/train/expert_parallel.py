"""Expert parallelism (issue 38 item 3): each of the plan's ``SFTCTL_EP`` ranks keeps ``n_experts /
ep`` of every MoE layer's experts, and tokens travel to their experts' rank and back by all-to-all
(GShard, Lepikhin et al. 2020; ``torch.distributed.nn.functional.all_to_all_single``, which gloo
runs with uneven splits and which is differentiable: its backward is the reverse all-to-all).

Expert parallelism borrows ranks from the data dimension (torchtitan's): the ``dp * cp`` data
ranks, each with its own tokens, form groups of ``ep`` consecutive ranks that together hold all
experts; the ranks holding the same experts (``edp = dp * cp / ep`` of them) shard those experts
with FSDP2 (which averages over edp). Each expert's gradient sums the tokens of its ``ep`` group,
so the dispatch scales it by ``1 / ep`` in backward (the expert's input gradient is left whole),
making it the mean over all ``dp * cp`` data ranks as the dense gradients are. (FSDP2's
``set_gradient_divide_factor`` would do it, but torch 2.13 divides twice on a 1-rank mesh in
float64 (``_fsdp_collectives.foreach_reduce``: pre-divide, then the whole factor): measured, a
1.4e-3 loss error with ep = dp * cp.)

A MoE layer is any module with ``route(x) -> (weights [T, k], expert index [T, k])``,
``dispatch(x, idx) -> [T, k, dim]`` and an ``experts`` ``nn.ModuleDict`` keyed by global expert
index (:class:`sftctl.train.tiny.MoE`); :func:`apply_expert_parallel` drops the other ranks'
experts and replaces ``dispatch``. The router is replicated (a dense parameter).

Dropless: there is no capacity factor and no token is dropped or padded (the all-to-all carries
each rank's actual counts), so the result equals the unsplit layer's, and a step waits for the
rank whose experts receive the most tokens. The planner prices that rank
(:func:`sftctl.compiler.layouts.memory.expert_load`: the expected busiest rank's load with
``capacity_factor=None``, the default).
"""

from __future__ import annotations

from typing import Any

from sftctl.errors import SpecError
from sftctl.types.layout import Layout


def moe_layers(model: Any) -> list:
    """Modules of ``model`` with ``route``, ``dispatch`` and an ``experts`` ModuleDict."""
    import torch.nn as nn

    return [m for m in model.modules() if callable(getattr(m, "route", None)) and callable(getattr(m, "dispatch", None))
            and isinstance(getattr(m, "experts", None), nn.ModuleDict)]


def expert_mesh(lay: Layout, mesh: Any) -> Any:
    """The mesh ``("pp", "edp", "ep", "tp")`` over the same ranks as ``mesh`` (``(pp, dp, cp, tp)``):
    the data ranks ``dp * cp`` split into ``edp`` x ``ep``, ep innermost (neighbouring ranks)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    ranks = mesh.mesh.reshape(lay.pp, lay.dp * lay.cp // lay.ep, lay.ep, lay.tp)
    return DeviceMesh(mesh.device_type, torch.as_tensor(ranks), mesh_dim_names=("pp", "edp", "ep", "tp"))


def _grad_scale() -> Any:
    import torch

    class _GradScale(torch.autograd.Function):
        """Identity forward; backward multiplies the gradient by ``factor``."""

        @staticmethod
        def forward(ctx: Any, x: Any, factor: float) -> Any:
            ctx.factor = factor
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad * ctx.factor, None

    return _GradScale


def _dispatch(moe: Any, group: Any, ep: int, per_rank: int, x: Any, idx: Any) -> Any:
    """Expert parallel ``dispatch``: each (token, slot) sent to the rank of its expert
    (``expert // per_rank``), computed there, sent back. ``x`` ``[T, dim]``, ``idx`` ``[T, k]``
    int64 -> ``[T, k, dim]``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_to_all_single as a2a

    t, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, so by rank
    send_x = x[order // k]
    send_e = flat[order]
    send_counts = torch.bincount(send_e // per_rank, minlength=ep)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()
    recv_e = flat.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv_e, send_e, recv_sizes, send_sizes, group=group)
    recv_x = a2a(x.new_empty(sum(recv_sizes), x.shape[-1]), send_x, recv_sizes, send_sizes, group=group)
    y = recv_x.new_zeros(recv_x.shape)
    scale = _grad_scale()
    for e, expert in moe.experts.items():
        rows = (recv_e == int(e)).nonzero(as_tuple=True)[0]
        if rows.numel():
            # the expert's parameter gradient / ep, its input's gradient unchanged (x ep, then / ep)
            y = y.index_put((rows,), scale.apply(expert(scale.apply(recv_x[rows], float(ep))), 1.0 / ep))
    back = a2a(x.new_empty(t * k, x.shape[-1]), y, send_sizes, recv_sizes, group=group)
    return back.new_zeros(t * k, x.shape[-1]).index_put((order,), back).view(t, k, -1)


def apply_expert_parallel(model: Any, lay: Layout, mesh: Any, *, reshard_after_forward: bool = True) -> list:
    """Split every MoE layer of ``model`` over ``lay.ep`` ranks in place (see the module doc);
    call it before the model's other FSDP wrapping (:func:`sftctl.train.parallel.parallelize`
    does). Returns the MoE layers.

    Raises:
        SpecError: no MoE layer, or a layer's expert count not divisible by ep.
    """
    from functools import partial

    from torch.distributed.fsdp import fully_shard

    layers = moe_layers(model)
    if not layers:
        raise SpecError(f"layout {lay.label}: SFTCTL_EP={lay.ep} but {type(model).__name__} has no MoE layer "
                        "(a module with route(), dispatch() and an `experts` ModuleDict)",
                        hint="plan ep=1 for a dense model, or give its MoE layers that interface")
    emesh = expert_mesh(lay, mesh)
    ep_mesh, edp_mesh = emesh["ep"], emesh["edp"]
    me = ep_mesh.get_local_rank()
    for moe in layers:
        n = len(moe.experts)
        if n % lay.ep:
            raise SpecError(f"layout {lay.label}: a MoE layer has {n} experts, not divisible by SFTCTL_EP={lay.ep}",
                            hint="choose an ep that divides the expert count")
        per_rank = n // lay.ep
        mine = {str(e) for e in range(me * per_rank, (me + 1) * per_rank)}
        for key in list(moe.experts.keys()):
            if key not in mine:
                del moe.experts[key]
        moe.dispatch = partial(_dispatch, moe, ep_mesh.get_group(), lay.ep, per_rank)
        for expert in moe.experts.values():  # fully_shard takes modules with a forward, not the ModuleDict
            fully_shard(expert, mesh=edp_mesh, reshard_after_forward=reshard_after_forward)
    return layers


__all__ = ["apply_expert_parallel", "expert_mesh", "moe_layers"]
