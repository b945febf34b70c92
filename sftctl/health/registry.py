"""The detectors' registry: each health detector declares itself once, here.

A :class:`Detector` names the verdict kind it emits, the :class:`~sftctl.types.FailureCode` an
attempt it ends is recorded with, its place in the tie-break order, the one line that says what
it finds, the kinds whose verdicts explain it away, its :class:`Threshold` s (name, unit,
default, bounds, the spec key that sets it) and its pure function from a job's
:class:`History` to verdicts. Everything else is derived from the registry:
:class:`~sftctl.health.telemetry.VerdictKind` (one member per kind, its ``code``),
:data:`sftctl.health.detectors.KIND_ORDER`, :class:`~sftctl.health.telemetry.Thresholds`
(names and defaults), the spec's ``health:`` keys (``sftctl.spec.HealthSpec``) and what
:func:`sftctl.health.detectors.evaluate` runs.

The built-in detectors are the modules of :mod:`sftctl.health.detectors` (one file each, found
by listing the package); another registers itself with :func:`register` when its module is
imported. A detector with a spec key must be registered before ``sftctl.spec`` is imported
(the spec's model is built once, from the registry, when that module loads).

This module imports nothing but :mod:`sftctl.types`: no pydantic, no compiler.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sftctl.types import FailureCode

_WORD = re.compile(r"[a-z][a-z0-9_]*\Z")


@dataclasses.dataclass(frozen=True)
class Threshold:
    """One setting of one or more detectors.

    Attributes:
        name: the attribute of :class:`~sftctl.health.telemetry.Thresholds` (a lowercase word).
        default: the value when nothing sets it; an ``int`` makes an integer threshold (a
            spec value must then be an integer: YAML's ``true`` or ``2.0`` is refused).
        unit: what the number counts, for people: ``s``, ``fraction``, ``x``, ``%``, ``steps``...
        doc: one line: what it sets.
        spec_key: the key under the spec's ``health:`` that sets it, or None when a spec cannot.
        gt, ge, lt, le: bounds a spec value must keep (None: unbounded on that side).
    """

    name: str
    default: float | int
    unit: str
    doc: str
    spec_key: str | None = None
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def __post_init__(self) -> None:
        if not _WORD.match(self.name):
            raise ValueError(f"threshold name {self.name!r}: use a lowercase word (a-z, 0-9, _)")
        if self.spec_key is not None and not _WORD.match(self.spec_key):
            raise ValueError(f"threshold {self.name}: spec_key {self.spec_key!r}: use a lowercase word")
        if isinstance(self.default, bool) or not isinstance(self.default, (int, float)):
            raise ValueError(f"threshold {self.name}: default {self.default!r} is not a number")

    @property
    def integer(self) -> bool:
        """Whether the threshold is a count (its default is an ``int``)."""
        return isinstance(self.default, int)


@dataclasses.dataclass(frozen=True)
class History:
    """A job's recent history, what every detector reads (see
    :func:`sftctl.health.detectors.evaluate` for each field's meaning).

    Attributes:
        gpu_samples_by_node: node rank -> GPU samples (:mod:`sftctl.health.telemetry`).
        step_times: global rank -> ``(step, step_time_s)`` pairs.
        last_reports: global rank -> ``ts`` (Unix seconds) of its last report, or ``(ts, step)``.
        rank_to_node: global rank -> node rank.
        now: current time, Unix seconds.
        finished_ranks: ranks that exited normally.
        last_steps: global rank -> (arrival time, step) of its last step report, or None.
    """

    gpu_samples_by_node: Mapping[int, Sequence[dict]]
    step_times: Mapping[int, Sequence[tuple[int, float]]]
    last_reports: Mapping[int, Any]
    rank_to_node: Mapping[int, int]
    now: float
    finished_ranks: frozenset[int] = frozenset()
    last_steps: Mapping[int, tuple[float, int]] | None = None


@dataclasses.dataclass(frozen=True)
class Detector:
    """A health detector, declared once.

    Attributes:
        kind: the verdict kind it emits (a lowercase word: ``stall``); becomes a member of
            :class:`~sftctl.health.telemetry.VerdictKind` (``VerdictKind.STALL``).
        code: the failure code of an attempt its verdict ends.
        order: tie-break rank among one node's verdicts with the same action: lower wins
            (gpu_lost 10, xid 20, ecc 30, throttle 40, hang 50, straggler 60, stall 70,
            preflight_failed 80, preflight_slow 85).
        summary: one line for people: what it finds and what the controller does about it.
        run: its pure function ``(history, thresholds) -> list[Verdict]``: no files, clocks or
            devices; same input, same verdicts in the same order.
        thresholds: the settings it reads; a setting read by several detectors (``hang_timeout_s``
            by hang and stall) is the same :class:`Threshold` in each.
        explained_by: kinds whose verdicts explain this one away: while any of them is found,
            this detector's verdicts are dropped (a hung rank explains a stall).
    """

    kind: str
    code: FailureCode
    order: int
    summary: str
    run: Callable[[History, Any], list]
    thresholds: tuple[Threshold, ...] = ()
    explained_by: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _WORD.match(self.kind):
            raise ValueError(f"detector kind {self.kind!r}: use a lowercase word (a-z, 0-9, _)")
        if not isinstance(self.code, FailureCode):
            raise ValueError(f"detector {self.kind}: code {self.code!r} is not a sftctl.types.FailureCode")


_DETECTORS: dict[str, Detector] = {}
_LISTENERS: list[Callable[[Detector], None]] = []
_SPEC_BUILT = False


def register(detector: Detector) -> Detector:
    """Add ``detector`` to the registry and return it (registering the same one again is a no-op).

    Raises:
        ValueError: another detector has its kind, or one of its thresholds has the name or the
            spec key of a different threshold already registered.
        RuntimeError: it brings a spec key after ``sftctl.spec`` built its model (import the
            detector's module before ``sftctl.spec``).
    """
    old = _DETECTORS.get(detector.kind)
    if old is not None:
        if old == detector:
            return old
        raise ValueError(f"health detector {detector.kind!r} is registered already (by {old.run.__module__})")
    known = thresholds()
    keys = {t.spec_key: t for t in known.values() if t.spec_key}
    for t in detector.thresholds:
        if t.name in known and known[t.name] != t:
            raise ValueError(f"health detector {detector.kind}: threshold {t.name!r} differs from the one "
                             "registered already: share the same Threshold object")
        if t.spec_key and t.spec_key in keys and keys[t.spec_key] != t:
            raise ValueError(f"health detector {detector.kind}: spec key {t.spec_key!r} is taken by "
                             f"threshold {keys[t.spec_key].name!r}")
        if _SPEC_BUILT and t.spec_key and t.name not in known:
            raise RuntimeError(f"health detector {detector.kind}: spec key health.{t.spec_key} comes after "
                               "sftctl.spec was imported: import the detector's module first")
    for kind in detector.explained_by:
        if not _WORD.match(kind):
            raise ValueError(f"health detector {detector.kind}: explained_by {kind!r} is not a kind")
    _DETECTORS[detector.kind] = detector
    for listener in list(_LISTENERS):
        listener(detector)
    return detector


def on_register(listener: Callable[[Detector], None]) -> None:
    """Call ``listener(detector)`` for every detector registered so far and every later one."""
    _LISTENERS.append(listener)
    for d in list(_DETECTORS.values()):
        listener(d)


def get_detector(kind: str) -> Detector:
    """The detector of ``kind``.

    Raises:
        KeyError: no detector of that kind is registered.
    """
    return _DETECTORS[str(kind)]


def detectors() -> list[Detector]:
    """Every registered detector in tie-break order (``order``, then kind)."""
    return sorted(_DETECTORS.values(), key=lambda d: (d.order, d.kind))


def kind_order() -> tuple[str, ...]:
    """The verdict kinds in tie-break order (earlier wins among verdicts with the same action)."""
    return tuple(d.kind for d in detectors())


def thresholds() -> dict[str, Threshold]:
    """Every registered threshold by name, in document order: after every detector that reads it
    (by ``order``), then as declared. So a threshold shared by a later detector (``hang_timeout_s``,
    read by hang and stall) comes after those of the detectors before it, and a detector added
    later leaves the others' keys in their order (``HealthSpec``'s fields follow this order)."""
    last: dict[str, tuple[int, int, int]] = {}
    found: dict[str, Threshold] = {}
    for i, d in enumerate(detectors()):
        for j, t in enumerate(d.thresholds):
            found[t.name] = t
            last[t.name] = (d.order, i, j)
    return {name: found[name] for name in sorted(found, key=lambda n: last[n])}


def spec_thresholds() -> list[Threshold]:
    """The thresholds a spec sets (``spec_key`` given), in document order. Called by
    ``sftctl.spec`` when it builds ``HealthSpec``: a detector with a spec key registered after
    that is refused (:func:`register`)."""
    global _SPEC_BUILT
    _SPEC_BUILT = True
    return [t for t in thresholds().values() if t.spec_key]

