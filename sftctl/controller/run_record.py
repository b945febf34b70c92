"""The run history a job leaves when it ends (a mixin, :class:`RunRecording`, of
:class:`~sftctl.controller.lifecycle.Controller`): the job's predicted and measured step time
recorded once (:func:`sftctl.history.record_run`), or, for a measurement beyond
:data:`~sftctl.controller.common.MEASURED_MAX_FACTOR` either way of the model's prediction, a
``measured`` event saying why it is not kept.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from sftctl.controller.common import MEASURED_MAX_FACTOR, off_prediction, ratio_words
from sftctl.history import job_run, record_run
from sftctl.state import Store


class RunRecording:
    """The Controller's :meth:`_record_run` (its attributes declared here for the type checker;
    the Controller sets them)."""

    store: Store
    job_id: str
    reporter: Any
    _moved_at: float | None
    _run_recorded: bool

    def _record_run(self) -> None:
        """The job's predicted and measured step time into the run history the next plans learn
        from (:func:`sftctl.history.record_run`); a failure here is logged, never the job's. Once: before SUCCEEDED/FAILED (a status read then shows ACTUAL).

        A measurement beyond :data:`~sftctl.controller.common.MEASURED_MAX_FACTOR` either way
        of the model's prediction (a clock glitch's 1e308 s or 1e-9 s; the bound ``calibrate
        import`` applies, :func:`~sftctl.controller.common.off_prediction`) is not kept: a
        ``measured`` event says so and why (data: ``kept`` false, ``measured_s``, ``model_s``,
        ``ratio``, null beyond a float, ``max_factor``, ``measured_steps``)."""
        if self._run_recorded:
            return
        self._run_recorded = True
        try:
            # after a migration only the new offering's steps measure it
            series = self.store.step_series(self.job_id, after=self._moved_at)
            if self._glitched_measurement(series):
                return
            message = record_run(self.store, self.job_id, series=series)
            if message is not None:
                self.reporter.event(message)
        except Exception as e:  # noqa: BLE001 the history is a by-product: the job's own ending goes on
            logging.getLogger("sftctl.controller").warning("run history not recorded: %r", e)

    def _glitched_measurement(self, series: list) -> bool:
        """True, after a ``measured`` event saying why it is not kept, when the job's measured
        step over its reported steps ``series`` (:func:`sftctl.history.job_run`, as
        :func:`~sftctl.history.record_run` takes it) lies beyond
        :data:`~sftctl.controller.common.MEASURED_MAX_FACTOR` of the model's."""
        row = job_run(self.store.get_job(self.job_id), series)
        ratio = None if row is None else off_prediction(row.measured_step_s, row.predicted_step_s)
        if row is None or ratio is None:
            return False
        message = (f"step time: measured {row.measured_step_s:g} s, not kept in the run history: "
                   f"{ratio_words(ratio)} the model's {row.predicted_step_s * 1e3:.3g} ms; more than "
                   f"{MEASURED_MAX_FACTOR:g}x either way is a clock glitch or a bad report, not a measurement")
        self.store.add_event(self.job_id, "measured", message, {
            "kept": False, "measured_s": row.measured_step_s, "model_s": row.predicted_step_s,
            "ratio": ratio if math.isfinite(ratio) else None, "max_factor": MEASURED_MAX_FACTOR,
            "measured_steps": row.measured_steps})
        self.reporter.event(message)
        return True
