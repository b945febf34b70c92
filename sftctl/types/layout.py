"""The parallel layout (issue 38): one record the planner prices (:mod:`sftctl.compiler.layouts`),
the plan's ``--json`` carries (its ``layout`` document is :meth:`Layout.to_dict` plus the label and
where it came from), the launch exports (``SFTCTL_TP`` ... :func:`sftctl.compiler.layouts.offering.
launch_env`) and training applies (:mod:`sftctl.train.mesh`, :mod:`sftctl.train.parallel`,
:mod:`sftctl.train.pipeline`).

Degrees are named as torchtitan's ``ParallelDims`` names them (``tp``, ``pp``, ``cp``, ``ep``) with
the data dimension as one degree ``dp`` and its sharding ``dp_sharding``: ``ddp`` (replicated:
torchtitan's ``dp_replicate = dp``), ``zero1`` (optimizer state sharded) or ``fsdp`` (ZeRO-3:
torchtitan's ``dp_shard = dp``); :attr:`Layout.dp_shard` and :attr:`Layout.dp_replicate` give
torchtitan's two degrees. Ranks: ``tp * pp * cp * dp`` (ordered ``pp, dp, cp, tp``, outermost
first); expert parallelism borrows ranks from ``dp * cp``, as in torchtitan and Megatron-Core.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sftctl.types.record import Record

#: the data dimension's shardings: replicated (DDP), optimizer state sharded (ZeRO-1), everything
#: sharded (FSDP / ZeRO-3)
DP_SHARDINGS = ("ddp", "zero1", "fsdp")
#: pipeline schedules: one-forward-one-backward, and its interleaved form (Narayanan et al. 2021)
SCHEDULES = ("1f1b", "interleaved")
#: keys an older plan document used for a field, read as the field (a plan kept in state before
#: the two Layout records became one still launches)
_ALIASES = {"sharding": "dp_sharding", "activation_checkpointing": "checkpointing"}


@dataclasses.dataclass(frozen=True)
class Layout(Record):
    """Degrees of each parallel dimension (1: not split that way; ``tp * pp * cp * dp`` ranks,
    ``ep`` divides ``dp * cp``), the data dimension's sharding ``dp_sharding`` (one of
    :data:`DP_SHARDINGS`), ``micro_batch`` sequences per micro-batch and ``micro_batches`` per step
    per data-parallel rank, activation ``checkpointing``, the pipeline ``schedule`` (one of
    :data:`SCHEDULES`) with ``interleave`` model chunks per pipeline rank (interleaved only), and
    ``sequence_parallel`` (with tensor parallelism; priced only, training does not apply it).

    Raises:
        ValueError: a degree, micro-batch or interleave below 1, an unknown sharding or schedule
            (the message names the field).
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    dp_sharding: str = "ddp"
    micro_batch: int = 1
    micro_batches: int = 1
    checkpointing: bool = False
    schedule: str = "1f1b"
    interleave: int = 1
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "cp", "ep", "dp", "micro_batch", "micro_batches", "interleave"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"Layout.{f} must be >= 1, got {getattr(self, f)}")
        if self.dp_sharding not in DP_SHARDINGS:
            raise ValueError(f"Layout.dp_sharding must be one of {', '.join(DP_SHARDINGS)}, got {self.dp_sharding!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Layout.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Layout":
        """Read :meth:`to_dict` (or a plan's ``layout`` document: unknown keys such as ``label``
        and ``source`` ignored; an older document's ``sharding`` / ``activation_checkpointing``
        read as ``dp_sharding`` / ``checkpointing``)."""
        data = {**{_ALIASES[k]: v for k, v in data.items() if k in _ALIASES}, **data}
        return super().from_dict(data)

    @property
    def world(self) -> int:
        """Ranks the layout needs: ``tp * pp * cp * dp`` (``ep`` reuses data/context ranks)."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (``v``): ``interleave`` under the interleaved schedule
        with ``pp > 1``, else 1."""
        return self.interleave if self.schedule == "interleaved" and self.pp > 1 else 1

    @property
    def global_batch(self) -> int:
        """Sequences per step: ``dp * micro_batch * micro_batches``."""
        return self.dp * self.micro_batch * self.micro_batches

    @property
    def dp_shard(self) -> int:
        """torchtitan's ``dp_shard`` degree: ``dp`` under ``fsdp``, else 1."""
        return self.dp if self.dp_sharding == "fsdp" else 1

    @property
    def dp_replicate(self) -> int:
        """torchtitan's ``dp_replicate`` degree: ``dp`` under ``ddp`` / ``zero1``, else 1."""
        return 1 if self.dp_sharding == "fsdp" else self.dp

    @property
    def label(self) -> str:
        """As the plan's LAYOUT column writes it: degrees above 1, ``dp`` always, the sharding
        unless ``ddp``: ``tp8 pp4 dp2 fsdp``; ``pp4v2``: interleaved, 2 chunks per rank."""
        parts = [f"tp{self.tp}"] if self.tp > 1 else []
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + (f"v{self.chunks}" if self.chunks > 1 else ""))
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts.append(f"dp{self.dp}")
        if self.dp_sharding != "ddp":
            parts.append(self.dp_sharding)
        return " ".join(parts)

    def check(self, world: int) -> None:
        """Raise SpecError when the layout does not fill ``world`` ranks exactly or ``ep`` does
        not divide ``dp * cp``; each message names the setting and a fix."""
        from sftctl.errors import SpecError

        if self.world != world:
            raise SpecError(f"layout {self.label}: SFTCTL_PP*SFTCTL_DP*SFTCTL_CP*SFTCTL_TP = {self.world}, "
                            f"but the process group has {world} ranks",
                            hint="launch pp*dp*cp*tp processes (torchrun --nproc-per-node x nodes), or re-plan")
        if (self.dp * self.cp) % self.ep:
            raise SpecError(f"layout {self.label}: SFTCTL_EP={self.ep} does not divide dp*cp={self.dp * self.cp} "
                            "(expert parallelism borrows data/context ranks)", hint="choose ep dividing dp*cp")

    def resized(self, world: int) -> "Layout":
        """This layout on ``world`` ranks, as an elastic resume runs it when a lost node could
        not be replaced (issue 38 item 4): the data degree takes up the change (``dp = world /
        (tp * pp * cp)``), each data rank then running ``micro_batch * dp / new dp`` sequences
        per micro-batch so the global batch stays (rounded up when it does not divide); when
        ``tp * pp * cp`` does not divide ``world``, the pipeline degree shrinks to the largest
        divisor of ``pp`` that fits (stages merge; the DCP checkpoint reshards), then the
        context degree. ``ep`` becomes the largest divisor of itself dividing the new
        ``dp * cp``. The same layout when ``world`` is its own.

        Raises:
            SpecError: no layout keeping ``tp`` fits ``world`` ranks (the message names both).
        """
        from math import gcd

        from sftctl.errors import SpecError

        if world == self.world:
            return self
        for pp in [p for p in range(self.pp, 0, -1) if self.pp % p == 0]:
            for cp in [c for c in range(self.cp, 0, -1) if self.cp % c == 0]:
                if world % (self.tp * pp * cp) == 0:
                    dp = world // (self.tp * pp * cp)
                    micro = max(1, -(-self.micro_batch * self.dp // dp))
                    return dataclasses.replace(self, pp=pp, cp=cp, dp=dp, ep=gcd(self.ep, dp * cp),
                                               micro_batch=micro, micro_batches=max(self.micro_batches, pp),
                                               dp_sharding=self.dp_sharding if dp * cp > 1 else "ddp")
        raise SpecError(f"layout {self.label}: {world} ranks cannot hold its tensor degree tp{self.tp} "
                        "(an elastic resume keeps tp)",
                        hint=f"set recovery.min_nodes so at least {self.tp} ranks remain, or re-plan")


__all__ = ["DP_SHARDINGS", "Layout", "SCHEDULES"]
