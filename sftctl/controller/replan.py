"""Re-plan at a checkpoint (``resources.replan``, issue 35 item 3): is another offering of the
job's plan cheaper per token than what this one measures, by more than moving costs?

After warm-up (at least :data:`MIN_MEASURED` reports of the job's newest :data:`WINDOW_ROWS`,
each rank's first :data:`sftctl.history.WARMUP_STEPS` after every (re)start and checkpoint steps
left out: :func:`sftctl.history.measured_step_s`), :func:`judge` compares, per step (the global
batch, hence the tokens of a step, is the same on every offering):

* **here**: the measured step (s) x the plan's price of the current offering (USD/h, all nodes);
* **there**: each feasible alternative of the stored plan (``JobRecord.plan.candidates``): its
  calibrated prediction (``calibrated_step_s``, the model corrected by the run history when the
  job was planned; else ``step_time_s``) x its price;
* **moving**, priced as the spot model prices a preemption (:func:`sftctl.planner._with_spot_loss`):
  the lost work, half a ``train.checkpoint_interval`` at the measured step, paid here, plus
  ``resources.spot.relaunch_s`` (provisioning, boot, checkpoint restore; default 600 s) paid at
  the alternative's price.

The best alternative is worth it when ``steps left x (here - there) > moving``; the saving is
the difference. Figures per token (USD per million tokens) where the job reports
``tokens_per_s`` (tokens of a step: the sum over ranks of each rank's median
``tokens_per_s x step_time_s``), else per step.

:class:`Replanner` asks at most every :data:`CHECK_S` seconds and says it once per job (a
``replan`` event; a restarted controller finds it and stays quiet). ``suggest`` stops there;
``migrate`` has the controller move the job at its next checkpoint
(:meth:`sftctl.controller.lifecycle.Controller.run`). Light: only the state and history modules.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from sftctl.history import measured_step_s
from sftctl.types import Offering, Plan

#: seconds between two looks at the job's steps (each look reads up to WINDOW_ROWS rows)
CHECK_S = 2.0
#: the newest reported rows (all ranks together) the measured step is taken from
WINDOW_ROWS = 400
#: reports after warm-up needed before the measurement is trusted to re-plan on
MIN_MEASURED = 5


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What :func:`judge` found: every figure of the comparison (USD, seconds, steps).

    ``worth``: the best alternative saves more than moving costs (``saving_usd`` > 0)."""

    current: Offering
    alternative: Offering
    measured_step_s: float
    measured_steps: int
    alternative_step_s: float
    usd_per_hour: float
    alternative_usd_per_hour: float
    usd_per_step: float
    alternative_usd_per_step: float
    tokens_per_step: float | None
    steps_left: int
    lost_work_s: float
    relaunch_s: float
    move_usd: float
    saving_usd: float

    @property
    def worth(self) -> bool:
        return self.saving_usd > 0

    def per_mtok(self, usd_per_step: float) -> float | None:
        """USD per million tokens at ``usd_per_step``; None when the job reports no tokens."""
        return usd_per_step / self.tokens_per_step * 1e6 if self.tokens_per_step else None

    def to_dict(self) -> dict:
        """The ``replan`` event's data: every figure, the offerings as ``provider:instance_type@region``."""
        name = lambda o: f"{o.provider}:{o.instance_type}@{o.region}"  # noqa: E731
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return d | {"current": name(self.current), "alternative": name(self.alternative),
                    "usd_per_mtok": self.per_mtok(self.usd_per_step),
                    "alternative_usd_per_mtok": self.per_mtok(self.alternative_usd_per_step)}

    def message(self, mode: str) -> str:
        here, there = self.per_mtok(self.usd_per_step), self.per_mtok(self.alternative_usd_per_step)
        unit = (lambda v: f"${v:.4g}/Mtok") if here is not None else None
        cost = (unit(here), unit(there)) if unit else (f"${self.usd_per_step:.4g}/step", f"${self.alternative_usd_per_step:.4g}/step")
        a = self.alternative
        text = (f"replan: measured {self.measured_step_s * 1e3:.1f} ms/step on {self.current.provider} "
                f"{self.current.instance_type} = {cost[0]}; {a.provider} {a.instance_type} in {a.region} predicts "
                f"{self.alternative_step_s * 1e3:.1f} ms/step = {cost[1]}; moving costs ${self.move_usd:.4g} "
                f"({self.relaunch_s:g} s to provision and restore + {self.lost_work_s:.0f} s of lost steps); "
                f"over the {self.steps_left} steps left it saves ${self.saving_usd:.4g}")
        if mode == "migrate":
            return text + "; migrating at the next checkpoint"
        return text + "; resources.replan: migrate would move the job at its next checkpoint"


