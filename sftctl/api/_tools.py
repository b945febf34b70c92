"""The api's clouds, catalog, compiler and calibration (see :mod:`sftctl.api`): :func:`check`,
:func:`catalog`, :func:`catalog_refresh`, :func:`compile`, ``calibrate``'s functions."""

from __future__ import annotations

import contextlib
import importlib
import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from sftctl.api._base import Overrides, Progress, SpecLike, _remote, _store, _typed
from sftctl.api._specs import _load, calibration_runs
from sftctl.errors import ExitCode, ProviderError, SftctlError
from sftctl.types import Offering, Record


# ------------------------------------------------------------------------------ clouds and catalog


@dataclasses.dataclass(frozen=True)
class CloudCheck(Record):
    """Whether a cloud's credentials work here; if not, why (``reason``) and what to set
    (``hint``). ``to_dict()`` is a row of ``sftctl check --json``'s ``clouds``."""

    cloud: str
    ok: bool
    reason: str | None = None
    hint: str | None = None


@_typed
def check(clouds: str | Sequence[str] | None = None) -> list[CloudCheck]:
    """Ask each cloud (``clouds``: one name or a list; default: every provider) whether it works
    from here, in parallel.

    Raises:
        SftctlError: an unknown cloud name (exit 2).
    """
    from concurrent.futures import ThreadPoolExecutor

    from sftctl.providers import checked_class, configured, get_provider
    from sftctl.providers import entry as provider_entry
    from sftctl.providers import names as provider_names

    known = provider_names()
    names = list(clouds or known)
    for n in names:
        if n not in known:
            raise SftctlError(f"unknown cloud {n!r}", hint=f"clouds: {', '.join(known)}")

    def one(name: str) -> CloudCheck:
        why = configured(name)
        if why is not None:
            return CloudCheck(name, False, why)
        try:
            get_provider(name).check()
            return CloudCheck(name, True)
        except SftctlError as e:
            return CloudCheck(name, False, e.message, e.hint)

    # each configured provider's module and its SDK are imported here, one at a time: imports
    # in several threads at once can deadlock (_DeadlockError) where a package imports its own
    # submodule (sftctl.catalog's __init__ imports sftctl.catalog.identity, which the providers
    # import), or see a half-initialised module (google.cloud.compute_v1 and kubernetes both
    # import requests: "cannot import name 'parse_dict_header' from partially initialized module")
    for n in names:
        if configured(n) is None:
            with contextlib.suppress(SftctlError, ImportError):
                checked_class(n)
                sdk = provider_entry(n).sdk
                if sdk is not None:
                    importlib.import_module(sdk)
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        return list(pool.map(one, names))


#: ``catalog(sort=...)``'s keys: the on-demand price per node-hour, the region, the instance type
CATALOG_SORTS = ("price", "region", "instance")


@_typed
def catalog(accelerator: str | None = None, *, regions: Sequence[str] | None = None,
            max_usd_per_hour: float | None = None, sort: str | None = None) -> list[Offering]:
    """The offerings sftctl knows (this machine first), optionally of one accelerator
    (case-insensitive), in ``regions`` only, at most ``max_usd_per_hour`` (on-demand, USD per
    node-hour), sorted by ``sort`` (one of :data:`CATALOG_SORTS`; None: the catalog's order).

    Raises:
        SftctlError: an accelerator the catalog does not know, with a did-you-mean; a region no
            offering is in; an unknown sort key (exit 2).
    """
    from sftctl.catalog import cloud_offerings, local_offering

    offerings = [local_offering(1)] + cloud_offerings()
    if accelerator:
        name = accelerator_name(accelerator)
        offerings = [o for o in offerings if o.accelerator.lower() == name.lower()]
    if regions:
        known = {o.region for o in [local_offering(1)] + cloud_offerings()}
        unknown = [r for r in regions if r not in known]
        if unknown:
            import difflib

            near = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            raise SftctlError(f"catalog --region {unknown[0]}: no offering is in this region",
                              hint=f"did you mean {near[0]}?" if near else "sftctl catalog lists every region",
                              exit_code=ExitCode.USAGE)
        offerings = [o for o in offerings if o.region in regions]
    if max_usd_per_hour is not None:
        offerings = [o for o in offerings if o.usd_per_hour <= max_usd_per_hour]
    if sort is not None:
        keys = {"price": lambda o: (o.usd_per_hour, o.region), "region": lambda o: (o.region, o.usd_per_hour),
                "instance": lambda o: (o.provider, o.instance_type, o.usd_per_hour)}
        if sort not in keys:
            raise SftctlError(f"catalog --sort {sort}: not a sort key", hint=f"one of {', '.join(CATALOG_SORTS)}",
                              exit_code=ExitCode.USAGE)
        offerings = sorted(offerings, key=keys[sort])
    return offerings


