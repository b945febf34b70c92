"""The controller's check of a node's metrics records (``metrics/rank-<N>.jsonl``, see
:mod:`sftctl.protocol`) before anything reads them. No I/O.

The files are written by the job, which may not use :func:`sftctl.train.report` (and which
``report``'s own checks therefore do not protect): a record the state cannot hold (a step of
2**63 overflows SQLite's INTEGER) or the monitor cannot read (a rank ``"zero"``) must never reach
them. :func:`check_metrics_record` says which field of a record is bad, so the controller drops
that record with a warning and keeps the job and its valid records going.
"""

from __future__ import annotations

import math

#: one past the largest step or rank the state holds (64-bit signed INTEGER / BIGINT)
INT_LIMIT = 2**63
#: warning events a controller writes about dropped records; past it one more says the rest go unsaid
#: (a job writing bad records in a loop must not flood the state's events)
MAX_WARNINGS = 10
#: times and rates: a finite number >= 0, or null
MEASURES = ("step_time_s", "tokens_per_s", "compute_time_s")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < INT_LIMIT


def _as_float(v: object) -> float | None:
    """A JSON number as a float; None for anything else (a bool, a string, an int float() overflows on)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        return float(v)
    except OverflowError:
        return None


def check_metrics_record(record: object) -> tuple[dict | None, str | None]:
    """One parsed JSON line of a metrics file: ``(clean record, None)`` when it is valid,
    ``(None, "FIELD: why")`` when it is not. Never raises.

    Valid: a JSON object whose ``rank`` is absent/null or an int in ``[0, 2**63)``; whose ``ts``
    is absent/null or a finite number (Unix seconds). A step report (it has ``step``; else it is
    a heartbeat) also has: ``step`` an int in ``[0, 2**63)``; ``loss`` null or a number (NaN/inf,
    which Python's json reads, become null, as ``report`` writes them); ``step_time_s``,
    ``tokens_per_s``, ``compute_time_s`` null or a finite number >= 0; ``lr`` null or a finite
    number; ``checkpoint`` null or a bool. The clean record has the numbers as floats (an int
    loss of 2**70 would overflow the state too) and no null ``rank``/``ts`` (the reader's
    defaults, the node's rank and the arrival time, apply); other keys pass through.
    """
    if not isinstance(record, dict):
        return None, f"record: {_short(record)} is not a JSON object"
    out = {k: v for k, v in record.items() if not (k in ("rank", "ts") and v is None)}  # null: the default
    rank = record.get("rank")
    if rank is not None and not _is_int(rank):
        return None, f"rank: {_short(rank)} is not an integer in [0, 2**63)"
    if record.get("ts") is not None:
        ts = _as_float(record["ts"])
        if ts is None or not math.isfinite(ts):
            return None, f"ts: {_short(record['ts'])} is not a finite number"
        out["ts"] = ts
    if "step" not in record:
        return out, None  # a heartbeat
    if not _is_int(record["step"]):
        return None, f"step: {_short(record['step'])} is not an integer in [0, 2**63)"
    if record.get("loss") is not None:
        loss = _as_float(record["loss"])
        if loss is None:
            return None, f"loss: {_short(record['loss'])} is not a number"
        out["loss"] = loss if math.isfinite(loss) else None
    for name in MEASURES:
        if record.get(name) is not None:
            v = _as_float(record[name])
            if v is None or not (math.isfinite(v) and v >= 0):
                return None, f"{name}: {_short(record[name])} is not a finite number >= 0"
            out[name] = v
    if record.get("lr") is not None:
        lr = _as_float(record["lr"])
        if lr is None or not math.isfinite(lr):
            return None, f"lr: {_short(record['lr'])} is not a finite number"
        out["lr"] = lr
    if record.get("checkpoint") is not None and not isinstance(record["checkpoint"], bool):
        return None, f"checkpoint: {_short(record['checkpoint'])} is not true or false"
    return out, None


#: a GPU sample's keys that are counts, bitmasks or indices: an int in [0, 2**63) when present
GPU_INTS = ("gpu", "clocks_event_reasons", "ecc_uncorrected_volatile", "pcie_replay_counter")
#: a GPU sample's measured values (sftctl.health.telemetry's table): a finite number when present
GPU_NUMBERS = ("ts", "clock_sm_mhz", "max_clock_sm_mhz", "temperature_gpu_c", "power_usage_mw",
               "enforced_power_limit_mw", "utilization_gpu_pct", "memory_used_mib")


def check_gpu_sample(record: object) -> tuple[dict | None, str | None]:
    """One parsed JSON line of a node's ``health.jsonl`` (:mod:`sftctl.health.telemetry`'s GPU
    samples, the agent's ``agent_error`` and ``preflight`` records): ``(record, None)`` when the
    detectors, the state and the dashboard can read it, ``(None, "FIELD: why")`` when not. Never
    raises. The file is in the node's directory, which the job can write to as the agent does.

    Valid: a JSON object whose :data:`GPU_INTS` are absent/null or ints in ``[0, 2**63)``, whose
    :data:`GPU_NUMBERS` are absent/null or finite numbers, whose ``xids`` is absent/null or a list
    of such ints, ``agent_error`` absent or a string, ``preflight`` absent or an object whose
    figures the controller can divide and format (:func:`_check_preflight`).
    """
    if not isinstance(record, dict):
        return None, f"record: {_short(record)} is not a JSON object"
    for name in GPU_INTS:
        if record.get(name) is not None and not _is_int(record[name]):
            return None, f"{name}: {_short(record[name])} is not an integer in [0, 2**63)"
    for name in GPU_NUMBERS:
        if record.get(name) is not None:
            v = _as_float(record[name])
            if v is None or not math.isfinite(v):
                return None, f"{name}: {_short(record[name])} is not a finite number"
    xids = record.get("xids")
    if xids is not None and not (isinstance(xids, list) and all(_is_int(x) for x in xids)):
        return None, f"xids: {_short(xids)} is not a list of integers"
    if "agent_error" in record and not isinstance(record["agent_error"], str):
        return None, f"agent_error: {_short(record['agent_error'])} is not a string"
    if "preflight" in record:
        if not isinstance(record["preflight"], dict):
            return None, f"preflight: {_short(record['preflight'])} is not a JSON object"
        bad = _check_preflight(record["preflight"])
        if bad is not None:
            return None, bad
    return record, None


def _number(v: object, at_least: float = 0.0, above: bool = False) -> bool:
    """Whether ``v`` is a finite JSON number ``>= at_least`` (``> at_least`` with ``above``)."""
    f = _as_float(v)
    return f is not None and math.isfinite(f) and (f > at_least if above else f >= at_least)


def _check_fields(obj: dict, where: str, required: dict, optional: dict) -> str | None:
    """The first of ``obj``'s fields (``name -> check``) that fails its check, as ``"where.name:
    value is not ..."``; a ``required`` field must be present and not null, an ``optional`` one
    may be absent or null."""
    for fields, needed in ((required, True), (optional, False)):
        for name, (ok, what) in fields.items():
            v = obj.get(name)
            if (v is None and needed) or (v is not None and not ok(v)):
                return f"{where}.{name}: {_short(v)} is not {what}"
    return None


_INT = (_is_int, "an integer in [0, 2**63)")
_STR = (lambda v: isinstance(v, str), "a string")
_LIST = (lambda v: isinstance(v, list), "a list")
_DICT = (lambda v: isinstance(v, dict), "a JSON object")
_SECONDS = (_number, "a finite number >= 0")
_POSITIVE = (lambda v: _number(v, above=True), "a finite number > 0")
#: a preflight record's fields (sftctl.preflight writes them; the controller's line, its
#: detector and the dashboard read them): required, optional
_PREFLIGHT = ({}, {"level": _STR, "when": _STR, "elapsed_s": _SECONDS, "matmul": _LIST, "allreduce": _DICT,
                   "dcgm": _DICT, "nvml": _DICT, "errors": _LIST})
_MATMUL = ({"flops": _SECONDS, "measured_s": _POSITIVE},
           {"gpu": _INT, "predicted_s": _SECONDS, "dtype": _STR, "reference": _STR,
            "shape": (lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "a list of integers")})
_ALLREDUCE = ({"nodes": _INT, "bus_gbps": _SECONDS},
              {"predicted_bus_gbps": _SECONDS, "slow_node": _INT, "reference": _STR,
               "send_gbps": (lambda v: isinstance(v, list) and all(_number(x) for x in v),
                             "a list of finite numbers >= 0")})


def _check_preflight(pre: dict) -> str | None:
    """The first bad field of a ``preflight`` record (``"preflight.matmul[0].measured_s: 0 is not
    a finite number > 0"``), or None: the controller divides by the matmul's seconds and formats
    the all-reduce's figures as numbers."""
    bad = _check_fields(pre, "preflight", *_PREFLIGHT)
    if bad is not None:
        return bad
    for i, mm in enumerate(pre.get("matmul") or ()):
        if not isinstance(mm, dict):
            return f"preflight.matmul[{i}]: {_short(mm)} is not a JSON object"
        bad = _check_fields(mm, f"preflight.matmul[{i}]", *_MATMUL)
        if bad is not None:
            return bad
    if pre.get("allreduce"):
        return _check_fields(pre["allreduce"], "preflight.allreduce", *_ALLREDUCE)
    return None


def _short(value: object) -> str:
    """``repr(value)``, cut to 60 characters (a job's value goes into an event message)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
