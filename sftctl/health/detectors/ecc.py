"""``ecc``: uncorrected ECC errors or a row-remapping failure -> ``replace`` (``gpu_failed``)."""

from __future__ import annotations

from collections.abc import Iterable

from sftctl.health.detectors.common import _by_gpu, _ts, per_node
from sftctl.health.registry import Detector, register
from sftctl.health.telemetry import REPLACE, Thresholds, Verdict
from sftctl.types import FailureCode


def ecc_verdicts(samples: Iterable[dict], node_rank: int, th: Thresholds) -> list[Verdict]:
    """``replace`` for a GPU whose volatile uncorrected ECC count is > 0 at first sight or grows,
    or that reports ``remapped_rows_failure``. A pending row remap alone gives no verdict."""
    del th
    out = []
    for gpu, lst in _by_gpu(samples).items():
        reason = None
        ts = 0.0
        first = prev = None
        first_ts = 0.0
        for s in lst:
            if "ecc_uncorrected_volatile" not in s:
                continue
            value = int(s["ecc_uncorrected_volatile"])
            if prev is None:
                first, first_ts = value, _ts(s)
            if (prev is None and value > 0) or (prev is not None and value > prev):
                ts = _ts(s)
                if prev is None:
                    reason = f"volatile uncorrected ECC errors {value} at first sample"
                else:
                    reason = (f"volatile uncorrected ECC errors {first} -> {value} over "
                              f"{ts - first_ts:.1f} s")
            prev = value
        failed = [s for s in lst if s.get("remapped_rows_failure")]
        if failed:
            text = "row remapping failure reported (remapped_rows_failure)"
            reason = f"{reason}; {text}" if reason else text
            ts = max(ts, _ts(failed[-1]))
        if reason:
            out.append(Verdict(kind="ecc", action=REPLACE, node_rank=node_rank, gpu=gpu,
                               evidence=f"GPU {gpu}: {reason}", ts=ts))
    return out


DETECTOR = register(Detector(
    kind="ecc", code=FailureCode.GPU_FAILED, order=30, run=per_node(ecc_verdicts),
    summary="volatile uncorrected ECC errors (at first sight or growing) or a row-remapping failure: "
            "replace the node",
))
