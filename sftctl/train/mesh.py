"""The planned parallel layout (issue 38) read from the environment, and the torch ``DeviceMesh``
that realises it.

The controller exports the plan's layout to every node (:func:`sftctl.compiler.layouts.offering.
launch_env`): ``SFTCTL_TP``, ``SFTCTL_PP``, ``SFTCTL_CP``, ``SFTCTL_EP``, ``SFTCTL_DP`` (degrees),
``SFTCTL_DP_SHARDING`` (ddp, zero1, fsdp), ``SFTCTL_MICRO_BATCHES``, ``SFTCTL_PP_SCHEDULE``,
``SFTCTL_PP_INTERLEAVE``.
:func:`layout` reads them; :func:`build_mesh` makes the 4-D mesh ``("pp", "dp", "cp", "tp")``
(outermost first, so tensor-parallel ranks are neighbours, inside one node; size-1 dimensions are
kept so every dimension can be sliced by name). Expert parallelism borrows ranks from the data
(and context) dimension, as torchtitan does: ``ep`` must divide ``dp * cp``.
"""

from __future__ import annotations

from typing import Any, Mapping

from sftctl import settings
from sftctl.types.layout import Layout

MESH_DIMS = ("pp", "dp", "cp", "tp")


def layout(environ: Mapping[str, str] | None = None) -> Layout:
    """The planned :class:`~sftctl.types.layout.Layout` from ``SFTCTL_*`` (all 1 / defaults when
    unset). When ``WORLD_SIZE`` (torchrun's) names fewer or more ranks than the planned layout
    has, the layout is :meth:`~sftctl.types.layout.Layout.resized` to them: an elastic resume on
    the nodes left after a lost one could not be replaced (issue 38 item 4) runs the plan's
    layout with a smaller data (or pipeline) degree, from the last DCP checkpoint.

    Raises:
        SettingError: a malformed value (the message names the variable).
        SpecError: ``WORLD_SIZE`` ranks cannot hold the layout's tensor degree.
    """
    import os

    g = lambda name: settings.get(name, environ)  # noqa: E731
    lay = Layout(tp=int(g("SFTCTL_TP")), pp=int(g("SFTCTL_PP")), cp=int(g("SFTCTL_CP")), ep=int(g("SFTCTL_EP")),
                 dp=int(g("SFTCTL_DP")), dp_sharding=str(g("SFTCTL_DP_SHARDING")),
                 micro_batches=int(g("SFTCTL_MICRO_BATCHES")), schedule=str(g("SFTCTL_PP_SCHEDULE")),
                 interleave=int(g("SFTCTL_PP_INTERLEAVE")))
    world = (os.environ if environ is None else environ).get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 0 and int(world) != lay.world:
        lay = lay.resized(int(world))
    return lay


def device_type() -> str:
    """``cuda`` when CUDA is available, else ``cpu`` (gloo)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(lay: Layout, device: str | None = None) -> Any:
    """The ``DeviceMesh`` ``(pp, dp, cp, tp)`` over the default process group (initialized).

    Raises:
        SpecError: see :meth:`sftctl.types.layout.Layout.check`.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    lay.check(dist.get_world_size() if dist.is_initialized() else 1)
    return init_device_mesh(device or device_type(), (lay.pp, lay.dp, lay.cp, lay.tp), mesh_dim_names=MESH_DIMS)


def data_mesh(mesh: Any) -> Any:
    """The 1-D mesh over which gradients are averaged and FSDP shards: ``dp`` x ``cp`` flattened
    (every context-parallel rank holds its own part of the tokens, as a data-parallel one does)."""
    if mesh["cp"].size() == 1:
        return mesh["dp"]
    if mesh["dp"].size() == 1:
        return mesh["cp"]
    return mesh["dp", "cp"]._flatten("dp_cp")


__all__ = ["MESH_DIMS", "build_mesh", "data_mesh", "device_type", "layout"]
