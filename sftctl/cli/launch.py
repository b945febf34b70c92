"""``sftctl run``, ``plan``, ``catalog`` (+ ``catalog refresh``) and ``compile``."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

import typer

from sftctl.cli.common import (
    _DEBUG,
    _complete_accelerators,
    _complete_specs,
    _console,
    _escape,
    _labels,
    _planning,
    _print_json,
    app,
)


@app.command()
def run(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec YAML file.", autocompletion=_complete_specs),
    set_: list[str] = typer.Option([], "--set", metavar="KEY.PATH=VALUE", help="Override a spec field; repeatable."),
    label: list[str] = typer.Option([], "--label", metavar="KEY=VALUE", help="Add a label (the spec's labels:, "
                                    "shown and filtered by sftctl status); repeatable."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Start a background controller and print the job id."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    quiet_logs: bool = typer.Option(False, "--no-logs", help="Attached: do not stream node logs."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the plan, what would be provisioned and each node's "
                                 "rendered scripts and environment; create and start nothing."),
) -> None:
    """Plan, provision, launch and watch a job (attached unless --detach)."""
    from sftctl import api

    # everything the job writes (state, logs, node scripts, checkpoints, local storage) is
    # owner-only, whatever the mode of an existing $SFTCTL_HOME or storage directory
    os.umask(0o077)
    set_ = [*set_, *(f"labels.{k}={v}" for k, v in _labels(label).items())]
    with _planning(stderr=True) as progress:
        if dry_run:
            doc = api.dry_run(spec_path, set_, progress=progress)
        else:
            job = api.submit(spec_path, set_, progress=progress)
    if dry_run:
        _render_dry_run(doc, as_json)
        return
    if detach:
        api.start(job.job_id)
        if as_json:
            _print_json({"job_id": job.job_id})
        else:
            print(job.job_id)
            _console(stderr=True).print(
                f"[dim]{job.plan.reason}\nwatch: sftctl status {job.job_id} --watch    logs: sftctl logs {job.job_id} --follow[/]"
            )
        return

    from rich.text import Text

    from sftctl.types import JobStatus
    from sftctl.ui import RunView, tty_safe

    console = _console(stderr=as_json)
    console.print(f"[bold]{job.job_id}[/]: {job.plan.reason}")
    from sftctl.errors import SftctlError

    # a plain script's steps are its own business: no total unless the spec says one (or trains a
    # model, which runs train.steps), as sftctl status shows "-"
    total = job.spec.train.steps if job.spec.model is not None or _sets_steps(spec_path, set_) else None
    view = RunView(console, total, show_logs=not quiet_logs, raw=_DEBUG[0]).start()
    signals = _RunSignals().install()  # before attach: the controller gives these back, not SIG_DFL
    try:
        try:
            ended = api.attach(job.job_id, _Reporting(view, signals))
        except SftctlError as e:
            view.finish()
            if as_json or not getattr(e, "detached", None):
                raise
            jid, by = e.detached  # Ctrl-C while following a job supervised elsewhere: it goes on
            _console(stderr=True).print(Text(f"{jid} goes on, supervised {by}: sftctl logs -f {jid} watches it again; "
                                             f"sftctl down {jid} stops it"), soft_wrap=True)
            raise typer.Exit(int(e.exit_code)) from None
        except BaseException:
            view.finish()
            raise
        _finish_printing(view, ended, signals)
    finally:
        signals.uninstall()
    final = ended.job
    if as_json:
        with contextlib.suppress(OSError):  # stdout closed (| head, SIGHUP): the job is over anyway
            _print_json({**final.to_dict(), "wall_s": round(ended.wall_s, 2), "exit_code": int(ended.exit_code)})
    else:
        losses = (
            f", loss {view.first_loss:.4f} -> {view.last_loss:.4f} (mean over ranks)" if view.first_loss is not None else ""
        )
        style = "green" if final.status == JobStatus.SUCCEEDED else "red"
        console.print(Text.assemble((f"{job.job_id} {final.status.value}", style), f" in {ended.wall_s:.1f} s{losses}"))
        if final.failure_reason and final.status != JobStatus.SUCCEEDED:
            console.print(Text.assemble(("reason:", "red"), " ", tty_safe(final.failure_reason)), soft_wrap=True)
    raise typer.Exit(ended.exit_code)


class _Stop(Exception):
    """A signal stopped the printing of an ended job's output (:func:`_finish_printing`)."""


