"""sftctl as a Python library: everything the ``sftctl`` command does, as functions.

The CLI (:mod:`sftctl.cli`) is parsing and rendering over this module; a sweep script or a
notebook calls it directly::

    from sftctl import api

    job = api.run("examples/quickstart.yaml", overrides={"train.steps": 40}, detach=True)
    job = api.wait(job.id)                     # polls api.status until the job ends, nodes down
    print(job.status.value, job.loss)          # SUCCEEDED 2.31 (mean over the ranks' last reports)
    for line in api.logs(job.id):
        print(line)

Functions return the vocabulary of :mod:`sftctl.types` (:class:`~sftctl.types.JobRecord`,
:class:`~sftctl.types.Event`, :class:`~sftctl.types.Plan`, :class:`~sftctl.types.Offering` ...)
or the small views defined here (:class:`JobView`, :class:`LogLine`, :class:`DownResult`,
:class:`CloudCheck`, :class:`CompileResult`), and raise :class:`~sftctl.errors.SftctlError`
subclasses (:class:`~sftctl.errors.SpecError`, :class:`~sftctl.errors.NotFoundError`,
:class:`~sftctl.errors.InfeasibleError`, :class:`~sftctl.errors.ProviderError`), each with a
``hint`` and the ``exit_code`` the CLI exits with. Nothing here prints: a long step reports
through a ``progress`` callback, a condition worth a look through :mod:`warnings`
(:class:`~sftctl.errors.SftctlWarning`), node output as :class:`LogLine` values.

A ``spec`` argument is a path to a YAML file, the YAML text itself (a string with a newline, or
one that names no file), or a :class:`~sftctl.spec.JobSpec`. ``overrides`` are ``--set``'s
``key.path=value`` strings, or a mapping ``{"train.steps": 40}``. A ``job`` argument is a job id
or a unique prefix of one (or a :class:`JobView`/:class:`~sftctl.types.JobRecord`). An argument
of the wrong type raises :class:`TypeError` naming the function, the argument and what it accepts
(checked at the boundary, :func:`_typed`). Whatever takes a spec first checks every user setting
(:func:`sftctl.settings.validate_all`; exit 2).

**JSON.** Every ``--json`` document of the CLI is built here, in :meth:`JobView.to_dict`,
:func:`plan_doc`, :func:`events_doc`, :meth:`DownResult.to_dict` and :meth:`CloudCheck.to_dict`,
from the records' own ``to_dict()``; where a document differs from a record (``status``
summarizes the ranks' metrics; ``events`` leaves out each event's ``job_id``) the method says so.

Importing this module is as light as ``sftctl status``: no torch, numpy, pydantic spec model
or cloud SDK; those are imported inside the functions that need them.

The package's modules (every name is re-exported here; import from ``sftctl.api``): ``_base``
(argument types, the server flag, the store), ``_specs`` (load, plan), ``_run`` (submit,
dry_run, start, attach, run), ``_views`` (JobView, status, wait, logs, events, metrics, costs,
down), ``_secrets``, ``_tools`` (check, catalog, compile, calibrate) and ``_machines``
(machines: ``sftctl nodes``).
"""

from __future__ import annotations

from sftctl.api._base import (  # noqa: F401 (re-exported)
    JOB_ARGS, _ARGS, Overrides, Progress, SpecLike, _arg_job, _arg_labels, _arg_names, _arg_overrides,
    _arg_path, _arg_rank, _arg_spec, _arg_text, _owner_only, _reap, _remote, _resolve, _serving, _store,
    _type_name, _typed, validate_config,
)
from sftctl.api._machines import machines  # noqa: F401 (re-exported)
from sftctl.api._specs import (  # noqa: F401 (re-exported)
    _load, _override_strings, _warn_unset_references, calibration_runs, catalog_info, load, no_step_time, plan,
    plan_doc,
)
from sftctl.api._views import (  # noqa: F401 (re-exported)
    STATUS_SERIES_ROWS, WAIT_TEARDOWN_S, DownResult, JobView, LogLine, _cost, _job_rank_nodes, _labelled,
    _log_lines, _node_hours, _node_status, _nodes_released, _rank_nodes, _span, _step_time, _view, costs,
    down, down_orphans, events, events_doc, job, job_ids, logs, metrics, status, statuses, wait,
)
from sftctl.api._secrets import (
    secret_list, secret_remove, secret_set,
)
from sftctl.api._run import (  # noqa: F401 (re-exported)
    FOLLOW_POLL_S, Attached, Submitted, _Watch, _check_storage, _follow, _prepare,
    _secret_environ, _submit_remote, attach, dry_run, run, spawn_controller, start,
    submit,
)
from sftctl.api._tools import (  # noqa: F401 (re-exported)
    CATALOG_SORTS, CloudCheck, CompileResult, _calibrated_doc, accelerator_name, accelerator_names,
    calibrate_export, calibrate_forget, calibrate_import, calibrate_show, calibrate_store, catalog,
    catalog_refresh, check, compile,
)

__all__ = [
    "job", "job_ids", "load", "plan", "submit", "dry_run", "start", "attach", "run", "status", "statuses", "wait", "logs", "events",
    "down", "down_orphans", "check", "catalog", "compile", "validate_config", "costs", "metrics", "JobView", "LogLine",
    "Submitted",
    "secret_set", "secret_list", "secret_remove",
    "calibration_runs", "calibrate_import", "calibrate_show", "calibrate_export", "calibrate_forget", "calibrate_store",
    "Attached", "DownResult", "CloudCheck", "CompileResult", "plan_doc", "events_doc",
]


# ------------------------------------------------------------------------------ a server


#: True in the ``sftctl server`` process: its calls are this machine's, whatever the config names,
#: and its reads leave a job whose controller died to its Supervisor (:func:`_reap`)
#: (:mod:`sftctl.server` sets it; the controllers it starts never call this module)
SERVING = False