@_typed
def catalog_refresh(clouds: list[str] | None = None, regions: list[str] | None = None, *,
                    progress: Callable[[str], None] | None = None, workers: int = 16) -> dict:
    """Rebuild the catalog of ``clouds`` (default aws and gcp) from their APIs with the user's
    credentials (:mod:`sftctl.providers.prices`), narrowed to ``regions`` when given, and store it
    in the user's data dir (``$SFTCTL_HOME/catalog.csv``), which ``catalog`` and ``plan`` then use.
    All or nothing: any cloud that fails (credentials, a call still throttled after the retries, no
    offerings at all) raises and the previous catalog stays whole.

    Returns:
        ``{"file": path, "seconds": wall time, "clouds": {cloud: {"offerings": n, "regions": n}}}``.
    Raises:
        SftctlError: an unknown cloud (exit 2); CredentialsError (exit 4); ProviderError.
    """
    from concurrent.futures import ThreadPoolExecutor

    from sftctl.catalog import write_refreshed
    from sftctl.providers import prices

    clouds = list(dict.fromkeys(clouds or ["aws", "gcp"]))
    fns = {"aws": prices.aws_rows, "gcp": prices.gcp_rows}
    bad = [c for c in clouds if c not in fns]
    if bad:
        raise SftctlError(f"catalog refresh: no price list for cloud {bad[0]!r}",
                          hint="clouds with price APIs: aws, gcp (Kubernetes and Slurm report what they have)")
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(clouds)) as pool:
        futures = {c: pool.submit(fns[c], regions, workers=workers, progress=progress) for c in clouds}
        done = {c: f.result() for c, f in futures.items()}
    rows = {c: got for c, (got, _) in done.items()}
    for c, got in rows.items():
        if not got:
            raise ProviderError(f"{c}: the refresh found no GPU offerings"
                                + (f" in {', '.join(regions)}" if regions else ""),
                                hint="the previous catalog is kept; check --regions and the account's access")
    path = write_refreshed([r for got in rows.values() for r in got],
                           {c: (None if regions is None else read) for c, (_, read) in done.items()})
    return {"file": str(path), "seconds": round(time.monotonic() - start, 1),
            "clouds": {c: {"offerings": len(got), "regions": len({r["region"] for r in got})}
                       for c, got in rows.items()}}


def accelerator_names() -> list[str]:
    """Every accelerator name sftctl knows (offered, or in the hardware table), sorted."""
    from sftctl.catalog import accelerator_names as names

    return names()


def accelerator_name(name: str) -> str:
    """The catalog's spelling of an accelerator name (``h100`` -> ``H100``).

    Raises:
        SftctlError: unknown, with a did-you-mean (exit 2).
    """
    from sftctl.catalog import accelerator_names
    from sftctl.catalog.accelerators import suggest_accelerators

    names = {n.lower(): n for n in accelerator_names()}
    if name.lower() not in names:
        close = suggest_accelerators(name, list(names.values()))
        raise SftctlError(f"--accelerator: unknown accelerator {name!r}"
                          + (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""),
                          hint=f"known: {', '.join(names.values())}")
    return names[name.lower()]


# ------------------------------------------------------------------------------ compile


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """A job's whole training step compiled for one accelerator.

    ``doc`` is ``compile --json``'s document (also written to ``out/plan.json``, with
    ``out/report.md`` and ``out/roofline.svg``); ``compiled`` the
    :class:`sftctl.compiler.step.CompiledStep` (kernels, schedules, search statistics);
    ``ops`` the traced graph's node count; ``mode`` the execution mode the spec runs in.
    """

    doc: dict
    out: Path
    compiled: Any
    ops: int
    accelerator: str
    mode: str
    spec: Any = None  # the JobSpec compiled

    def to_dict(self) -> dict:
        return self.doc


