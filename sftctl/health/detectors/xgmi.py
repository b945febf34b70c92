"""``xgmi``: an AMD GPU whose xGMI links report an error -> ``replace`` (failure code ``gpu_failed``).

The sample key ``xgmi_error`` comes from :mod:`sftctl.health.amd_smi`: ``amd-smi metric``'s
``xgmi_err`` other than ``NO_ERROR`` (MI2xx), or an uncorrectable count in the ``XGMI_WAFL`` RAS
block (MI300 and later, whose ``xgmi_err`` is always N/A: ROCm/rocm-systems#11468); the
analogue of an NVLink error (XID 74) on NVIDIA: collectives over the broken link fail or crawl,
and another node is the cure.
"""

from __future__ import annotations

from collections.abc import Iterable

from sftctl.health.detectors.common import flag_verdicts, per_node
from sftctl.health.registry import Detector, register
from sftctl.health.telemetry import Thresholds, Verdict
from sftctl.types import FailureCode


def xgmi_verdicts(samples: Iterable[dict], node_rank: int, th: Thresholds) -> list[Verdict]:
    """``replace`` for every GPU with a sample whose ``xgmi_error`` is true."""
    del th  # no settings: a broken link is acted on at once
    return flag_verdicts(samples, node_rank, "xgmi_error", "xgmi",
                         "amd-smi reports an xGMI link error (xgmi_err or XGMI_WAFL uncorrectable)")


DETECTOR = register(Detector(
    kind="xgmi", code=FailureCode.GPU_FAILED, order=35, run=per_node(xgmi_verdicts),
    summary="an AMD GPU's xGMI links report an error (amd-smi xgmi_err / XGMI_WAFL RAS): replace its node",
))