class _RunSignals:
    """SIGINT, SIGTERM and SIGHUP of an attached ``sftctl run`` (each one not ignored: a run
    started in the background keeps SIG_IGN), installed before :func:`sftctl.api.attach`, so
    that when the job's controller gives the handlers back after its teardown it gives back
    these, never SIG_DFL: no moment is left where a signal kills a client whose job is over.

    While the job runs the controller's handlers are in force (SIGTERM, SIGHUP cancel it); this
    one is called only before the controller takes them, while following a job supervised
    elsewhere, or after. Its phases:

    - ``job`` (until the controller's reporter call ``ended()``): what the signal did before
      ``sftctl run`` took it (the previous handler: Ctrl-C raises KeyboardInterrupt, which
      cancels the job or stops the following; SIGTERM, SIGHUP: the default, death by the signal);
    - ``ended``: the job's outcome is recorded, its nodes down: the first signal is only kept,
      for :func:`_finish_printing` to stop the printing with at once;
    - ``printing``: the first signal raises :class:`_Stop` (a second must not cut the exit short).
    """

    def __init__(self) -> None:
        self.phase = "job"
        self.first: int | None = None  # the first signal after the job ended (a signal number)
        self.previous: dict = {}

    def install(self) -> "_RunSignals":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():  # signals are the main thread's
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        import signal

        for signum, handler in self.previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self.previous = {}

    def ended(self) -> None:
        """The controller's word that the job is over (its reporter's ``ended()``)."""
        self.phase = "ended"

    def _handle(self, signum, frame) -> None:
        import signal

        if self.phase == "job":
            handler = self.previous.get(signum)
            if callable(handler):
                handler(signum, frame)
                return
            signal.signal(signum, signal.SIG_DFL)  # the default: die by the signal, as before
            os.kill(os.getpid(), signum)
            return
        if self.first is None:
            self.first = signum
            if self.phase == "printing":
                raise _Stop


class _Reporting:
    """The reporter ``sftctl run`` attaches with: the view's (:class:`sftctl.ui.RunView`) events,
    logs and metrics, and ``ended()`` for the signals (:class:`_RunSignals`)."""

    def __init__(self, view, signals: _RunSignals) -> None:
        self.view, self.signals = view, signals

    def event(self, message: str) -> None:
        self.view.event(message)

    def log(self, rank: int, text: str) -> None:
        self.view.log(rank, text)

    def metrics(self, samples: list[dict]) -> None:
        self.view.metrics(samples)

    def ended(self) -> None:
        self.signals.ended()


def _finish_printing(view, ended, signals: _RunSignals) -> None:
    """Print the rest of an ended job's output (``view``: :class:`sftctl.ui.RunView`; ``ended``:
    :class:`sftctl.api.Attached`). The job is over: its outcome is recorded and its nodes are
    down, so Ctrl-C, SIGTERM or SIGHUP now only stop the printing: the rest is dropped (``sftctl
    logs`` has it), one line on stderr says so, and ``sftctl run`` exits with the job's own code
    at once (0 for SUCCEEDED), never turning the job into CANCELLED. A signal that came after
    the job ended, before this began (``signals.first``), stops it the same way, before it starts.
    ``signals``' handlers are in force from the job's end (:class:`_RunSignals`); the ones
    ``sftctl run`` began with are back once the printing is done."""
    signals.phase = "printing"
    try:
        if signals.first is not None:
            raise _Stop
        view.finish()
    except (KeyboardInterrupt, _Stop):
        view.abandon()
        job = ended.job
        _exit_now(ended.exit_code, f"{job.id} {job.status.value}; its output was cut short: sftctl logs {job.id} "
                                   "shows all of it\n", view.progress.stop)
    finally:
        signals.uninstall()  # the summary line after it: the handlers sftctl run began with