@_typed
def compile(spec: SpecLike, target: str, overrides: Overrides = (), *, out: str | os.PathLike | None = None,  # noqa: A001
            progress: Progress | None = None) -> CompileResult:
    """Compile a job's whole training step for ``target`` (an accelerator name: h100,
    a100-80gb, mi300x, cpu): kernels, schedules, predicted step time per execution mode, peak
    memory; write ``plan.json``, ``report.md`` and ``roofline.svg`` under ``out`` (default
    ``./sftctl-compile/<job>-<accelerator>``).

    The step is one data-parallel rank's, as the launcher runs it and ``plan`` prices it:
    ``model.batch_size`` split over ``resources.nodes`` x the spec's count of ``target`` per node
    (:func:`sftctl.planner.per_rank_batch`; a target the spec does not name: its first entry's
    count); the gradient all-reduce is ``plan``'s, per offering.

    Raises:
        SpecError: invalid spec (exit 2).
        SftctlError: no ``target``, no ``model`` in the spec, an unknown accelerator, or a
            ``model.batch_size`` that does not split over the ranks (exit 2).
    """
    import json

    if not target:
        raise SftctlError("compile needs --target", hint="e.g. sftctl compile job.yaml --target h100 (sftctl catalog lists accelerators)")
    s, label, _ = _load(spec, overrides)
    if s.model is None:
        raise SftctlError(f"{label}: the spec has no model to compile", hint="add model: {framework, entrypoint, batch_size, dtype}")
    from sftctl.compiler.report import compile_doc, write_report
    from sftctl.compiler.target import load_target
    from sftctl.planner import Predictor, _Unsplittable, per_rank_batch

    try:
        loaded = load_target(target)
    except KeyError as e:
        raise SftctlError(f"--target: {e.args[0]}", hint="sftctl catalog lists the accelerators") from None
    hw = loaded.hw
    say = progress or (lambda msg: None)
    predictor = Predictor(s, progress=say)
    per_node, named = _accelerators_per_node(s, hw.name)
    nodes = s.resources.nodes
    try:  # one rank's share, as plan prices each offering and the launcher runs it
        per_rank = per_rank_batch(s.model.batch_size, per_node, nodes)
    except _Unsplittable as e:
        raise SftctlError(f"{label}: {e} ({nodes} node(s) x {per_node} {hw.name} each)",
                          hint="make model.batch_size a multiple of nodes x accelerators per node") from None
    graph = predictor.graph(per_rank)
    compiled = predictor.compile(hw.name, per_rank)
    doc = compile_doc(compiled, graph, s, hw, predictor.mode, ranks=per_node * nodes)
    doc["notes"] = [predictor.notes[hw.name]] if hw.name in predictor.notes else []
    if per_node * nodes > 1 or not named:
        doc["notes"].insert(0, (
            f"one data-parallel rank of {per_node * nodes}: batch {per_rank} of model.batch_size {s.model.batch_size}, "
            f"{nodes} node(s) x {per_node} {hw.name} "
            + ("as resources says" if named else f"(resources names no {hw.name}: {per_node} per node as its first entry, "
               f"{s.resources.accelerators[0]})")
            + "; sftctl plan adds the gradient all-reduce"))
    # data-dependent sizes (boolean-mask selects, MoE dispatch) were priced at a bound: say which
    doc["notes"] += ["assumed " + n.attrs["assumption"] + " (set model.mask_fraction / model.expert_capacity)"
                     for n in graph.nodes if "assumption" in n.attrs]
    doc["notes"] += [n.attrs["note"] for n in graph.nodes if "note" in n.attrs]  # what the trace leaves out
    # where the model read a tensor's value while traced (a data-dependent branch, .numpy(), a NaN check)
    doc["notes"] += ["assumed " + a for n in graph.nodes for a in n.attrs.get("trace_assumptions", ())]
    doc.update(_calibrated_doc(doc["step_time_s"], hw.name, predictor.mode, compiled))
    where = Path(out) if out is not None else Path("sftctl-compile") / f"{s.name}-{hw.name.lower()}"
    where.mkdir(parents=True, exist_ok=True)
    (where / "plan.json").write_text(json.dumps(doc, indent=1) + "\n")
    write_report(doc, hw, where)
    return CompileResult(doc, where, compiled, len(graph.nodes), hw.name, predictor.mode, s)


