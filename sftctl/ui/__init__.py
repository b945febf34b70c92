"""What people see: rich tables for jobs, nodes, events and plans, and the attached run's progress.

Rendering only; no state is changed here. ``--json`` documents are built in :mod:`sftctl.api`; these
tables render the same documents. A package split along its seams; this module re-exports every
public name (``from sftctl.ui import plan_table`` is the one way in): views.py (FitTable, the
job/event/catalog/kernel tables, tty_safe, series_plot), run.py (the attached run's RunView,
TorchNoise, log_line), plan.py (``sftctl plan``'s table: plan_rows, plan_table).
"""

from sftctl.ui.plan import plan_rows, plan_table
from sftctl.ui.run import RunView, TorchNoise, log_line
from sftctl.ui.views import (
    PLOT_STYLES,
    STATUS_STYLE,
    Col,
    FitTable,
    SafeConsole,
    calibration_table,
    catalog_table,
    events_table,
    job_detail,
    jobs_table,
    kernels_table,
    labels_text,
    refused_words,
    series_plot,
    step_time_cells,
    tty_safe,
)

__all__ = [
    "PLOT_STYLES", "STATUS_STYLE", "Col", "FitTable", "RunView", "SafeConsole", "TorchNoise", "calibration_table",
    "catalog_table", "events_table", "job_detail", "jobs_table", "kernels_table", "labels_text", "log_line", "plan_rows",
    "plan_table", "refused_words", "series_plot", "step_time_cells", "tty_safe",
]
