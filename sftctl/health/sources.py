"""Where GPU samples come from. All device and file I/O of the health package lives here.

A source has ``sample() -> list[dict]`` (one dict per GPU, in the format documented in
:mod:`sftctl.health.telemetry`, ``ts`` set from the source's clock), ``close()`` and a
``description`` for logs:

* :class:`NvmlSource` -- NVML through ``pynvml`` (PyPI ``nvidia-ml-py``), the normal case.
* :class:`NvidiaSmiSource` -- ``nvidia-smi --query-gpu`` when NVML cannot be loaded from Python.
  It sees no XIDs and no PCIe replays.
* :class:`sftctl.health.amd_smi.AmdSmiSource` -- ``amd-smi metric --json`` on AMD GPUs (ROCm).
* :class:`ReplaySource` -- a recorded JSON-lines stream, for tests and fault injection.
* :class:`NoGpuSource` -- a machine without GPUs.

:func:`open_source` picks one and never raises on a machine without GPUs.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from sftctl.health.amd_smi import AmdSmiSource
from sftctl.health.cli_source import CliSource
from sftctl.protocol import METRICS_GLOB

Clock = Callable[[], float]


class Source(Protocol):
    description: str

    def sample(self) -> list[dict]: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# NVML


class NvmlSource:
    """Reads every GPU through NVML on each :meth:`sample` call.

    Every per-field NVML call is guarded on its own: ``NVML_ERROR_NOT_SUPPORTED`` (or any other
    NVML error but a lost GPU) leaves that key out. ``NVML_ERROR_GPU_IS_LOST`` from any call
    ends that GPU's sample as ``{"ts", "gpu", "uuid" (if known), "gpu_is_lost": True}`` (plus
    ``xids`` if any arrived). ``clocks_event_reasons`` comes from
    ``nvmlDeviceGetCurrentClocksEventReasons``, or ``...ClocksThrottleReasons`` on drivers or
    bindings that lack it.

    XIDs: an NVML event set registered for ``nvmlEventTypeXidCriticalError`` on every GPU at
    construction (so XIDs from before the agent started are not seen); each ``sample()`` drains
    it with ``nvmlEventSetWait(set, 0)`` until ``NVML_ERROR_TIMEOUT`` and puts each event's
    ``eventData`` (the XID) into ``xids`` of the GPU it came from (found with
    ``nvmlDeviceGetIndex``, else by UUID, else the lowest-index GPU).

    Args:
        nvml: the ``pynvml`` module or a stand-in with the same names (tests); imported lazily
            when None.
        clock: time source for ``ts``.

    Raises:
        ImportError: ``pynvml`` is not installed.
        pynvml.NVMLError: ``nvmlInit`` failed (no driver, no GPU).
    """

    _MAX_EVENTS_PER_SAMPLE = 1024

    def __init__(self, *, nvml: Any = None, clock: Clock = time.time) -> None:
        if nvml is None:
            import pynvml as nvml  # type: ignore[no-redef]  # noqa: PLC0415 (lazy: optional dependency, and no GPU here)
        self._nvml = nvml
        self._clock = clock
        nvml.nvmlInit()
        self._closed = False
        try:
            self.gpu_count = int(nvml.nvmlDeviceGetCount())
        except Exception:
            nvml.nvmlShutdown()
            raise
        self._handles: list[Any] = []
        self._uuids: list[str | None] = []
        self._lost_at_init: set[int] = set()
        for i in range(self.gpu_count):
            handle = uuid = None
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            except nvml.NVMLError as e:
                if self._is(e, "NVML_ERROR_GPU_IS_LOST"):
                    self._lost_at_init.add(i)
            self._handles.append(handle)
            self._uuids.append(uuid)
        self._event_set = None
        try:
            self._event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError:
            pass
        if self._event_set is not None:
            for handle in self._handles:
                if handle is None:
                    continue
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError,
                                                  self._event_set)
                except nvml.NVMLError:
                    pass  # not supported on this GPU (e.g. in some VMs): no XIDs from it
        self.description = f"nvml ({self.gpu_count} GPU{'s' if self.gpu_count != 1 else ''})"

    def _is(self, err: Exception, name: str) -> bool:
        return getattr(err, "value", None) == getattr(self._nvml, name, object())

    def sample(self) -> list[dict]:
        nvml = self._nvml
        now = float(self._clock())
        xids = self._drain_xids()
        out = []
        for i, handle in enumerate(self._handles):
            s: dict = {"ts": now, "gpu": i}
            if self._uuids[i] is not None:
                s["uuid"] = self._uuids[i]
            if handle is None:
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(i)
                    self._handles[i] = handle
                except nvml.NVMLError as e:
                    if self._is(e, "NVML_ERROR_GPU_IS_LOST") or i in self._lost_at_init:
                        s["gpu_is_lost"] = True
                    if i in xids:
                        s["xids"] = xids[i]
                    out.append(s)
                    continue
            try:
                self._read(handle, s)
            except _GpuLost:
                s = {k: s[k] for k in ("ts", "gpu", "uuid") if k in s}
                s["gpu_is_lost"] = True
            if i in xids:
                s["xids"] = xids[i]
            out.append(s)
        return out

    def _get(self, s: dict, key: str, fn: Callable[[], Any]) -> None:
        """Sets ``s[key] = fn()``; leaves it out on an NVML error; raises _GpuLost if lost."""
        try:
            s[key] = fn()
        except self._nvml.NVMLError as e:
            if self._is(e, "NVML_ERROR_GPU_IS_LOST"):
                raise _GpuLost() from e
            # NOT_SUPPORTED (and any other error, e.g. NO_PERMISSION): key omitted

    def _read(self, h: Any, s: dict) -> None:
        nvml = self._nvml
        self._get(s, "clocks_event_reasons", lambda: int(self._clocks_event_reasons(h)))
        self._get(s, "clock_sm_mhz", lambda: int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)))
        self._get(s, "max_clock_sm_mhz",
                  lambda: int(nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM)))
        self._get(s, "temperature_gpu_c",
                  lambda: int(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)))
        self._get(s, "power_usage_mw", lambda: int(nvml.nvmlDeviceGetPowerUsage(h)))
        self._get(s, "enforced_power_limit_mw", lambda: int(nvml.nvmlDeviceGetEnforcedPowerLimit(h)))
        self._get(s, "utilization_gpu_pct", lambda: int(nvml.nvmlDeviceGetUtilizationRates(h).gpu))
        self._get(s, "memory_used_mib", lambda: int(nvml.nvmlDeviceGetMemoryInfo(h).used) // 2**20)
        self._get(s, "ecc_uncorrected_volatile", lambda: int(nvml.nvmlDeviceGetTotalEccErrors(
            h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)))
        rows: dict = {}
        self._get(rows, "rows", lambda: nvml.nvmlDeviceGetRemappedRows(h))
        if "rows" in rows:
            _corr, _unc, pending, failure = rows["rows"]
            s["remapped_rows_pending"] = bool(pending)
            s["remapped_rows_failure"] = bool(failure)
        self._get(s, "pcie_replay_counter", lambda: int(nvml.nvmlDeviceGetPcieReplayCounter(h)))

    def _clocks_event_reasons(self, h: Any) -> int:
        nvml = self._nvml
        fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if fn is not None:
            try:
                return fn(h)
            except nvml.NVMLError as e:
                if not self._is(e, "NVML_ERROR_FUNCTION_NOT_FOUND"):
                    raise
        return nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)

    def _drain_xids(self) -> dict[int, list[int]]:
        nvml = self._nvml
        out: dict[int, list[int]] = {}
        if self._event_set is None:
            return out
        for _ in range(self._MAX_EVENTS_PER_SAMPLE):
            try:
                event = nvml.nvmlEventSetWait(self._event_set, 0)
            except nvml.NVMLError:
                break  # NVML_ERROR_TIMEOUT: drained (any other error: try again next sample)
            if not getattr(event, "eventType", nvml.nvmlEventTypeXidCriticalError) \
                    & nvml.nvmlEventTypeXidCriticalError:
                continue
            out.setdefault(self._event_gpu(event), []).append(int(event.eventData))
        return out

    def _event_gpu(self, event: Any) -> int:
        nvml = self._nvml
        try:
            return int(nvml.nvmlDeviceGetIndex(event.device))
        except Exception:  # noqa: BLE001 (NVMLError, or a handle NVML no longer accepts)
            pass
        try:
            uuid = _text(nvml.nvmlDeviceGetUUID(event.device))
            if uuid in self._uuids:
                return self._uuids.index(uuid)
        except Exception:  # noqa: BLE001
            pass
        return 0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        nvml = self._nvml
        try:
            if self._event_set is not None:
                nvml.nvmlEventSetFree(self._event_set)
        except nvml.NVMLError:
            pass
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


class _GpuLost(Exception):
    pass


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------------------------------------
# nvidia-smi


#: nvidia-smi ``--query-gpu`` field -> sample key. Names from ``nvidia-smi --help-query-gpu``.
SMI_KEYS: dict[str, str] = {
    "index": "gpu",
    "uuid": "uuid",
    "clocks_event_reasons.active": "clocks_event_reasons",
    "clocks_throttle_reasons.active": "clocks_event_reasons",  # drivers before r535
    "clocks.sm": "clock_sm_mhz",
    "clocks.max.sm": "max_clock_sm_mhz",
    "temperature.gpu": "temperature_gpu_c",
    "power.draw": "power_usage_mw",
    "enforced.power.limit": "enforced_power_limit_mw",
    "power.limit": "enforced_power_limit_mw",
    "utilization.gpu": "utilization_gpu_pct",
    "ecc.errors.uncorrected.volatile.total": "ecc_uncorrected_volatile",
    "remapped_rows.pending": "remapped_rows_pending",
    "retired_pages.pending": "remapped_rows_pending",  # pre-Ampere: page retirement pending
    "remapped_rows.failure": "remapped_rows_failure",
}

#: Fields asked for first.
SMI_FIELDS: tuple[str, ...] = (
    "index", "uuid", "clocks_event_reasons.active", "clocks.sm", "clocks.max.sm",
    "temperature.gpu", "power.draw", "enforced.power.limit", "utilization.gpu",
    "ecc.errors.uncorrected.volatile.total", "remapped_rows.pending", "remapped_rows.failure",
)

#: What to ask instead when nvidia-smi rejects a field (older drivers); a field without an
#: alternative is dropped.
SMI_ALTERNATIVES: dict[str, str] = {
    "clocks_event_reasons.active": "clocks_throttle_reasons.active",
    "enforced.power.limit": "power.limit",
    "remapped_rows.pending": "retired_pages.pending",
}

_SMI_MISSING = re.compile(r"^\[?(N/A|Not Supported|Unknown Error|Insufficient Permissions|"
                          r"Requested functionality has been deprecated)\]?$", re.IGNORECASE)
_SMI_NUMBER = re.compile(r"^[-+]?\d+(\.\d*)?")
_SMI_INVALID_FIELD = re.compile(r'Field "([^"]+)" is not a valid field to query', re.IGNORECASE)


def _smi_number(text: str) -> float | None:
    m = _SMI_NUMBER.match(text)  # tolerates units ("1980 MHz") when nounits was not used
    return float(m.group(0)) if m else None


def _smi_value(field: str, key: str, text: str) -> Any:
    """One CSV cell as the sample's value, or None when it has no usable value."""
    if key == "uuid":
        return text
    if key == "clocks_event_reasons":
        try:
            return int(text, 16) if text.lower().startswith("0x") else int(text)
        except ValueError:
            return None
    if key in ("remapped_rows_pending", "remapped_rows_failure"):
        low = text.lower()
        if low in ("yes", "true"):
            return True
        if low in ("no", "false"):
            return False
        n = _smi_number(text)
        return None if n is None else n != 0
    n = _smi_number(text)
    if n is None:
        return None
    if key in ("power_usage_mw", "enforced_power_limit_mw"):
        return int(round(n * 1000))  # nvidia-smi reports W, NVML mW
    return int(n) if n.is_integer() else n