def _accelerators_per_node(spec: Any, accelerator: str) -> tuple[int, bool]:
    """How many ``accelerator`` devices (worker processes for ``cpu``) each node of ``spec``'s
    job runs, and whether ``resources.accelerators`` names it: its first entry of that
    accelerator (any case), else the count of the list's first entry (the spec's shape on
    another accelerator)."""
    for acc in spec.resources.accelerators:
        if acc.name.lower() == accelerator.lower():
            return acc.count, True
    return spec.resources.accelerators[0].count, False


def _calibrated_doc(step_time_s: float, accelerator: str, mode: str, compiled: Any) -> dict:
    """``compile --json``'s learned figures: ``calibrated_step_s`` (the model's ``step_time_s``
    corrected by the run history on ``accelerator``, :func:`sftctl.history.calibrate`),
    ``calibrated_interval_s`` and the evidence ``{"runs", "other_accelerator_runs", "weight",
    "correction", "sources", "error", "prior_error"}`` under ``learned``."""
    from sftctl.history import calibrate, kernel_mix

    got = calibrate(step_time_s, accelerator, calibration_runs(), mode=mode, features=kernel_mix(compiled.kernels))
    return {"calibrated_step_s": got["calibrated_step_s"], "calibrated_interval_s": got["interval_s"],
            "learned": {k: got[k] for k in ("runs", "other_accelerator_runs", "weight", "correction", "sources", "error",
                                            "prior_error")}}


@_typed
def calibrate_import(file: str | os.PathLike, *, progress: Progress | None = None) -> dict:
    """Import measured runs from ``file`` (JSON Lines; :func:`sftctl.history_import.read_import` gives
    the formats; also :func:`calibrate_export`'s lines): each record's model prediction is
    computed here (the specs are files on this machine), then every row is stored at once, on
    the configured server if there is one. Records already in the run history (the same
    measurement: :func:`sftctl.history_import.not_present`) are skipped, so importing a file twice adds
    nothing. Returns ``{"imported": n, "skipped": k, "labels": [...]}``.

    Raises:
        SpecError: a bad line (``FILE:LINE: what``; exit 2), a measured step beyond
            :data:`~sftctl.controller.common.MEASURED_MAX_FACTOR` of its prediction among them:
            nothing of the file is imported.
    """
    from sftctl.history_import import import_file, not_present, read_exported
    from sftctl.types import RunRecord

    try:
        rows = read_exported(file)
        exported = rows is not None
        if rows is None:
            rows = import_file(file, progress=progress)
    except OverflowError:  # an integer beyond a float's range (1e400 written out)
        raise _overflowing_line(Path(file)) from None
    _check_factors(rows, [f"{file}:{no}" for no in _record_lines(Path(file))])
    remote = _remote()
    if remote is not None:
        existing = [RunRecord.from_dict(r) for r in remote.request("GET", "/v1/calibrate")["runs"]]
    else:
        existing = _store().runs()
    new = not_present(rows, existing, exported)
    n = 0
    if new and remote is not None:
        n = remote.request("POST", "/v1/calibrate/runs", read_s=None, json={"runs": [r.to_dict() for r in new]})["imported"]
    elif new:
        n = _store().add_runs(new)
    return {"imported": n, "skipped": len(rows) - len(new), "labels": sorted({r.source_label or "-" for r in rows})}


_IMPORT_HINT = "nothing of the file was imported; fix the line and import again"


def _record_lines(p: Path) -> list[int]:
    """The line numbers (1-based) of the records of import file ``p``, in order: the lines that
    are neither blank nor ``#`` comments, as :func:`sftctl.history_import.read_import` and
    :func:`~sftctl.history_import.read_exported` number them (one row each)."""
    text = p.read_text(encoding="utf-8").splitlines()
    return [no for no, t in enumerate(text, 1) if t.strip() and not t.strip().startswith("#")]


