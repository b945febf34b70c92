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

from dataclasses import dataclass
from typing import Any, Mapping

from sftctl import settings
from sftctl.errors import SpecError

MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    """Degrees of each parallel dimension (1: not split that way), the data dimension's sharding,
    micro-batches per step per data-parallel rank, the pipeline schedule (``1f1b`` or
    ``interleaved``) and its model chunks per pipeline rank (``interleave``)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    dp_sharding: str = "fsdp"
    micro_batches: int = 1
    schedule: str = "1f1b"
    interleave: int = 1

    @property
    def world(self) -> int:
        """Ranks the layout needs: ``pp * dp * cp * tp`` (ep reuses data/context ranks)."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def label(self) -> str:
        """As the plan's LAYOUT column writes it, e.g. ``tp2 pp2 dp2 fsdp``."""
        parts = [f"{k}{getattr(self, k)}" for k in ("tp", "pp", "cp", "ep", "dp") if getattr(self, k) > 1]
        return " ".join(parts + [self.dp_sharding]) if parts else f"dp1 {self.dp_sharding}"

    def check(self, world: int) -> None:
        """Raises SpecError when the layout does not fill ``world`` ranks exactly, or ``ep`` does
        not divide ``dp * cp``; each message names the setting and a fix."""
        if self.world != world:
            raise SpecError(f"layout {self.label}: SFTCTL_PP*SFTCTL_DP*SFTCTL_CP*SFTCTL_TP = {self.world}, "
                            f"but the process group has {world} ranks",
                            hint="launch pp*dp*cp*tp processes (torchrun --nproc-per-node x nodes), or re-plan")
        if (self.dp * self.cp) % self.ep:
            raise SpecError(f"layout {self.label}: SFTCTL_EP={self.ep} does not divide dp*cp={self.dp * self.cp} "
                            "(expert parallelism borrows data/context ranks)", hint="choose ep dividing dp*cp")


def layout(environ: Mapping[str, str] | None = None) -> Layout:
    """The planned :class:`Layout` from ``SFTCTL_*`` (all 1 / defaults when unset).

    Raises:
        SettingError: a malformed value (the message names the variable).
    """
    g = lambda name: settings.get(name, environ)  # noqa: E731
    return Layout(tp=int(g("SFTCTL_TP")), pp=int(g("SFTCTL_PP")), cp=int(g("SFTCTL_CP")), ep=int(g("SFTCTL_EP")),
                  dp=int(g("SFTCTL_DP")), dp_sharding=str(g("SFTCTL_DP_SHARDING")),
                  micro_batches=int(g("SFTCTL_MICRO_BATCHES")), schedule=str(g("SFTCTL_PP_SCHEDULE")),
                  interleave=int(g("SFTCTL_PP_INTERLEAVE")))


def device_type() -> str:
    """``cuda`` when CUDA is available, else ``cpu`` (gloo)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(lay: Layout, device: str | None = None) -> Any:
    """The ``DeviceMesh`` ``(pp, dp, cp, tp)`` over the default process group (initialized).

    Raises:
        SpecError: see :meth:`Layout.check`.
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


__all__ = ["Layout", "MESH_DIMS", "build_mesh", "data_mesh", "device_type", "layout"]