def tokens_per_step(samples) -> float | None:
    """Tokens one step processes, all ranks together: the sum over ranks of each rank's median
    ``tokens_per_s x step_time_s``; None when no rank reports both."""
    per_rank: dict[int, list[float]] = {}
    for s in samples:
        if s.tokens_per_s and s.step_time_s and s.tokens_per_s > 0 and s.step_time_s > 0:
            per_rank.setdefault(int(s.rank or 0), []).append(s.tokens_per_s * s.step_time_s)
    return sum(statistics.median(v) for v in per_rank.values()) if per_rank else None


def judge(plan: Plan, spec, samples) -> Verdict | None:
    """Compare the measured step on the plan's current offering with the plan's best feasible
    alternative (module docstring). ``samples``: the job's newest StepRecords, oldest first per
    rank. None when there is nothing to compare: too few steps after warm-up, no price here, or
    no alternative with a price and a predicted step."""
    measured, n = measured_step_s(samples)
    if measured is None or n < MIN_MEASURED:
        return None
    here = plan.offering
    price = plan.planned("usd_per_hour")
    if price is None:
        return None
    best = None
    for c in plan.candidates:
        step = c.calibrated_step_s or c.step_time_s
        if c.rejected is not None or c.offering == here or c.usd_per_hour is None or not step:
            continue
        if best is None or c.usd_per_hour * step < best[0].usd_per_hour * best[1]:
            best = (c, step)
    if best is None:
        return None
    alt, alt_step = best
    done = max((s.step for s in samples), default=0)
    left = max(0, int(spec.train.steps) - int(done))
    rules = spec.resources.spot_rules
    lost_work_s = spec.train.checkpoint_interval * measured / 2
    move = lost_work_s * price / 3600 + rules.relaunch_s * alt.usd_per_hour / 3600
    per_step, alt_per_step = price * measured / 3600, alt.usd_per_hour * alt_step / 3600
    return Verdict(current=here, alternative=alt.offering, measured_step_s=measured, measured_steps=n,
                   alternative_step_s=alt_step, usd_per_hour=price, alternative_usd_per_hour=alt.usd_per_hour,
                   usd_per_step=per_step, alternative_usd_per_step=alt_per_step,
                   tokens_per_step=tokens_per_step(samples), steps_left=left, lost_work_s=lost_work_s,
                   relaunch_s=rules.relaunch_s, move_usd=move, saving_usd=left * (per_step - alt_per_step) - move)


class Replanner:
    """One job's ``resources.replan`` at run time: :meth:`check` once per poll."""

    def __init__(self, store, job_id: str, spec):
        self.store, self.job_id, self.spec = store, job_id, spec
        self.mode = spec.resources.replan
        self.said = any(e.kind == "replan" for e in store.events(job_id))  # once per job, across controllers
        self._next = 0.0

    def check(self, plan: Plan) -> Verdict | None:
        """The verdict worth acting on, recorded as a ``replan`` event (once per job), else
        None. Reads the job's newest steps at most every :data:`CHECK_S` seconds."""
        if self.mode == "off" or self.said or time.monotonic() < self._next:
            return None
        self._next = time.monotonic() + CHECK_S
        v = judge(plan, self.spec, self.store.step_series(self.job_id, last=WINDOW_ROWS))
        if v is None or not v.worth:
            return None
        self.said = True
        self.store.add_event(self.job_id, "replan", v.message(self.mode), v.to_dict() | {"mode": self.mode})
        return v