def _exit_now(code: int, note: str, first) -> None:
    """End this process with ``code`` now, after ``note`` on stderr, ``first()`` (the bar's end: a
    terminal gets its cursor back) and the exit handlers, all given two seconds (the printer
    thread may be stuck writing to a pipe nobody reads, holding stdout's lock: a normal exit,
    which flushes stdout, would wait on it forever)."""
    import atexit
    import sys
    import threading

    def last_words() -> None:
        with contextlib.suppress(OSError, ValueError):
            os.write(sys.stderr.fileno(), note.encode("utf-8", "replace"))
        with contextlib.suppress(Exception):  # best effort (it may wait on the same full pipe): the exit comes anyway
            first()
        atexit._run_exitfuncs()

    helper = threading.Thread(target=last_words, daemon=True)
    helper.start()
    helper.join(2.0)
    os._exit(code)


def _sets_steps(spec_path: Path, sets: list[str]) -> bool:
    """Whether the spec file or a ``--set`` gives ``train.steps``: read here, not from the job's
    spec, which a server returns with every default filled in."""
    import yaml

    if any(a.split("=", 1)[0].strip() in ("train.steps", "train") for a in sets):
        return True
    try:
        data = yaml.safe_load(spec_path.read_text())
    except (OSError, yaml.YAMLError):
        return False
    train = data.get("train") if isinstance(data, dict) else None
    return isinstance(train, dict) and "steps" in train


def _render_dry_run(doc: dict, as_json: bool) -> None:
    """``run --dry-run``: the plan, what would be provisioned, node 0's scripts in full and one
    line for the other nodes (what differs), so the output stays small for any node count;
    nothing done."""
    if as_json:
        _print_json(doc)
        return
    from rich.rule import Rule
    from rich.text import Text

    o = doc["offering"]
    others = doc.get("other_nodes")
    total = len(doc["nodes"]) + (others["count"] if others else 0)
    console = _console()
    console.print(Text(f"dry run: nothing was created or started\nplan: {doc['plan']}\n"
                       f"would provision: {total} node(s) of {o['provider']} {o['instance_type']} "
                       f"({o['accelerator']}:{o['count']}) in {o['region']}"), soft_wrap=True)
    for n in doc["nodes"]:
        if n["bootstrap"]:
            console.print(Rule(f"node {n['rank']}: first-boot script (bootstrap.sh)", align="left"))
            console.print(Text(n["bootstrap"].rstrip()), soft_wrap=True)
        console.print(Rule(f"node {n['rank']}: environment", align="left"))
        console.print(Text("\n".join(f"{k}={v}" for k, v in sorted(n["env"].items()))), soft_wrap=True)
        console.print(Rule(f"node {n['rank']}: attempt script (node.sh)", align="left"))
        console.print(Text(n["script"].rstrip()), soft_wrap=True)
    if others:
        first, last = others["ranks"]
        ranks = f"node {first}" if first == last else f"nodes {first}-{last}"
        console.print(Rule(f"{ranks}: as node 0, except", align="left"))
        console.print(Text(f"environment: {', '.join(others['env_differs']) or 'nothing'}; attempt script: "
                           f"{others['script_lines_differ']} line(s)"
                           + (f"; first-boot script: {others['bootstrap_lines_differ']} line(s)"
                              if doc["nodes"][0]["bootstrap"] else "")), soft_wrap=True)
    for sub in doc.get("submits", []):  # what the scheduler would be handed: sbatch.sh, manifests
        console.print(Rule(f"{sub['name']} (would be submitted)", align="left"))
        console.print(Text(sub["text"].rstrip()), soft_wrap=True)
    from sftctl import api

    console.print(_catalog_line(api.catalog_info()))  # wrapped at the width