def parse_nvidia_smi_csv(text: str, fields: Sequence[str]) -> list[dict]:
    """Parse ``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`` output.

    Pure: no clock (the caller adds ``ts``), no I/O. One dict per line whose field count
    matches and whose ``index`` (when asked for) is an integer; so a header line or an error
    message line is skipped. Cells like ``[N/A]``/``[Not Supported]``/``[Unknown Error]`` leave
    the key out; a cell saying ``GPU is lost`` makes the record ``gpu_is_lost`` (identifying
    keys kept, measurements dropped). Hex masks (``0x0000000000000008``) become ints, W become
    mW, ``Yes``/``No`` become bools. Fields not in :data:`SMI_KEYS` are ignored.
    """
    out = []
    fields = [f.strip() for f in fields]
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if not row or len(row) != len(fields):
            continue
        rec: dict = {}
        lost = False
        ok = True
        for field, cell in zip(fields, row):
            cell = cell.strip()
            key = SMI_KEYS.get(field)
            if key is None:
                continue
            if "gpu is lost" in cell.lower():
                lost = True
                continue
            if not cell or _SMI_MISSING.match(cell):
                continue
            if key == "gpu":
                if not cell.isascii() or not cell.isdigit():
                    ok = False
                    break
                rec["gpu"] = int(cell)
                continue
            value = _smi_value(field, key, cell)
            if value is not None:
                rec[key] = value
        if not ok:
            continue
        if lost:
            rec = {k: rec[k] for k in ("gpu", "uuid") if k in rec}
            rec["gpu_is_lost"] = True
        out.append(rec)
    return out


