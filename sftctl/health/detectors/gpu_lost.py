"""``gpu_lost``: any sample with ``gpu_is_lost`` -> ``replace`` (failure code ``gpu_failed``).

NVML's ``NVML_ERROR_GPU_IS_LOST``, nvidia-smi's "GPU is lost", or amd-smi failing with
``AMDSMI_STATUS_NOT_FOUND`` after it saw the GPU set the key (:mod:`sftctl.health.sources`,
:mod:`sftctl.health.amd_smi`)."""

from __future__ import annotations

from collections.abc import Iterable

from sftctl.health.detectors.common import flag_verdicts, per_node
from sftctl.health.registry import Detector, register
from sftctl.health.telemetry import Thresholds, Verdict
from sftctl.types import FailureCode


def gpu_lost_verdicts(samples: Iterable[dict], node_rank: int, th: Thresholds) -> list[Verdict]:
    """``replace`` for every GPU with a ``gpu_is_lost`` sample (first such sample is the evidence)."""
    del th  # no settings: a lost GPU is acted on at once
    return flag_verdicts(samples, node_rank, "gpu_is_lost", "gpu_lost",
                         "NVML reports the GPU is lost (NVML_ERROR_GPU_IS_LOST)")


DETECTOR = register(Detector(
    kind="gpu_lost", code=FailureCode.GPU_FAILED, order=10, run=per_node(gpu_lost_verdicts),
    summary="a GPU fell off the bus or stopped answering (gpu_is_lost): replace its node",
))
