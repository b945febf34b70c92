"""What the detectors share: samples grouped by GPU, trailing windows, the actions' ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from sftctl.health.telemetry import REPLACE, RESTART, Thresholds, Verdict

if TYPE_CHECKING:
    from sftctl.health.registry import History

#: an action's severity: ``replace`` outranks ``restart``
ACTION_RANK = {RESTART: 0, REPLACE: 1}


def _by_gpu(samples: Iterable[dict]) -> dict[int, list[dict]]:
    """Samples grouped by GPU index, each list sorted by ``ts`` (stable). Skips node records."""
    out: dict[int, list[dict]] = {}
    for s in samples:
        gpu = s.get("gpu")
        if gpu is None:
            continue
        out.setdefault(int(gpu), []).append(s)
    for lst in out.values():
        lst.sort(key=lambda s: float(s.get("ts", 0.0)))
    return dict(sorted(out.items()))


def _ts(sample: dict) -> float:
    return float(sample.get("ts", 0.0))


def trailing_window(samples: Sequence[dict], window_s: float) -> list[dict] | None:
    """The samples of the trailing window of ``window_s`` seconds, or None if history is short.

    ``samples`` must be sorted by ``ts``. The window ends at the last sample and starts at the
    latest sample taken at or before ``last ts - window_s``, so it always spans at least
    ``window_s`` (sampling jitter only lengthens it slightly). None when no sample is that old,
    i.e. the history does not cover a whole window yet, or when that sample is more than
    ``window_s`` older still (a sampling gap longer than the window: the samples after it do
    not cover the window).
    """
    if not samples:
        return None
    cutoff = _ts(samples[-1]) - window_s
    start = None
    for i in range(len(samples) - 1, -1, -1):
        if _ts(samples[i]) <= cutoff:
            start = i
            break
    if start is None or _ts(samples[start]) < cutoff - window_s:
        return None
    return list(samples[start:])


def _fmt_num(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def flag_verdicts(samples: Iterable[dict], node_rank: int, key: str, kind: str, what: str) -> list[Verdict]:
    """``replace`` for every GPU with a sample whose ``key`` is true: the detectors of a fault
    acted on at once (``gpu_lost``, ``xgmi``). Evidence: ``GPU g: <what> in n/m samples, first
    at ts t``; the verdict's ``ts`` is the last such sample's."""
    out = []
    for gpu, lst in _by_gpu(samples).items():
        bad = [s for s in lst if s.get(key)]
        if bad:
            out.append(Verdict(kind=kind, action=REPLACE, node_rank=node_rank, gpu=gpu,
                               evidence=f"GPU {gpu}: {what} in {len(bad)}/{len(lst)} samples, first at ts {_ts(bad[0]):.1f}",
                               ts=_ts(bad[-1])))
    return out


def per_node(verdicts: Callable[[list[dict], int, Thresholds], list[Verdict]]) -> Callable[["History", Thresholds], list[Verdict]]:
    """A registry ``run`` that applies a per-node ``verdicts(samples, node_rank, th)`` to every
    node's GPU samples, in node order."""
    def run(h: "History", th: Thresholds) -> list[Verdict]:
        return [v for node in sorted(h.gpu_samples_by_node) for v in verdicts(list(h.gpu_samples_by_node[node]), node, th)]
    return run
