"""The ``sftctl`` command line: parse, call the core, render (rich tables or ``--json``).

Thin by design. Heavy modules (pydantic specs, the controller, torch) are imported inside the
commands that need them, so ``sftctl status`` starts fast. Exit codes: see
:class:`sftctl.errors.ExitCode`. A :class:`~sftctl.errors.SftctlError` prints one ``error:`` line
and a ``hint:`` line on stderr, never a traceback (``--debug`` shows it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from sftctl.errors import ExitCode, NotFoundError, SftctlError

app = typer.Typer(
    name="sftctl",
    help="Train models on the cheapest accelerator that can run them.",
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _console(stderr: bool = False):
    from sftctl.ui import SafeConsole

    stream = sys.stderr if stderr else sys.stdout
    # piped output is read by scripts and people alike: do not squeeze tables to 80 columns,
    # unless COLUMNS says how wide (rich reads it when width is None)
    width = None if stream.isatty() or os.environ.get("COLUMNS", "").isdigit() else 240
    # a closed pipe or terminal silences the output, never ends the command (or its job)
    return SafeConsole(stderr=stderr, highlight=False, width=width)


def _print_json(doc) -> None:
    _JSON_PRINTED[0] = True
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


def _store():
    from sftctl.state import Store

    return Store()


def _get_job(store, job_id: str) -> dict:
    """A job by id or unique id prefix. Raises NotFoundError (exit 2) otherwise.

    Every read path goes through here, so every one of them sees a dead controller: live jobs
    whose controller process is gone are marked FAILED_CONTROLLER first."""
    if not job_id.strip():
        raise NotFoundError("the job id is empty", hint="sftctl status lists the jobs")
    store.reap_dead_controllers()
    job = store.get_job(job_id)
    if job is None:
        matches = [j.id for j in store.list_jobs() if j.id.startswith(job_id)]
        if len(matches) == 1:
            return store.get_job(matches[0])
        if matches:
            raise NotFoundError(f"{job_id!r} matches {len(matches)} jobs",
                                hint=f"give more of the id: {', '.join(matches[:5])}")
        raise NotFoundError(f"no job {job_id!r}", hint="sftctl status lists the jobs")
    return job


def _plain_metavars() -> None:
    """Help shows each value as its metavar (SPEC, JOB, --node RANK), never as a Python type
    (typer prints ``<list[str]>``, ``<int>`` after every argument and option without one)."""
    from typer.core import TyperArgument, TyperOption

    TyperArgument.display_type_rich = lambda self, ctx: None

    def option_metavar(self, ctx):
        if self.metavar is not None:
            return self.metavar
        return (self.name or "value").upper().replace("_", "-")

    TyperOption.display_type_rich = option_metavar


_plain_metavars()


@app.callback(invoke_without_command=True)
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True),
    debug: bool = typer.Option(False, "--debug", help="On an error, also print the traceback (for bug reports); "
                               "accepted anywhere on the command line; exit codes stay the same."),
) -> None:
    """Train models on the cheapest accelerator that can run them."""
    if version:
        from sftctl import __version__

        print(f"sftctl {__version__}")
        raise typer.Exit(0)


# ------------------------------------------------------------------------------------ run


def _need_storage(spec, spec_path: Path, where: str) -> None:
    """Cloud nodes keep code, checkpoints and logs in the job's storage: refuse a spec without.
    Local and Slurm nodes keep them on a filesystem sftctl reads (Slurm: the cluster's own)."""
    if not set(where.split("/")) & {"local", "slurm"} and spec.storage is None:
        raise SftctlError(
            f"{spec_path}: storage: required for {where} nodes (they keep code, checkpoints and logs in the "
            "job's storage)",
            hint="add storage: s3://BUCKET/PREFIX (aws), gs://BUCKET/PREFIX (gcp) or pvc://CLAIM/PREFIX (kubernetes)",
        )


def _check_storage(storage) -> None:
    """Before anything is created: the job's storage must exist (or be created, with
    ``create_bucket``) and be writable. A plain directory is created; a ``pvc://`` claim is only
    mounted on the nodes, so it is not checked here."""
    from sftctl.storage import LocalStorage, open_storage

    s = open_storage(storage.url)
    if isinstance(s, LocalStorage) and s.mount is not None:
        return
    s.ensure(create_bucket=storage.create_bucket or isinstance(s, LocalStorage))


@app.command()
def run(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec YAML file."),
    set_: list[str] = typer.Option([], "--set", metavar="KEY.PATH=VALUE", help="Override a spec field; repeatable."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Start a background controller and print the job id."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    quiet_logs: bool = typer.Option(False, "--no-logs", help="Attached: do not stream node logs."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the plan, what would be provisioned and each node's "
                                 "rendered scripts and environment; create and start nothing."),
) -> None:
    """Plan, provision, launch and watch a job (attached unless --detach)."""
    from sftctl import procs
    from sftctl.spec import load_spec

    # everything the job writes (state, logs, node scripts, checkpoints, local storage) is
    # owner-only, whatever the mode of an existing $SFTCTL_HOME or storage directory
    os.umask(0o077)

    spec = load_spec(spec_path, set_)
    missing = [k for k in spec.secrets if k not in os.environ]
    if missing:
        from sftctl.errors import SpecError

        raise SpecError(f"{spec_path}: secrets: {', '.join(missing)} not set in this shell",
                        hint="export it before sftctl run (secrets come from your environment), or drop it from secrets")
    from sftctl.controller import check_checkpoint_dir

    check_checkpoint_dir(spec)  # another run's checkpoints would be resumed silently
    clouds = spec.resources.clouds
    if clouds is not None and "local" not in clouds:  # known before planning: say it now
        _need_storage(spec, spec_path, "/".join(clouds))
    chosen = _plan_with_progress(spec, strict=False, stderr=True)
    _need_storage(spec, spec_path, chosen.offering.provider)
    if dry_run:
        _dry_run(spec, chosen, as_json)
        return
    if spec.storage is not None:
        _check_storage(spec.storage)
    store = _store()
    job_id = store.create_job(spec.name, spec.model_dump(mode="json"), spec_path=str(spec_path.resolve()))
    store.update_job(job_id, provider=chosen.offering.provider, offering_json=chosen.to_dict())
    store.add_event(job_id, "plan", chosen.reason)
    if detach:
        import subprocess

        from sftctl.paths import job_dir

        jd = job_dir(job_id)
        jd.mkdir(parents=True, exist_ok=True)
        with open(jd / "controller.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "sftctl.controller", job_id],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True,
            )
        store.update_job(job_id, controller_pid=proc.pid, controller_start_ticks=procs.start_ticks(proc.pid))
        if as_json:
            _print_json({"job_id": job_id})
        else:
            print(job_id)
            _console(stderr=True).print(
                f"[dim]{chosen.reason}\nwatch: sftctl status {job_id} --watch    logs: sftctl logs {job_id} --follow[/]"
            )
        return

    from sftctl.controller import Controller
    from sftctl.state import JobStatus
    from sftctl.ui import RunView

    store.update_job(job_id, controller_pid=os.getpid(), controller_start_ticks=procs.start_ticks(os.getpid()))
    console = _console(stderr=as_json)
    console.print(f"[bold]{job_id}[/]: {chosen.reason}")
    started = time.monotonic()
    with RunView(console, spec.train.steps, show_logs=not quiet_logs) as view:
        controller = Controller(store, job_id, view)
        status = controller.run()
    wall_s = time.monotonic() - started
    job = _job_doc(store, store.get_job(job_id), detail=True)
    if as_json:
        with contextlib.suppress(OSError):  # stdout closed (| head, SIGHUP): the job is over anyway
            _print_json({**job, "wall_s": round(wall_s, 2)})
    else:
        losses = (
            f", loss {view.first_loss:.4f} -> {view.last_loss:.4f} (mean over ranks)" if view.first_loss is not None else ""
        )
        style = "green" if status == JobStatus.SUCCEEDED else "red"
        console.print(f"[{style}]{job_id} {status.value}[/] in {wall_s:.1f} s{losses}")
        if job["failure_reason"] and status != JobStatus.SUCCEEDED:
            console.print(f"[red]reason:[/] {job['failure_reason']}")
    code = {JobStatus.SUCCEEDED: ExitCode.OK, JobStatus.CANCELLED: ExitCode.INTERRUPTED}.get(status, ExitCode.JOB_FAILED)
    if code == ExitCode.JOB_FAILED and controller.error is not None:
        code = controller.error.exit_code  # no capacity anywhere: 3; credentials or cloud API: 4
    raise typer.Exit(int(code))


def _dry_run(spec, chosen, as_json: bool) -> None:
    """``run --dry-run``: the plan, what would be provisioned, every node's script; nothing done."""
    from sftctl.controller import preview

    doc = preview(spec, chosen.to_dict())
    o = doc["offering"]
    if as_json:
        _print_json({"dry_run": True, "job": spec.name, "plan": chosen.reason, **doc})
        return
    from rich.rule import Rule
    from rich.text import Text

    console = _console()
    console.print(Text(f"dry run: nothing was created or started\nplan: {chosen.reason}\n"
                       f"would provision: {spec.resources.nodes} node(s) of {o['provider']} {o['instance_type']} "
                       f"({o['accelerator']}:{o['count']}) in {o['region']}"), soft_wrap=True)
    for n in doc["nodes"]:
        if n["bootstrap"]:
            console.print(Rule(f"node {n['rank']}: first-boot script (bootstrap.sh)", align="left"))
            console.print(Text(n["bootstrap"].rstrip()), soft_wrap=True)
        console.print(Rule(f"node {n['rank']}: environment", align="left"))
        console.print(Text("\n".join(f"{k}={v}" for k, v in sorted(n["env"].items()))), soft_wrap=True)
        console.print(Rule(f"node {n['rank']}: attempt script (node.sh)", align="left"))
        console.print(Text(n["script"].rstrip()), soft_wrap=True)


def _plan_with_progress(spec, strict: bool, stderr: bool):
    """Run the planner; show tracing/compiling with a spinner on a terminal."""
    from sftctl.planner import Predictor, plan

    console = _console(stderr=stderr)
    predictor = None
    if spec.model is not None:
        status = console.status("planning") if console.is_terminal else None

        def progress(msg: str) -> None:
            if status is not None:
                status.update(msg)

        predictor = Predictor(spec, progress=progress, strict=strict)
        if status is not None:
            with status:
                chosen = plan(spec, predict=predictor)
        else:
            chosen = plan(spec, predict=predictor)
        if predictor.error:
            _console(stderr=True).print(f"[yellow]warning:[/] {_escape(predictor.error)}; ranking by price only", soft_wrap=True)
        return chosen
    return plan(spec)


def _plan_doc(spec, chosen, reason: str, candidates: list) -> dict:
    """``plan --json``: the same shape whether or not an offering was chosen."""
    doc = chosen.to_dict() if chosen is not None else None
    if doc is not None:
        doc.pop("candidates")
        doc.pop("reason")
    return {"job": spec.name, "objective": spec.resources.objective, "steps": spec.train.steps,
            "chosen": doc, "reason": reason, "candidates": [c.to_dict() for c in candidates]}


@app.command()
def plan(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec YAML file."),
    set_: list[str] = typer.Option([], "--set", metavar="KEY.PATH=VALUE", help="Override a spec field; repeatable."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Rank the offerings for a job by predicted cost: step time, memory, $/step, total (offline)."""
    from sftctl.errors import InfeasibleError
    from sftctl.spec import load_spec

    from sftctl.ui import plan_table

    spec = load_spec(spec_path, set_)
    try:
        chosen = _plan_with_progress(spec, strict=True, stderr=as_json)
    except InfeasibleError as e:
        if as_json:
            _print_json(_plan_doc(spec, None, e.message, e.candidates))
        elif e.candidates:
            _console().print(plan_table(e.candidates, spec.train.steps))
            for note in dict.fromkeys(c.note for c in e.candidates if getattr(c, "note", None)):
                _console().print(f"note: {_escape(note)}", soft_wrap=True)
        raise
    if as_json:
        _print_json(_plan_doc(spec, chosen, chosen.reason, chosen.candidates))
        return
    console = _console()
    console.print(plan_table(chosen.candidates, spec.train.steps))
    for note in dict.fromkeys(c.note for c in chosen.candidates if c.note):
        console.print(f"note: {_escape(note)}", soft_wrap=True)
    console.print(f"[bold]{_escape(chosen.reason)}[/]", soft_wrap=True)


@app.command()
def catalog(
    accelerator: Optional[str] = typer.Option(None, "--accelerator", "-a", help="Only this accelerator (e.g. H100)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """List the offerings sftctl knows: provider, instance, accelerators, region, prices, source."""
    from sftctl.catalog import accelerator_names, cloud_offerings, local_offering

    offerings = [local_offering(1)] + cloud_offerings()
    if accelerator:
        names = {n.lower(): n for n in accelerator_names()}
        if accelerator.lower() not in names:
            import difflib

            close = difflib.get_close_matches(accelerator, list(names.values()), n=1, cutoff=0.5)
            raise SftctlError(f"--accelerator: unknown accelerator {accelerator!r}" + (f"; did you mean '{close[0]}'?" if close else ""),
                              hint=f"known: {', '.join(names.values())}")
        offerings = [o for o in offerings if o.accelerator.lower() == accelerator.lower()]
        if not offerings and not as_json:
            print(f"no provider sftctl supports sells {names[accelerator.lower()]} yet")
            return
    if as_json:
        _print_json({"offerings": [o.to_dict() for o in offerings]})
        return
    from sftctl.ui import catalog_table

    _console().print(catalog_table(offerings))


@app.command(name="compile")
def compile_(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec YAML file (its model is compiled)."),
    target: str = typer.Option(..., "--target", "-t", metavar="ACCELERATOR", help="Accelerator, e.g. h100, a100-80gb, mi300x, cpu."),
    set_: list[str] = typer.Option([], "--set", metavar="KEY.PATH=VALUE", help="Override a spec field; repeatable."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Directory for plan.json and report.md (default: ./sftctl-compile/<job>-<target>)."),
    as_json: bool = typer.Option(False, "--json", help="Print the compiled plan as JSON on stdout."),
    top: int = typer.Option(15, "--top", help="Kernels shown in the table, slowest first."),
) -> None:
    """Compile a job's whole training step for one accelerator: kernels, schedules, predicted times."""
    from sftctl.spec import load_spec

    if not target:
        raise SftctlError("compile needs --target", hint="e.g. sftctl compile job.yaml --target h100 (sftctl catalog lists accelerators)")
    spec = load_spec(spec_path, set_)
    if spec.model is None:
        raise SftctlError(f"{spec_path}: the spec has no model to compile", hint="add model: {framework, entrypoint, batch_size, dtype}")
    from sftctl.compiler.hardware import get_accelerator
    from sftctl.planner import Predictor

    try:
        hw = get_accelerator(target)
    except KeyError as e:
        raise SftctlError(f"--target: {e.args[0]}", hint="sftctl catalog lists the accelerators") from None
    console = _console(stderr=as_json)
    predictor = Predictor(spec)
    from sftctl.compiler.driver import compile_for
    from sftctl.compiler.report import compile_doc, write_report

    with console.status(f"tracing {spec.model.entrypoint}") as st:
        graph = predictor.graph()
        st.update(f"searching schedules for {hw.name}")
        compiled = compile_for(graph, hw.name, matmul_precision=spec.model.matmul_precision)
    doc = compile_doc(compiled, graph, spec, hw, predictor.mode)
    from sftctl.planner import lacks_bf16_tensor_cores

    doc["notes"] = []
    if spec.model.dtype == "bfloat16" and lacks_bf16_tensor_cores(hw):
        fp16 = compile_for(graph, hw.name, matmul_precision=spec.model.matmul_precision,
                           mma_dtype_map={"bfloat16": "float16"})
        doc["notes"].append(
            f"{hw.name} has no bfloat16 tensor cores: bf16 matmuls run on its CUDA cores at "
            f"{hw.matrix_peak('bfloat16') / 1e12:.1f} TFLOP/s; model.dtype float16 would run them on its tensor cores "
            f"({hw.matrix_peak('float16') / 1e12:.0f} TFLOP/s): predicted {fp16.mode_time_s(predictor.mode) * 1e3:.1f} "
            f"ms/step instead of {doc['step_time_s'] * 1e3:.1f} ({predictor.mode})")
    out = out or Path("sftctl-compile") / f"{spec.name}-{hw.name.lower()}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(doc, indent=1) + "\n")
    write_report(doc, hw, out)
    if as_json:
        _print_json(doc)
        return
    from sftctl.ui import kernels_table

    console.print(kernels_table(compiled.kernels, top))
    console.print(_modes_table(doc))
    mode = predictor.mode
    times = ", ".join(f"{m} {doc['modes'][m] * 1000:.2f} ms" for m in doc["modes"])
    peak = doc["peak_memory"]["peak_bytes"]
    console.print(
        f"[bold]{spec.name} on {hw.name}[/]: {len(graph.nodes)} ops -> {len(compiled.kernels)} kernels (sftensor); "
        f"predicted {doc['step_time_s'] * 1000:.2f} ms/step in {mode} mode (train.compile: {spec.train.compile}; "
        f"{times}), peak memory {peak / 2**30:.2f} GiB; "
        f"{compiled.candidates:,} schedule candidates ({compiled.scored:,} scored after pruning) in {compiled.search_s:.1f} s",
        soft_wrap=True,
    )
    if not doc["fits"]:
        console.print(f"[bold red]does not fit:[/] {_escape(doc['fit_note'])}", soft_wrap=True)
    for note in doc["notes"]:
        console.print(f"note: {_escape(note)}", soft_wrap=True)
    console.print(f"wrote {out / 'plan.json'}, {out / 'report.md'} and {out / 'roofline.svg'}", soft_wrap=True)


def _modes_table(doc: dict):
    """``sftctl compile``: the step per execution mode, by kernel kind, phase and top modules."""
    from rich.table import Table

    det = doc["mode_details"]
    modes = [m for m in ("eager", "default", "sftensor") if m in det]
    t = Table(box=None, header_style="bold", pad_edge=False, title="predicted step per execution mode "
              f"(spec: {doc['mode']})", title_justify="left")
    t.add_column("")
    for m in modes:
        t.add_column(m.upper() + (" *" if m == doc["mode"] else ""), justify="right")

    def ms(x: float) -> str:
        return f"{x * 1e3:.2f} ms"

    t.add_row("step", *[ms(det[m]["compute_time_s"]) for m in modes])
    t.add_row("kernels", *[str(det[m].get("kernels", "-")) for m in modes])
    t.add_row("peak memory", *[f"{det[m]['peak_bytes'] / 2**30:.2f} GiB" for m in modes])
    t.add_row("MFU", *[f"{100 * det[m].get('mfu', 0):.1f}%" for m in modes])
    unit = doc["per_step"]["unit"]
    t.add_row(f"{unit}/s", *[f"{det[m]['throughput']['per_s']:,.0f}" for m in modes])
    for key, label in (("by_phase", "phase"), ("by_kind", "kind")):
        for k in dict.fromkeys(k for m in modes for k in det[m].get(key, {})):
            t.add_row(f"{label}: {k}", *[ms(det[m].get(key, {}).get(k, 0.0)) for m in modes])
    top = list(det[doc["mode"]].get("by_module", {}))[:6]
    for k in top:
        t.add_row(f"module: {k}", *[ms(det[m].get("by_module", {}).get(k, 0.0)) for m in modes])
    return t


# ------------------------------------------------------------------------------------ status


def _job_doc(store, job, detail: bool = False, ranks: list | None = None) -> dict:
    """A job as the JSON document ``status --json`` prints (and the table renders)."""
    from sftctl.types import JobStatus

    if ranks is None:
        ranks = store.metrics(job.id)
    res = job.spec["resources"]
    offering = job.offering
    where = (
        f"{offering.provider} {offering.accelerator}:{offering.count} x{res['nodes']}"
        if offering else f"x{res['nodes']}"
    )
    steps = [r.step for r in ranks]
    losses = [r.loss for r in ranks if r.loss is not None]
    tps = [r.tokens_per_s for r in ranks if r.tokens_per_s is not None]
    doc = {
        "id": job.id,
        "name": job.name,
        "status": job.status.value,
        "resources": where,
        "provider": job.provider,
        "nodes": res["nodes"],
        "step": min(steps) if steps else None,
        # a plain shell job that reports no metrics has no step count to show
        "steps": job.spec["train"]["steps"] if job.spec.get("model") or ranks else None,
        "loss": sum(losses) / len(losses) if losses else None,
        "tokens_per_s": sum(tps) if tps else None,
        "restarts": job.restarts,
        "failure_reason": job.failure_reason,
        "pending_reason": job.pending_reason if job.status == JobStatus.PENDING else None,
        "created_at": job.created_at,
        "ended_at": job.ended_at,
        "controller_pid": job.controller_pid,
    }
    if detail:
        doc["plan"] = job.plan_reason
        doc["ranks"] = [r.to_dict() for r in ranks]
        doc["nodes"] = [
            {"id": n.id, "rank": n.rank, "status": _node_status(job, n),
             "where": n.handle.get("ip") or n.provider}
            for n in store.nodes(job.id)
        ]
        doc["attempts"] = [a.to_dict() for a in store.attempts(job.id)]
        doc["health"] = [{"ts": e.ts, "message": e.message, **(e.data or {})}
                         for e in store.events(job.id) if e.kind == "health"]
    return doc


TABLE_ROWS = 50  # rich renders ~1.5k rows/s; a person reads the newest jobs first


def _newest(jobs: list[dict]) -> list[dict]:
    """Every live job, then the newest finished ones, up to TABLE_ROWS rows (newest first)."""
    from sftctl.state import JobStatus

    live = {j["id"] for j in jobs if not JobStatus(j["status"]).terminal}
    finished = [j["id"] for j in jobs if j["id"] not in live][: max(0, TABLE_ROWS - len(live))]
    keep = live | set(finished)
    return [j for j in jobs if j["id"] in keep]


def _node_status(job: dict, node: dict) -> str:
    """The node's recorded status, or, when its controller is gone, what the provider sees now."""
    from sftctl.types import JobStatus

    if job.status != JobStatus.FAILED_CONTROLLER or node.status == "TERMINATED" or not node.handle:
        return node.status
    from sftctl.controller import job_provider

    return job_provider(job, node.provider).status(node.handle).state.value


@app.command()
def check(
    clouds: list[str] = typer.Argument(None, metavar="CLOUD", help="aws, gcp, kubernetes, local (default: all)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Say per cloud whether its credentials work here, and if not, why and what to set.

    Exit code 0 when at least one cloud (besides local) works or only local was asked, else 4.
    """
    from concurrent.futures import ThreadPoolExecutor

    from sftctl.providers import PROVIDERS, configured, get_provider

    names = clouds or list(PROVIDERS)
    for n in names:
        if n not in PROVIDERS:
            raise SftctlError(f"unknown cloud {n!r}", hint=f"clouds: {', '.join(PROVIDERS)}")

    def one(name: str) -> dict:
        why = configured(name)
        if why is not None:
            return {"cloud": name, "ok": False, "reason": why, "hint": None}
        try:
            get_provider(name).check()
            return {"cloud": name, "ok": True, "reason": None, "hint": None}
        except SftctlError as e:
            return {"cloud": name, "ok": False, "reason": e.message, "hint": e.hint}

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        rows = list(pool.map(one, names))
    if as_json:
        _print_json({"clouds": rows})
    else:
        from rich.table import Table

        table = Table(box=None, pad_edge=False)
        for col in ("CLOUD", "OK", "DETAIL"):
            table.add_column(col)
        for r in rows:
            detail = {"local": "usable here", "slurm": "sinfo answers"}.get(r["cloud"], "credentials work") if r["ok"] else r["reason"] + (f" (hint: {r['hint']})" if r["hint"] else "")
            table.add_row(r["cloud"], "[green]yes[/]" if r["ok"] else "[red]no[/]", _escape(detail))
        _console().print(table)
    clouds_ok = [r for r in rows if r["ok"] and r["cloud"] != "local"]
    if not clouds_ok and any(r["cloud"] != "local" for r in rows):
        raise typer.Exit(int(ExitCode.PROVIDER))


@app.command()
def status(
    job_id: Optional[str] = typer.Argument(None, metavar="[JOB]", help="One job (its id or a unique prefix)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every second until the job ends (Ctrl-C stops)."),
    all_: bool = typer.Option(False, "--all", "-a", help=f"Table: every job, not only the newest {TABLE_ROWS}."),
) -> None:
    """Show jobs: status, resources, step, loss, throughput (--json: every job)."""
    from sftctl.state import JobStatus

    store = _store()

    def collect():
        store.reap_dead_controllers()
        if job_id:
            return _job_doc(store, _get_job(store, job_id), detail=True)
        by_job: dict[str, list[dict]] = {}
        for r in store.metrics():
            by_job.setdefault(r.job_id, []).append(r)
        return [_job_doc(store, j, ranks=by_job.get(j.id, [])) for j in store.list_jobs()]

    def render(doc):
        from rich.console import Group

        from sftctl.ui import job_detail, jobs_table

        if job_id:
            return Group(*job_detail(doc))
        if not doc:
            return "no jobs yet: sftctl run examples/quickstart.yaml"
        shown = doc if all_ else _newest(doc)
        more = len(doc) - len(shown)
        return Group(jobs_table(shown), f"... and {more} older finished job(s): sftctl status --all") if more else jobs_table(shown)

    if job_id is not None:
        _get_job(store, job_id)  # fail early on an unknown or ambiguous id
    doc = collect()
    if as_json:
        # --watch --json: wait for the job to end, then print the one document
        while watch and job_id and not JobStatus(doc["status"]).terminal:
            time.sleep(1.0)
            doc = collect()
        _print_json(doc if job_id else {"jobs": doc})
        return
    console = _console()
    if not watch:
        console.print(render(doc))
        return
    if not console.is_terminal:  # a pipe: print each state as it changes (Live would wait to the end)
        last = None
        while True:
            if doc != last:
                console.print(render(doc))
                sys.stdout.flush()
                last = doc
            if job_id and JobStatus(doc["status"]).terminal:
                return
            time.sleep(1.0)
            doc = collect()
    from rich.live import Live

    with Live(render(doc), console=console, refresh_per_second=4) as live:
        while not (job_id and JobStatus(doc["status"]).terminal):
            time.sleep(1.0)
            doc = collect()
            live.update(render(doc))


# ------------------------------------------------------------------------------------ logs


@app.command()
def logs(
    job_id: str = typer.Argument(..., metavar="JOB"),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
    node: Optional[int] = typer.Option(None, "--node", "-n", metavar="RANK", help="Only this node rank."),
) -> None:
    """Print a job's node logs (each line prefixed with its node when there are several)."""
    from sftctl.controller import job_provider
    from sftctl.providers.base import NodeState
    from sftctl.state import JobStatus

    store = _store()
    job = _get_job(store, job_id)
    ranks = job.spec["resources"]["nodes"]
    if node is not None and not 0 <= node < ranks:
        which = "node 0" if ranks == 1 else f"nodes 0-{ranks - 1}"
        raise SftctlError(f"--node {node}: job {job.id} has {ranks} node(s): {which}",
                          hint=f"sftctl logs {job.id} --node 0 (or no --node: every node)")
    provider = job_provider(job)
    offsets: dict[str, int] = {}
    partial: dict[str, str] = {}
    while True:
        nodes = [n for n in store.nodes(job.id) if node is None or n.rank == node]
        got = False
        for n in nodes:
            data, offsets[n.id] = provider.read_log(n.handle, offsets.get(n.id, 0)) if n.handle.get("node_id") else (b"", 0)
            if not data:
                continue
            got = True
            lines = (partial.get(n.id, "") + data.decode("utf-8", "replace")).split("\n")
            partial[n.id] = lines.pop()
            prefix = f"(node {n.rank}) " if node is None and len(nodes) > 1 else ""
            sys.stdout.write("".join(f"{prefix}{line}\n" for line in lines))
        sys.stdout.flush()
        if not follow:
            break
        store.reap_dead_controllers()
        now = store.get_job(job.id)
        if now.status == JobStatus.FAILED_CONTROLLER:
            # nobody supervises the nodes any more: following them could last forever
            _console(stderr=True).print(f"[yellow]warning:[/] {_escape(now.failure_reason or 'the controller died')}",
                                        soft_wrap=True)
            break
        ended = now.status.terminal
        if ended and not got and not any(
            provider.status(n.handle).state == NodeState.RUNNING for n in nodes
            if n.handle.get("pid") or n.handle.get("attempt")
        ):
            break  # the job ended and no node process writes any more (a dead controller's may)
        time.sleep(0.5)
    for nid, rest in partial.items():
        if rest:
            sys.stdout.write(rest + "\n")


# ------------------------------------------------------------------------------------ down


@app.command()
def down(
    job_id: Optional[str] = typer.Argument(None, metavar="[JOB]"),
    all_: bool = typer.Option(False, "--all", help="Every job that is not finished, and their nodes."),
    orphans: bool = typer.Option(False, "--orphans", help="Resources on any configured cloud whose job is gone or ended."),
    purge: bool = typer.Option(False, "--purge", help="Then remove what sftctl wrote for the job: its storage "
                               "prefix (checkpoints, logs, metrics), the workdir pack it uploaded, its local "
                               "directory. Never the bucket, other objects or your train.checkpoint_dir."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Cancel a job and remove its nodes (also after its controller died); --purge its storage too."""
    from sftctl.controller import down as down_job
    from sftctl.controller import purge as purge_job
    from sftctl.state import TERMINAL

    if orphans:
        if job_id or all_ or purge:
            raise SftctlError("--orphans takes no JOB, --all or --purge", hint="sftctl down --orphans")
        from sftctl.controller import down_orphans

        swept = down_orphans(_store())
        if as_json:
            _print_json({"orphans": swept})
        else:
            for line in swept or ["no orphaned resources"]:
                print(line)
        return
    if bool(job_id) == all_:
        raise SftctlError("give one JOB or --all", hint="sftctl down JOB, or sftctl down --all, or sftctl down --orphans")
    store = _store()
    if all_:
        store.reap_dead_controllers()
        ids = [
            j.id for j in store.list_jobs()
            if j.status not in TERMINAL or any(n.status != "TERMINATED" for n in store.nodes(j.id))
        ]
    else:
        ids = [_get_job(store, job_id).id]
    summaries = [down_job(store, i) for i in ids]
    purged = [purge_job(store, i) for i in ids] if purge else [None] * len(ids)  # down first, in this call
    if as_json:
        _print_json({"down": [{"job_id": i, "status": store.get_job(i).status.value, "summary": s,
                               **({"purged": p} if p is not None else {})}
                              for i, s, p in zip(ids, summaries, purged)]})
    else:
        for s, p in zip(summaries, purged):
            print(s)
            if p is not None:
                print(f"{p['job_id']}: purged {p['objects']} object(s), {p['bytes'] / 2**20:.1f} MiB"
                      + "".join(f"; kept {k['where']} ({k['why']})" for k in p["kept"]))
        if not summaries:
            print("nothing to take down")


# ------------------------------------------------------------------------------------ events


@app.command()
def events(
    job_id: str = typer.Argument(..., metavar="JOB"),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Show a job's history: plan, transitions, nodes, restarts, teardown."""
    store = _store()
    job = _get_job(store, job_id)
    evs = [{k: e.to_dict()[k] for k in ("id", "ts", "kind", "message", "data")} for e in store.events(job.id)]
    if as_json:
        _print_json({"job_id": job.id, "events": evs})
    else:
        from sftctl.ui import events_table

        _console().print(events_table(evs))


# ------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Maps errors to exit codes; ``--debug`` anywhere shows tracebacks.

    Every error prints ``error:`` and ``hint:`` lines on stderr; with ``--json`` it also prints
    one JSON object on stdout, ``{"error", "hint", "exit_code"}``, unless the command already
    printed its document (``plan --json`` of an infeasible job prints the plan).
    """
    from typer._click.exceptions import ClickException

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    as_json = "--json" in args
    _JSON_PRINTED[0] = False

    def fail(message: str, hint: str | None, code: int) -> int:
        if debug:
            import traceback

            traceback.print_exc()
        from rich.text import Text

        err = _console(stderr=True)
        # Text, not markup: a message quoting user input prints "[bold]" and ":smile:" as typed
        err.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)
        if hint:
            err.print(Text(f"hint: {hint}", style="dim"), soft_wrap=True)
        if as_json and not _JSON_PRINTED[0]:
            with contextlib.suppress(OSError):
                _print_json({"error": message, "hint": hint, "exit_code": int(code)})
        return int(code)

    try:
        rv = app(args=args, prog_name="sftctl", standalone_mode=False)
        return int(rv or 0)
    except typer.Exit as e:
        return e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        return fail("interrupted", None, ExitCode.INTERRUPTED)
    except ClickException as e:  # usage: unknown option, missing argument, bad value
        code = getattr(e, "exit_code", ExitCode.USAGE) or ExitCode.USAGE
        ctx = getattr(e, "ctx", None)
        hint = f"{ctx.command_path} --help shows the options" if ctx is not None else "sftctl --help"
        return fail(e.format_message(), hint, code)
    except SftctlError as e:
        return fail(e.message, e.hint, e.exit_code)
    except sqlite3.DatabaseError as e:  # a state.db damaged (or held) after it was opened
        from sftctl.paths import sftctl_home

        path = sftctl_home() / "state.db"
        if isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "busy" in str(e)):
            return fail(f"{path}: the state database stayed locked by another process: {e}",
                        "retry; if it persists, look for a process holding it (fuser state.db)", ExitCode.USAGE)
        return fail(f"{path}: the state database is damaged: {e}",
                    f"move it aside (mv {path} {path}.bad) and sftctl starts a new one; "
                    "sftctl down --orphans removes cloud resources of jobs it no longer knows", ExitCode.USAGE)


_JSON_PRINTED = [False]  # whether this invocation printed its JSON document already


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


if __name__ == "__main__":
    sys.exit(main())
