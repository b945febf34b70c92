"""The job's configuration as a training script reads it: :class:`TrainConfig`, :func:`config`."""

from __future__ import annotations

import dataclasses
import sys

from sftctl import settings
from sftctl.train.checkpoints import _DTYPES


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Training job settings, as given to the training script by sftctl through the environment.

    Attributes:
        steps: total optimizer steps of the job (a resumed run continues up to this number).
        batch_size: sequences per step per rank.
        checkpoint_interval: save a checkpoint every this many steps (and at the last step).
        dtype: canonical torch dtype name: "float32", "bfloat16" or "float16".
        job_id: sftctl job id, or None outside sftctl.
        node_rank: index of this node, 0-based.
        num_nodes: number of nodes in the job.
        matmul_precision: ``torch.set_float32_matmul_precision``'s setting for float32 matmuls
            (``highest``: IEEE FP32, torch's default; ``high``: TF32; ``medium``: bfloat16), from
            the job spec's ``model.matmul_precision``. :func:`config` applies it when torch is
            already imported, so the step runs at the precision the planner priced.
        grad_accum: micro-batches of ``batch_size`` each rank accumulates per optimizer step
            (``SFTCTL_GRAD_ACCUM``, default 1): more than 1 after an elastic resume on fewer
            nodes than planned, so the global batch stays the same.
    """

    steps: int
    batch_size: int
    checkpoint_interval: int
    dtype: str
    job_id: str | None
    node_rank: int
    num_nodes: int
    matmul_precision: str = "highest"
    grad_accum: int = 1


def config(
    *,
    steps: int = 200,
    batch_size: int = 16,
    checkpoint_interval: int = 50,
    dtype: str = "float32",
) -> TrainConfig:
    """Read the job's ``TrainConfig`` from the environment.

    Each ``SFTCTL_*`` variable that is set (and non-empty) overrides the matching keyword default:
    ``SFTCTL_TRAIN_STEPS``, ``SFTCTL_BATCH_SIZE``, ``SFTCTL_CHECKPOINT_INTERVAL``,
    ``SFTCTL_DTYPE``, ``SFTCTL_JOB_ID``, ``SFTCTL_NODE_RANK`` (default 0),
    ``SFTCTL_NUM_NODES`` (default 1) and ``SFTCTL_MATMUL_PRECISION`` (default ``highest``; applied
    with ``torch.set_float32_matmul_precision`` when torch is imported).

    ``dtype`` accepts "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16"/"half" and is
    returned in its canonical torch spelling.

    Raises:
        ValueError: a value (from the environment or a keyword) is malformed: a count that is not
            an integer >= 1 (``SFTCTL_NODE_RANK``: >= 0 and < num_nodes), or an unknown dtype. The
            message names the variable.
    """
    def get_int(name: str, default: int, minimum: int) -> int:
        if settings.raw(name) is None:
            if not isinstance(default, int) or isinstance(default, bool) or default < minimum:
                raise ValueError(f"{name}: default must be an integer >= {minimum}, got {default!r}")
            return default
        return settings.get(name)

    steps_v = get_int("SFTCTL_TRAIN_STEPS", steps, 1)
    batch_v = get_int("SFTCTL_BATCH_SIZE", batch_size, 1)
    interval_v = get_int("SFTCTL_CHECKPOINT_INTERVAL", checkpoint_interval, 1)
    num_nodes_v = get_int("SFTCTL_NUM_NODES", 1, 1)
    accum_v = get_int("SFTCTL_GRAD_ACCUM", 1, 1)
    node_rank_v = get_int("SFTCTL_NODE_RANK", 0, 0)
    if node_rank_v >= num_nodes_v:
        raise ValueError(
            f"SFTCTL_NODE_RANK={node_rank_v} must be < SFTCTL_NUM_NODES={num_nodes_v}"
        )
    raw_dtype = (settings.raw("SFTCTL_DTYPE") or dtype).lower()
    if raw_dtype not in _DTYPES:
        raise ValueError(
            f"SFTCTL_DTYPE: unknown dtype {raw_dtype!r}; expected one of {sorted(set(_DTYPES))}"
        )
    job_id = settings.raw("SFTCTL_JOB_ID")
    precision = settings.get("SFTCTL_MATMUL_PRECISION")
    torch = sys.modules.get("torch")
    if torch is not None:  # the script imported torch: run float32 matmuls as the plan priced them
        torch.set_float32_matmul_precision(precision)
    return TrainConfig(
        steps=steps_v,
        batch_size=batch_v,
        checkpoint_interval=interval_v,
        dtype=_DTYPES[raw_dtype],
        job_id=job_id,
        node_rank=node_rank_v,
        num_nodes=num_nodes_v,
        matmul_precision=precision,
        grad_accum=accum_v,
    )


def _parse_int(name: str, raw: str, *, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value
