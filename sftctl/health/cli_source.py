"""What the GPU sources that run a vendor's command line tool share (``nvidia-smi``,
``amd-smi``): one run per tick, its output parsed into telemetry samples, and a failing run that
says a GPU is gone turned into ``gpu_is_lost`` samples of the GPUs seen before.

Subclasses give :attr:`tool` (the name in messages), :attr:`lost_words` (lower-case phrases of
the tool's "device gone" errors), :meth:`_query` (one run) and :meth:`_parse` (stdout -> samples
with ``gpu``, raising ValueError for output that is not the tool's)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any


class CliSource:
    """The sampling loop of a GPU tool run once per tick (see the module docstring).

    Attributes:
        last_error: the last failed run's message (None after a good one).
    """

    tool = "smi"
    lost_words: tuple[str, ...] = ("gpu is lost",)

    def __init__(self, executable: str, *, run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
                 clock: Callable[[], float] = time.time, timeout_s: float = 20.0) -> None:
        self._exe, self._run, self._clock, self._timeout_s = executable, run, clock, timeout_s
        self.last_error: str | None = None
        self._known: dict[int, str | None] = {}  # GPU index -> its UUID where the tool gives one

    def _query(self) -> subprocess.CompletedProcess:
        raise NotImplementedError

    def _parse(self, stdout: str) -> list[dict]:
        raise NotImplementedError

    def _remember(self, rows: list[dict]) -> None:
        for r in rows:
            self._known.setdefault(r["gpu"], r.get("uuid"))

    def sample(self) -> list[dict]:
        """This tick's samples, sorted by GPU, ``ts`` set. A failed run returns what it could
        parse, plus ``gpu_is_lost`` samples of the GPUs seen before and missing now when the
        tool says a device is gone; it keeps the message in ``last_error`` and never raises."""
        now = float(self._clock())
        try:
            proc = self._query()
        except (OSError, subprocess.SubprocessError) as e:
            self.last_error = f"{self.tool}: {e}"
            return []
        try:
            rows = self._parse(proc.stdout)
            self.last_error = None
        except ValueError as e:
            rows, self.last_error = [], f"{self.tool}: {e}"
        if proc.returncode != 0:
            message = f"{proc.stdout}\n{proc.stderr}".strip()
            self.last_error = f"{self.tool} exit {proc.returncode}: {message[:300]}"
            if any(w in message.lower() for w in self.lost_words):
                seen = {r["gpu"] for r in rows}
                for gpu, uuid in sorted(self._known.items()):
                    if gpu not in seen:
                        lost: dict[str, Any] = {"gpu": gpu, "gpu_is_lost": True}
                        if uuid:
                            lost["uuid"] = uuid
                        rows.append(lost)
        for r in rows:
            r["ts"] = now
        self._remember(rows)
        return sorted(rows, key=lambda r: r["gpu"])

    def close(self) -> None:
        pass
