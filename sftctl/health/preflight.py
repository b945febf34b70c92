"""What the preflight (:mod:`sftctl.preflight`) costs and when it runs: pure, for the planner and
the controller (no torch, no compiler, no I/O).

``health.preflight`` in the spec is ``off``, ``quick`` or ``full``; unset it is ``quick`` on
nodes with accelerators and ``off`` on CPU-only nodes (a laptop's local job is not worth seconds
of checks; a GPU node that costs dollars an hour is). With ``health.enabled: false`` it is off.
"""

from __future__ import annotations

LEVELS = ("off", "quick", "full")

#: seconds one preflight takes, stated (measured on this repository's machines: the CPU quick
#: check is ~5 s, torch's import most of it; a GPU's adds CUDA's start and the GEMMs, and
#: NVIDIA documents ``dcgmi diag -r 1`` as seconds and ``-r 2`` as about two minutes)
SECONDS = {"quick": 15.0, "full": 45.0}
DCGM_SECONDS = {1: 15.0, 2: 120.0}


def level(spec_level: str | None, accelerator: str, enabled: bool = True) -> str:
    """The preflight level of a job: ``spec_level`` (``health.preflight``) when set, else
    ``quick`` where ``accelerator`` is not the CPU, else ``off``; ``off`` when health is off."""
    if not enabled:
        return "off"
    if spec_level is not None:
        return spec_level
    return "off" if accelerator.lower() == "cpu" else "quick"


def dcgm_level(hours: float | None, long_job_h: float) -> int:
    """``dcgmi diag -r`` level: 2 for a job predicted longer than ``long_job_h`` hours, else 1."""
    return 2 if hours is not None and hours > long_job_h else 1


def periodic(lvl: str, hours: float | None, long_job_h: float) -> bool:
    """Whether a job checks its nodes at every checkpoint: a preflight on, and predicted longer
    than ``long_job_h`` hours (off on short jobs)."""
    return lvl != "off" and hours is not None and hours > long_job_h


def estimate_s(lvl: str, accelerator: str, hours: float | None = None, long_job_h: float = 4.0) -> float:
    """Seconds one preflight adds before the first step (the plan adds them to its hours): the
    level's stated time, plus ``dcgmi diag``'s on a GPU node. 0 when off."""
    if lvl == "off":
        return 0.0
    s = SECONDS[lvl]
    if accelerator.lower() != "cpu":
        s += DCGM_SECONDS[dcgm_level(hours, long_job_h)]
    return s