def _check_factors(rows: list, where: list[str]) -> None:
    """Refuse the import when a row of ``rows`` (:class:`~sftctl.types.RunRecord` each) has a
    measured / predicted step beyond :data:`sftctl.controller.common.MEASURED_MAX_FACTOR`
    either way (:func:`~sftctl.controller.common.off_prediction`, the bound a job's own
    measurement meets too); ``where`` names each row in the message (``FILE:LINE``, ``runs[i]``).

    Raises:
        SpecError: ``WHERE: measured_step_s M s is R x the model's P ...`` (exit 2).
    """
    from sftctl.controller.common import MEASURED_MAX_FACTOR, off_prediction, ratio_words
    from sftctl.errors import SpecError

    for at, r in zip(where, rows):
        m, pred = r.measured_step_s, r.predicted_step_s
        ratio = off_prediction(m, pred)
        if ratio is None:
            continue
        shape = f"{r.accelerator}:{r.gpus_per_node}" + (f" x {r.nodes}" if r.nodes != 1 else "")
        raise SpecError(f"{at}: measured_step_s {m:g} s is {ratio_words(ratio)} the model's {pred * 1000:.3g} ms for "
                        f"this step on {shape}; more than {MEASURED_MAX_FACTOR:g}x either way is a unit slip "
                        "(milliseconds for seconds?) or another spec, not a measurement", hint=_IMPORT_HINT)


def _overflowing_line(p: Path) -> Exception:
    """The error for import file ``p`` holding an integer too large for a float: ``FILE:LINE:
    FIELD is too large a number`` (exit 2), the first such line and field."""
    import json

    from sftctl.errors import SpecError

    for no, text in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        try:
            d = json.loads(text)
        except ValueError:
            continue
        for key, v in (d.items() if isinstance(d, dict) else ()):
            if isinstance(v, int) and abs(v) > 1e300:
                return SpecError(f"{p}:{no}: {key} is too large a number ({len(str(abs(v)))} digits); seconds are "
                                 "a number such as 0.52", hint=_IMPORT_HINT)
    return SpecError(f"{p}: a number too large for a float", hint=_IMPORT_HINT)


def calibrate_store(rows: Any) -> int:
    """Store imported run-history rows (checked: :func:`sftctl.history_import.check_rows`) all at once
    in this machine's state: the server's end of ``calibrate import``. Returns the count.

    Raises:
        SpecError: a row is not a measured run, or one measured beyond
            :data:`~sftctl.controller.common.MEASURED_MAX_FACTOR` of its prediction
            (``runs[i]: what``; exit 2); nothing is stored.
    """
    from sftctl.errors import SpecError
    from sftctl.history_import import check_rows

    try:
        checked = check_rows(rows)
    except OverflowError:  # an integer beyond a float's range
        raise SpecError("runs: a number too large for a float", hint=_IMPORT_HINT) from None
    _check_factors(checked, [f"runs[{i}]" for i in range(len(checked))])
    return _store().add_runs(checked)


def calibrate_show() -> dict:
    """``calibrate show --json``: ``{"runs": [row, ...], "summary": [group, ...]}``: every run
    (``source`` ``run``: this lab's jobs; ``imported``: from a file) and, per accelerator,
    offering and source, the median measured / predicted (:func:`sftctl.history_import.summary`)."""
    from sftctl.history_import import summary

    runs = calibration_runs()
    return {"runs": [r.to_dict() for r in runs], "summary": summary(runs)}


def calibrate_export() -> list[dict]:
    """Every run of the history, oldest first, as the lines ``calibrate export`` writes (one JSON
    object each; ``calibrate import`` reads them back as they are, without predicting again)."""
    keep = ("accelerator", "count", "gpus_per_node", "nodes", "provider", "instance_type", "region", "mode", "strategy",
            "predicted_step_s", "interval_low_s", "interval_high_s", "measured_step_s", "measured_steps", "features",
            "name", "source", "source_label", "ts", "job_id")
    return [{k: getattr(r, k) for k in keep} for r in calibration_runs()]


@_typed
def calibrate_forget(*, imported: bool = False, source: str | None = None) -> int:
    """Delete runs from the history: every imported one (``imported``) and/or those of
    ``source`` (a source label); returns how many. On a server only an admin may.

    Raises:
        SftctlError: neither given (exit 2).
    """
    if not imported and not source:
        raise SftctlError("calibrate forget needs --imported or --source S",
                          hint="sftctl calibrate show lists the sources")
    remote = _remote()
    if remote is not None:
        return remote.request("POST", "/v1/calibrate/forget", json={"imported": imported, "source": source})["forgotten"]
    return _store().forget_runs(source="imported" if imported else None, source_label=source or None)