class NvidiaSmiSource(CliSource):
    """Samples GPUs by running ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` (the
    loop is :class:`sftctl.health.cli_source.CliSource`'s).

    At construction it runs nvidia-smi once to settle the field list: a field the driver rejects
    (``Field "x" is not a valid field to query``) is swapped for its older name
    (:data:`SMI_ALTERNATIVES`) or dropped, and the query retried. No XIDs or PCIe replay counts
    (nvidia-smi's query has none).

    When a later run fails, :meth:`sample` returns the GPUs it could parse, marks GPUs it saw
    before as ``gpu_is_lost`` if the output says a GPU is lost, and keeps the message in
    ``last_error``; it does not raise.

    Args:
        executable: the nvidia-smi to run.
        run: ``subprocess.run`` or a stand-in (tests).
        clock: time source for ``ts``.
        timeout_s: limit for one nvidia-smi run.

    Raises:
        RuntimeError: nvidia-smi does not work (no driver, no GPU, no usable field).
        OSError: it cannot be started.
    """

    tool = "nvidia-smi"

    def __init__(
        self,
        executable: str = "nvidia-smi",
        *,
        run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
        clock: Clock = time.time,
        timeout_s: float = 20.0,
    ) -> None:
        super().__init__(executable, run=run, clock=clock, timeout_s=timeout_s)
        self.fields: list[str] = list(SMI_FIELDS)
        for _ in range(len(SMI_FIELDS) + 1):
            proc = self._query()
            if proc.returncode == 0:
                rows = parse_nvidia_smi_csv(proc.stdout, self.fields)
                if not rows:
                    raise RuntimeError(f"nvidia-smi lists no GPU: {proc.stdout.strip()[:200]!r}")
                break
            message = f"{proc.stdout}\n{proc.stderr}"
            m = _SMI_INVALID_FIELD.search(message)
            if not m or m.group(1) not in self.fields or m.group(1) == "index":
                raise RuntimeError(f"nvidia-smi failed (exit {proc.returncode}): "
                                   f"{message.strip()[:300]}")
            bad = m.group(1)
            alt = SMI_ALTERNATIVES.get(bad)
            pos = self.fields.index(bad)
            if alt and alt not in self.fields:
                self.fields[pos] = alt
            else:
                del self.fields[pos]
        else:
            raise RuntimeError("nvidia-smi rejected every field list tried")
        self.description = f"nvidia-smi ({len(rows)} GPU{'s' if len(rows) != 1 else ''})"
        self._remember(rows)

    def _query(self) -> subprocess.CompletedProcess:
        return self._run(
            [self._exe, f"--query-gpu={','.join(self.fields)}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=self._timeout_s, check=False,
        )

    def _parse(self, stdout: str) -> list[dict]:
        return parse_nvidia_smi_csv(stdout, self.fields)


# ---------------------------------------------------------------------------------------------
# replay


class ReplaySource:
    """Replays a recorded JSON-lines stream of samples; for tests and fault injection.

    Each line is one sample in the telemetry format (``ts`` is ignored and set to the time of
    emission) plus optional control keys, which are removed from what is emitted:

    ``"after_s": float``  due once that many seconds passed since the source was created.
    ``"at_step": int``    due once training reached that step: the highest ``step`` in
                          ``metrics_dir/rank-*.jsonl`` (the files ``sftctl.train.report``
                          writes) is >= it. Needs ``metrics_dir``.
    neither               due at once (the next tick). With both, both must hold.
    ``"repeat": true``    once emitted, the record is emitted again on every later tick, until a
                          later record for the same GPU is emitted (so a sustained fault is one
                          line). Its ``xids`` go out only the first time (they are events).

    Records are taken in file order: one ``sample()`` (a tick) emits the due records at the head
    of the stream, stopping at the first record not yet due, or at a record for a GPU that
    already has one in this tick (so untimed lines for GPUs 0, 1, 0, 1 make two ticks of two
    GPUs), then adds the repeating records of GPUs not emitted this tick. After the last line
    only repeating records remain (or nothing).

    Raises:
        ValueError: a line is not a JSON object, or an ``at_step`` record without metrics_dir.
        OSError: the file cannot be read.
    """

    _CONTROL_KEYS = ("after_s", "at_step", "repeat")

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        metrics_dir: str | os.PathLike | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.path = Path(path)
        self._records: list[dict] = []
        with self.path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{self.path}:{n}: not JSON: {e}") from None
                if not isinstance(rec, dict):
                    raise ValueError(f"{self.path}:{n}: not a JSON object")
                if "at_step" in rec and metrics_dir is None:
                    raise ValueError(f"{self.path}:{n}: at_step needs a metrics_dir")
                self._records.append(rec)
        self._metrics_dir = Path(metrics_dir) if metrics_dir is not None else None
        self._clock = clock
        self._start = float(clock())
        self._next = 0
        self._repeating: dict[Any, dict] = {}
        self._offsets: dict[str, int] = {}
        self._max_step: int | None = None
        self.description = f"replay ({self.path})"

    def max_step(self) -> int | None:
        """Highest ``step`` in ``metrics_dir/rank-*.jsonl`` so far (read incrementally)."""
        if self._metrics_dir is None:
            return None

        for name in sorted(glob.glob(str(self._metrics_dir / METRICS_GLOB))):
            offset = self._offsets.get(name, 0)
            try:
                with open(name, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1  # whole lines only: the last may be half written
            for line in data[:end].splitlines():
                try:
                    step = json.loads(line).get("step")
                except (ValueError, AttributeError):
                    continue
                if isinstance(step, int) and (self._max_step is None or step > self._max_step):
                    self._max_step = step
            self._offsets[name] = offset + end
        return self._max_step

    def _due(self, rec: dict, elapsed: float) -> bool:
        if "after_s" in rec and elapsed < float(rec["after_s"]):
            return False
        if "at_step" in rec:
            step = self.max_step()
            if step is None or step < int(rec["at_step"]):
                return False
        return True

    def sample(self) -> list[dict]:
        now = float(self._clock())
        elapsed = now - self._start
        emitted: list[dict] = []
        gpus: set = set()
        while self._next < len(self._records):
            rec = self._records[self._next]
            gpu = rec.get("gpu")
            if gpu in gpus or not self._due(rec, elapsed):
                break
            self._next += 1
            gpus.add(gpu)
            out = {k: v for k, v in rec.items() if k not in self._CONTROL_KEYS}
            out["ts"] = now
            emitted.append(out)
            if rec.get("repeat"):
                again = dict(out)
                again.pop("xids", None)
                self._repeating[gpu] = again
            else:
                self._repeating.pop(gpu, None)
        for gpu, rec in self._repeating.items():
            if gpu not in gpus:
                emitted.append(dict(rec, ts=now))
        return sorted(emitted, key=lambda r: (r.get("gpu") is None, r.get("gpu") or 0))

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# no GPU


class NoGpuSource:
    """A machine without GPUs: ``[{"ts": now, "no_gpu": True}]`` once, then ``[]``."""

    def __init__(self, *, clock: Clock = time.time, reason: str = "") -> None:
        self._clock = clock
        self._done = False
        self.description = "no GPU" + (f" ({reason})" if reason else "")

    def sample(self) -> list[dict]:
        if self._done:
            return []
        self._done = True
        return [{"ts": float(self._clock()), "no_gpu": True}]

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------


def open_source(
    replay_path: str | os.PathLike | None = None,
    metrics_dir: str | os.PathLike | None = None,
) -> Source:
    """The best source here: the replay if given; else NVML if ``nvmlInit`` works and sees a GPU;
    else ``nvidia-smi`` if it is on PATH and works; else ``amd-smi`` (AMD GPUs:
    :class:`sftctl.health.amd_smi.AmdSmiSource`) if it is; else :class:`NoGpuSource` (whose
    ``description`` says why the others were not used).

    Never raises on a machine without GPUs or without the NVIDIA driver. A bad replay file
    raises (see :class:`ReplaySource`).
    """
    if replay_path is not None:
        return ReplaySource(replay_path, metrics_dir=metrics_dir)
    why = []
    try:
        nvml_source = NvmlSource()
    except ImportError:
        why.append("pynvml not installed")
    except Exception as e:  # noqa: BLE001 (NVMLError and whatever a broken driver raises)
        why.append(f"nvml: {type(e).__name__}: {e}")
    else:
        if nvml_source.gpu_count > 0:
            return nvml_source
        nvml_source.close()
        why.append("nvml: 0 GPUs")
    exe = shutil.which("nvidia-smi")
    if exe is None:
        why.append("nvidia-smi not on PATH")
    else:
        try:
            return NvidiaSmiSource(exe)
        except Exception as e:  # noqa: BLE001
            why.append(f"nvidia-smi: {e}")
    amd = shutil.which("amd-smi")
    if amd is None:
        why.append("amd-smi not on PATH")
    else:
        try:
            return AmdSmiSource(amd)
        except Exception as e:  # noqa: BLE001 (a broken ROCm install is a reason, not a crash)
            why.append(f"amd-smi: {e}")
    return NoGpuSource(reason="; ".join(why))