@app.command()
def plan(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec YAML file.", autocompletion=_complete_specs),
    set_: list[str] = typer.Option([], "--set", metavar="KEY.PATH=VALUE", help="Override a spec field; repeatable."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    top: int = typer.Option(10, "--top", metavar="N", min=1,
                            help="Show the N best offerings, each at its cheapest region (--json has every candidate)."),
    all_rows: bool = typer.Option(False, "--all", help="Show every candidate: each region its own row."),
) -> None:
    """Rank the offerings for a job by predicted cost: step time, memory, $/step, total (offline)."""
    from sftctl import api
    from sftctl.errors import InfeasibleError
    from sftctl.ui import plan_rows, plan_table

    spec = api.load(spec_path, set_)
    try:
        with _planning(stderr=as_json) as progress:
            chosen = api.plan(spec, strict=True, progress=progress)
    except InfeasibleError as e:
        if as_json:  # the plan (scripts want the candidates and why) and the error keys of --json
            _print_json({**api.plan_doc(spec, None, e.message, e.candidates),
                         "error": e.message, "hint": e.hint, "exit_code": int(e.exit_code)})
        elif e.candidates:
            _console().print(plan_table(e.candidates, spec.train.steps, top=None if all_rows else top,
                                        script_steps="steps" not in spec.train.model_fields_set,
                                        no_step=api.no_step_time(spec, e.candidates)))
            shown = plan_rows(e.candidates, None if all_rows else top)[0]
            for note in dict.fromkeys(c.note for c in shown if getattr(c, "note", None)):
                _console().print(f"note: {_escape(note)}", soft_wrap=True)
            _console().print(_catalog_line(api.catalog_info()))  # wrapped at the width
        raise
    if as_json:
        _print_json(api.plan_doc(spec, chosen, chosen.reason, chosen.candidates))
        return
    console = _console()
    console.print(plan_table(chosen.candidates, spec.train.steps, top=None if all_rows else top,
                             script_steps="steps" not in spec.train.model_fields_set,
                             no_step=api.no_step_time(spec, chosen.candidates)))
    for note in dict.fromkeys(c.note for c in plan_rows(chosen.candidates, None if all_rows else top)[0] if c.note):
        console.print(f"note: {_escape(note)}", soft_wrap=True)
    console.print(f"[bold]{_escape(chosen.reason)}[/]", soft_wrap=True)
    if chosen.offering.source.startswith("override "):
        console.print(f"price: negotiated, {_escape(chosen.offering.source)}", soft_wrap=True)
    console.print(_catalog_line(api.catalog_info()))  # wrapped at the width


def _catalog_line(info: dict) -> str:
    """One line: the catalog's price date and age (when older than
    ``info['stale_after_days']``, in yellow with ``sftctl catalog refresh`` as the fix), and
    the override file in force. Printed once per ``plan``, ``run --dry-run`` and ``catalog``."""
    line = f"catalog: prices as of {info['as_of']} ({info['age_days']} days old)"
    if info["stale"]:
        line = (f"[yellow]{line[:-1]}, older than {info['stale_after_days']} days: "
                f"`sftctl catalog refresh` rebuilds them)[/]")
    return line + (f"; overrides from {_escape(info['overrides'])}" if info["overrides"] else "")


catalog_app = typer.Typer(help="List the offerings sftctl knows; `catalog refresh` rebuilds prices from the clouds' APIs.")
app.add_typer(catalog_app, name="catalog")


@catalog_app.callback(invoke_without_command=True)
def catalog(
    ctx: typer.Context,
    accelerator: Optional[str] = typer.Option(None, "--accelerator", "-a", help="Only this accelerator (e.g. H100), "
                                               "one row per zone with a spot price.",
                                               autocompletion=_complete_accelerators),
    region: list[str] = typer.Option([], "--region", "-r", metavar="REGION", help="Only this region; repeatable."),
    max_price: Optional[float] = typer.Option(None, "--max-price", metavar="USD", min=0,
                                              help="Only offerings at most this many USD per node-hour (on-demand)."),
    sort: Optional[str] = typer.Option(None, "--sort", metavar="price|region|instance",
                                       help="Sort the rows (default: the catalog's order)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """List the offerings sftctl knows: provider, instance, accelerators, region, prices, source."""
    if ctx.invoked_subcommand is not None:
        return
    from sftctl import api

    with _planning(stderr=True, label="reading the catalog"):
        offerings = api.catalog(accelerator, regions=region or None, max_usd_per_hour=max_price, sort=sort)
    if as_json:
        _print_json({"offerings": [o.to_dict() for o in offerings], "catalog": api.catalog_info()})
        return
    if accelerator and not offerings:
        print(f"no provider sftctl supports sells {api.accelerator_name(accelerator)} yet")
        return
    from sftctl.ui import catalog_table

    _console().print(catalog_table(offerings, zones=bool(accelerator)))
    _console().print(_catalog_line(api.catalog_info()))  # wrapped at the width


@catalog_app.command("refresh")
def catalog_refresh(
    clouds: Optional[list[str]] = typer.Argument(None, metavar="[aws] [gcp]", help="The clouds to refresh (default both)."),
    regions: Optional[str] = typer.Option(None, "--regions", metavar="R1,R2", help="Only these regions (comma-separated)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Rebuild prices, spot prices per zone and availability from the clouds' APIs with your
    credentials, into the catalog in sftctl's data dir (all or nothing: a failed refresh keeps
    the previous catalog)."""
    from sftctl import api

    wanted = [r.strip() for r in regions.split(",") if r.strip()] if regions else None
    with _planning(stderr=True, label="refreshing the catalog") as progress:
        result = api.catalog_refresh(clouds or None, wanted, progress=progress)
    if as_json:
        _print_json(result)
        return
    for cloud, n in result["clouds"].items():
        _console().print(f"{cloud}: {n['offerings']} offerings in {n['regions']} regions", soft_wrap=True)
    _console().print(f"catalog: {_escape(result['file'])} ({result['seconds']:.1f} s)", soft_wrap=True)


@app.command(name="compile")
def compile_(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec YAML file (its model is compiled).",
                                     autocompletion=_complete_specs),
    target: str = typer.Option(..., "--target", "-t", metavar="ACCELERATOR", help="Accelerator, e.g. h100, a100-80gb, mi300x, cpu.",
                                autocompletion=_complete_accelerators),
    set_: list[str] = typer.Option([], "--set", metavar="KEY.PATH=VALUE", help="Override a spec field; repeatable."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Directory for plan.json and report.md (default: ./sftctl-compile/<job>-<target>)."),
    as_json: bool = typer.Option(False, "--json", help="Print the compiled plan as JSON on stdout."),
    top: int = typer.Option(15, "--top", help="Kernels shown in the table, slowest first."),
) -> None:
    """Compile a job's whole training step for one accelerator: kernels, schedules, predicted times."""
    from sftctl import api

    console = _console(stderr=as_json)
    with _planning(stderr=True, label="compiling") as progress:
        result = api.compile(spec_path, target, set_, out=out, progress=progress)
    doc = result.doc
    if as_json:
        _print_json(doc)
        return
    from sftctl.ui import kernels_table

    compiled, spec = result.compiled, result.spec
    console.print(kernels_table(compiled.kernels, top))
    console.print(_modes_table(doc))
    times = ", ".join(f"{m} {doc['modes'][m] * 1000:.2f} ms" for m in doc["modes"])
    peak = doc["peak_memory"]["peak_bytes"]
    console.print(
        f"[bold]{spec.name} on {result.accelerator}[/]: {result.ops} ops -> {len(compiled.kernels)} kernels (sftensor); "
        f"predicted {doc['step_time_s'] * 1000:.2f} ms/step in {result.mode} mode (train.compile: {spec.train.compile}; "
        f"{times}), peak memory {peak / 2**30:.2f} GiB; "
        f"{compiled.candidates:,} schedule candidates ({compiled.scored:,} scored after pruning) in {compiled.search_s:.1f} s",
        soft_wrap=True,
    )
    learned = doc.get("learned") or {}
    if learned.get("runs") or learned.get("other_accelerator_runs"):
        others = f" and {learned['other_accelerator_runs']} on other accelerators" if learned.get(
            "other_accelerator_runs") else ""
        console.print(f"learned from {learned.get('runs') or 0} past run(s) on {result.accelerator}{others}: "
                      f"{doc['calibrated_step_s'] * 1000:.2f} ms/step (x{learned['correction']:.3f}; "
                      f"sftctl calibrate show)", soft_wrap=True)
    if not doc["fits"]:
        console.print(f"[bold red]does not fit:[/] {_escape(doc['fit_note'])}", soft_wrap=True)
    for note in doc["notes"]:
        console.print(f"note: {_escape(note)}", soft_wrap=True)
    out_dir = result.out
    console.print(f"wrote {out_dir / 'plan.json'}, {out_dir / 'report.md'} and {out_dir / 'roofline.svg'}", soft_wrap=True)


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
