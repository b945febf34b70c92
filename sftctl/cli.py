"""The ``sftctl`` command line: parsing and rendering over :mod:`sftctl.api`.

Each command parses its options, calls :mod:`sftctl.api` and renders what it returns: rich
tables (:mod:`sftctl.ui`) for people, or with ``--json`` the api's documents
(``JobView.to_dict()``, ``plan_doc``, ``events_doc`` ...; built in :mod:`sftctl.api`, never
here). No orchestration lives here. Heavy modules (pydantic specs, the controller, torch) are
imported inside the api's functions, and a plain ``sftctl status`` skips typer's parsing (see
:func:`_plain_status`), so it starts fast. Exit codes: see
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

from sftctl.errors import ExitCode, SftctlError

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


# ------------------------------------------------------------------------ shell completion
# Each runs inside the user's shell at <TAB>: quick, and silent on any error (no traceback).


def _complete_jobs(incomplete: str) -> list[str]:
    """Job ids of this $SFTCTL_HOME, newest first, that start with what was typed."""
    try:
        from sftctl import api

        return [v.id for v in api.status() if v.id.startswith(incomplete)]
    except Exception:  # noqa: BLE001 (a damaged or locked state: no completions, never a traceback)
        return []


def _complete_accelerators(incomplete: str) -> list[str]:
    """Accelerator names (``--target``, ``--accelerator``), in the case typed."""
    try:
        from sftctl import api

        names = api.accelerator_names()
    except Exception:  # noqa: BLE001
        return []
    low = incomplete.lower()
    return [n.lower() if incomplete.islower() else n for n in names if n.lower().startswith(low)]


def _complete_specs(incomplete: str) -> list[str]:
    """Spec paths: directories (to descend into) and ``*.yaml`` / ``*.yml`` files."""
    import glob

    out = []
    for p in sorted(glob.glob(glob.escape(incomplete) + "*")):
        if os.path.isdir(p):
            out.append(p.rstrip("/") + "/")
        elif p.endswith((".yaml", ".yml")):
            out.append(p)
    return out


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True),
    debug: bool = typer.Option(False, "--debug", help="On an error, also print the traceback (for bug reports); "
                               "accepted anywhere on the command line; exit codes stay the same."),
) -> None:
    """Train models on the cheapest accelerator that can run them."""
    if version:
        from sftctl import __version__

        print(f"sftctl {__version__}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is not None and not _HELP[0]:
        # every command reads the config file (state's lock timeout, clouds, slurm:): check it
        # as a whole first, so a mistake in it is the same exit 2 whatever the command
        from sftctl import api

        api.validate_config()


# ------------------------------------------------------------------------------------ run


@contextlib.contextmanager
def _planning(stderr: bool, label: str = "planning"):
    """A ``progress`` callback for :mod:`sftctl.api` that drives a spinner on a terminal; the
    api's :class:`~sftctl.errors.SftctlWarning`\\ s are printed as ``warning:`` lines after."""
    import warnings

    from sftctl.errors import SftctlWarning

    console = _console(stderr=stderr)
    status = console.status(label) if console.is_terminal else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SftctlWarning)
        if status is None:
            yield lambda msg: None
        else:
            with status:
                yield status.update
    for w in caught:
        if issubclass(w.category, SftctlWarning):
            _console(stderr=True).print(f"[yellow]warning:[/] {_escape(str(w.message))}", soft_wrap=True)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


@app.command()
def run(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec YAML file.", autocompletion=_complete_specs),
    set_: list[str] = typer.Option([], "--set", metavar="KEY.PATH=VALUE", help="Override a spec field; repeatable."),
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
    with RunView(console, job.spec.train.steps, show_logs=not quiet_logs) as view:
        ended = api.attach(job.job_id, view)
    final = ended.job
    if as_json:
        with contextlib.suppress(OSError):  # stdout closed (| head, SIGHUP): the job is over anyway
            _print_json({**final.to_dict(), "wall_s": round(ended.wall_s, 2)})
    else:
        losses = (
            f", loss {view.first_loss:.4f} -> {view.last_loss:.4f} (mean over ranks)" if view.first_loss is not None else ""
        )
        style = "green" if final.status == JobStatus.SUCCEEDED else "red"
        console.print(Text.assemble((f"{job.job_id} {final.status.value}", style), f" in {ended.wall_s:.1f} s{losses}"))
        if final.failure_reason and final.status != JobStatus.SUCCEEDED:
            console.print(Text.assemble(("reason:", "red"), " ", tty_safe(final.failure_reason)), soft_wrap=True)
    raise typer.Exit(ended.exit_code)


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
) -> None:
    """Rank the offerings for a job by predicted cost: step time, memory, $/step, total (offline)."""
    from sftctl import api
    from sftctl.errors import InfeasibleError
    from sftctl.ui import plan_table

    spec = api.load(spec_path, set_)
    try:
        with _planning(stderr=as_json) as progress:
            chosen = api.plan(spec, strict=True, progress=progress)
    except InfeasibleError as e:
        if as_json:  # the plan (scripts want the candidates and why) and the error keys of --json
            _print_json({**api.plan_doc(spec, None, e.message, e.candidates),
                         "error": e.message, "hint": e.hint, "exit_code": int(e.exit_code)})
        elif e.candidates:
            _console().print(plan_table(e.candidates, spec.train.steps))
            for note in dict.fromkeys(c.note for c in e.candidates if getattr(c, "note", None)):
                _console().print(f"note: {_escape(note)}", soft_wrap=True)
            _console().print(_catalog_line(api.catalog_info()))  # wrapped at the width
        raise
    if as_json:
        _print_json(api.plan_doc(spec, chosen, chosen.reason, chosen.candidates))
        return
    console = _console()
    console.print(plan_table(chosen.candidates, spec.train.steps))
    for note in dict.fromkeys(c.note for c in chosen.candidates if c.note):
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
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """List the offerings sftctl knows: provider, instance, accelerators, region, prices, source."""
    if ctx.invoked_subcommand is not None:
        return
    from sftctl import api

    with _planning(stderr=True, label="reading the catalog"):
        offerings = api.catalog(accelerator)
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
    with console.status("compiling") as st:
        result = api.compile(spec_path, target, set_, out=out, progress=st.update)
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


# ------------------------------------------------------------------------------------ status


TABLE_ROWS = 50  # rich renders ~1.5k rows/s; a person reads the newest jobs first


def _newest(jobs: list[dict]) -> list[dict]:
    """Every live job, then the newest finished ones, up to TABLE_ROWS rows (newest first)."""
    from sftctl.types import JobStatus

    live = {j["id"] for j in jobs if not JobStatus(j["status"]).terminal}
    finished = [j["id"] for j in jobs if j["id"] not in live][: max(0, TABLE_ROWS - len(live))]
    keep = live | set(finished)
    return [j for j in jobs if j["id"] in keep]


@app.command()
def check(
    clouds: list[str] = typer.Argument(None, metavar="CLOUD", help="aws, gcp, kubernetes, local (default: all)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Say per cloud whether its credentials work here, and if not, why and what to set.

    Exit code 0 when every cloud named works, or, with none named, when at least one (local
    counts) works; else 4. The table (--json: the document) shows every cloud either way.
    """
    from sftctl import api

    rows = api.check(clouds or None)
    failed = (not all(r.ok for r in rows)) if clouds else not any(r.ok for r in rows)
    if as_json:
        doc = {"clouds": [r.to_dict() for r in rows]}
        if failed:  # as every failing --json command: what went wrong, what to do, the exit code
            bad = [r for r in rows if not r.ok]
            doc.update(error="; ".join(f"{r.cloud}: {r.reason}" for r in bad),
                       hint="; ".join(f"{r.cloud}: {r.hint}" for r in bad if r.hint) or None,
                       exit_code=int(ExitCode.PROVIDER))
        _print_json(doc)
    else:
        from rich.table import Table

        table = Table(box=None, pad_edge=False)
        for col in ("CLOUD", "OK", "DETAIL"):
            table.add_column(col)
        for r in rows:
            detail = {"local": "usable here", "slurm": "sinfo answers"}.get(r.cloud, "credentials work") if r.ok else r.reason + (f" (hint: {r.hint})" if r.hint else "")
            table.add_row(r.cloud, "[green]yes[/]" if r.ok else "[red]no[/]", _escape(detail))
        _console().print(table)
    if failed:
        raise typer.Exit(int(ExitCode.PROVIDER))


@app.command()
def status(
    job_id: Optional[str] = typer.Argument(None, metavar="[JOB]", help="One job (its id or a unique prefix).",
                                            autocompletion=_complete_jobs),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every second until the job ends (Ctrl-C stops)."),
    all_: bool = typer.Option(False, "--all", "-a", help=f"Table: every job, not only the newest {TABLE_ROWS}."),
    all_users: bool = typer.Option(False, "--all-users", help="With a server: every user's jobs (its admins only)."),
) -> None:
    """Show jobs: status, resources, step, loss, throughput (--json: every job)."""
    from sftctl import api
    from sftctl.types import JobStatus

    def collect():
        if job_id is not None:
            return api.status(job_id).to_dict()
        return [v.to_dict() for v in api.status(all_users=all_users)]

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

    doc = collect()  # an unknown or ambiguous id fails here, before anything is drawn
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
    job_id: str = typer.Argument(..., metavar="JOB", autocompletion=_complete_jobs),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
    node: Optional[int] = typer.Option(None, "--node", "-n", metavar="N", help="Only this node (its node rank)."),
    rank: Optional[int] = typer.Option(None, "--rank", "-r", metavar="R", help="Only the node that runs training "
                                       "rank R (the rendezvous assigns them: sftctl status JOB shows rank -> node)."),
    exit_code: bool = typer.Option(False, "--exit-code", help="Follow until the job ends, then exit as `sftctl wait` "
                                   "does: 0 if it SUCCEEDED, 1 if it ended otherwise."),
) -> None:
    """Print a job's node logs (each line prefixed with its node when there are several)."""
    from sftctl import api

    from sftctl.ui import tty_safe

    follow = follow or exit_code
    on_tty = sys.stdout.isatty()  # a terminal obeys escapes in node output: show them instead
    if node is not None and rank is not None:
        raise SftctlError("--node and --rank both pick a node: give one", hint=f"sftctl logs {job_id} --rank {rank}")
    for line in api.logs(job_id, follow=follow, node=node, rank=rank):
        if line.notice:  # the controller died: following the nodes could last forever
            sys.stdout.flush()
            _console(stderr=True).print(f"[yellow]warning:[/] {_escape(line.text)}", soft_wrap=True)
            continue
        sys.stdout.write(f"{tty_safe(str(line)) if on_tty else line}\n")
        if follow:
            sys.stdout.flush()
    sys.stdout.flush()
    if exit_code:
        from sftctl.types import JobStatus

        raise typer.Exit(0 if api.status(job_id).status == JobStatus.SUCCEEDED else int(ExitCode.JOB_FAILED))


@app.command()
def wait(
    job_ids: list[str] = typer.Argument(..., metavar="JOB...", help="Job ids (or unique prefixes).",
                                   autocompletion=_complete_jobs),
    timeout: Optional[float] = typer.Option(None, "--timeout", metavar="SECONDS", help="Give up after this long: "
                                            f"exit {int(ExitCode.TIMEOUT)}, the jobs go on."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout: {\"jobs\": [status of each]}."),
) -> None:
    """Wait until every job ends and its nodes are down: exit 0 if all SUCCEEDED, 1 if one did
    not, 124 on --timeout.

    Prints one line per job (id, status, reason) as the jobs end, in the order given.
    """
    from sftctl import api
    from sftctl.types import JobStatus

    ids = [api.status(j).id for j in job_ids]  # an unknown or ambiguous id fails before any wait
    end = None if timeout is None else time.monotonic() + timeout
    views = []
    for j in ids:
        try:
            views.append(api.wait(j, timeout_s=None if end is None else max(0.0, end - time.monotonic())))
        except TimeoutError as e:
            raise SftctlError(f"{e} (sftctl wait --timeout {timeout:g})", hint=f"the job goes on: sftctl status {j}",
                              exit_code=ExitCode.TIMEOUT) from None
        if not as_json:
            v = views[-1]
            print(f"{v.id} {v.status.value}" + (f": {v.failure_reason}" if v.failure_reason and v.status != JobStatus.SUCCEEDED else ""),
                  flush=True)
    if as_json:
        _print_json({"jobs": [v.to_dict() for v in views]})
    if any(v.status != JobStatus.SUCCEEDED for v in views):
        raise typer.Exit(int(ExitCode.JOB_FAILED))


# ------------------------------------------------------------------------------------ down


@app.command()
def down(
    job_id: Optional[str] = typer.Argument(None, metavar="[JOB]", autocompletion=_complete_jobs),
    all_: bool = typer.Option(False, "--all", help="Every job that is not finished, and their nodes."),
    orphans: bool = typer.Option(False, "--orphans", help="Resources on any configured cloud whose job is gone or ended."),
    purge: bool = typer.Option(False, "--purge", help="Then remove what sftctl wrote for the job: its storage "
                               "prefix (checkpoints, logs, metrics), the workdir pack it uploaded, its local "
                               "directory. Never the bucket, other objects or your train.checkpoint_dir."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Cancel a job and remove its nodes (also after its controller died); --purge its storage too."""
    from sftctl import api

    if orphans:
        if job_id or all_ or purge:
            raise SftctlError("--orphans takes no JOB, --all or --purge", hint="sftctl down --orphans")
        checked: list[str] = []
        swept = api.down_orphans(checked)
        if as_json:
            _print_json({"orphans": swept, "checked": checked})
            return
        for line in swept:
            print(line)
        clouds = [c for c in checked if c != "local"]
        if not clouds:
            print("no cloud is configured, so no cloud was checked (sftctl check says what each needs); "
                  + ("local: no orphaned node processes" if not swept else "local: swept as above"))
        elif not swept:
            print(f"no orphaned resources on {', '.join(checked)}")
        return
    with _planning(stderr=True, label="taking down") as progress:  # a spinner says what a long one waits on
        results = api.down(job_id, all=all_, purge=purge, progress=progress)
    if as_json:
        _print_json({"down": [r.to_dict() for r in results]})
        return
    for r in results:
        print(r.summary)
        p = r.purged
        if p is not None:
            print(f"{p['job_id']}: purged {p['objects']} object(s), {p['bytes'] / 2**20:.1f} MiB"
                  + "".join(f"; kept {k['where']} ({k['why']})" for k in p["kept"]))
    if not results:
        print("nothing to take down")


# ------------------------------------------------------------------------------------ events


@app.command()
def events(
    job_id: str = typer.Argument(..., metavar="JOB", autocompletion=_complete_jobs),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Show a job's history: plan, transitions, nodes, restarts, teardown."""
    from sftctl import api

    job = api.job(job_id)
    doc = api.events_doc(job.id, api.events(job.id))
    if as_json:
        _print_json(doc)
    else:
        from sftctl.ui import events_table

        _console().print(events_table(doc["events"]))


# ------------------------------------------------------------------------------------ server

server_app = typer.Typer(help="Run the sftctl server: one place for a team's jobs (sftctl server start).",
                         no_args_is_help=True)
app.add_typer(server_app, name="server")
user_app = typer.Typer(help="The server's users and their tokens.", no_args_is_help=True)
server_app.add_typer(user_app, name="user")


@server_app.command("start")
def server_start(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8470, "--port", help="Port to listen on."),
) -> None:
    """Serve the API here until stopped; run the controllers of the jobs submitted to it and,
    first, give every unfinished job without a live controller one."""
    from sftctl.server import serve

    os.umask(0o077)
    serve(host, port)


@user_app.command("add")
def server_user_add(
    name: str = typer.Argument(..., metavar="NAME"),
    admin: bool = typer.Option(False, "--admin", help="May see and stop every user's jobs (status --all-users)."),
) -> None:
    """Create a user of this machine's server and print its token (once: only its hash is kept)."""
    from sftctl.server.users import add_user

    token = add_user(name, admin)
    print(token)
    _console(stderr=True).print(f"[dim]user {_escape(name)}{' (admin)' if admin else ''}: put this token in their "
                                "config file as server: {url: ..., token: ...} (or SFTCTL_SERVER_TOKEN); "
                                "it is not shown again[/]", soft_wrap=True)


@server_app.command("manifest")
def server_manifest(
    kubernetes: bool = typer.Option(False, "--kubernetes", help="A Deployment, a Service and a Secret (YAML)."),
    systemd: bool = typer.Option(False, "--systemd", help="A systemd unit for a lab's login node."),
    port: int = typer.Option(8470, "--port", help="The port the server listens on."),
    image: str = typer.Option("sftctl:latest", "--image", help="Kubernetes: the image with sftctl[server] installed."),
    namespace: Optional[str] = typer.Option(None, "--namespace", help="Kubernetes: the namespace (default: the context's)."),
) -> None:
    """Print what runs the server elsewhere: Kubernetes objects or a systemd unit."""
    from sftctl.server.manifest import kubernetes as k8s_text
    from sftctl.server.manifest import systemd as unit_text

    if kubernetes == systemd:
        raise SftctlError("give one of --kubernetes and --systemd", hint="sftctl server manifest --kubernetes")
    sys.stdout.write(k8s_text(port=port, image=image, namespace=namespace) if kubernetes else unit_text(port=port))


# ------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Maps errors to exit codes; ``--debug`` anywhere shows tracebacks.

    Every error prints ``error:`` and ``hint:`` lines on stderr; with ``--json`` it also prints
    one JSON object on stdout, ``{"error", "hint", "exit_code"}``, unless the command already
    printed its document (``plan --json`` of an infeasible job prints the plan with those keys).
    """
    from typer._click.exceptions import ClickException

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    as_json = "--json" in args
    _JSON_PRINTED[0] = False
    _HELP[0] = "--help" in args

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
        plain = _plain_status(args)
        if plain is not None:  # the command scripts poll: no typer parsing (its adapters import pydantic)
            from sftctl import api

            api.validate_config()
            status(**plain)
            return 0
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
    except Exception as e:  # noqa: BLE001 - a bug or damaged data: one line, the traceback with --debug
        return fail(f"internal error: {type(e).__name__}: {e}",
                    "sftctl --debug ... shows the traceback; please report it. If the state database may be "
                    "damaged: sqlite3 state.db 'PRAGMA integrity_check' in $SFTCTL_HOME", ExitCode.JOB_FAILED)


def _plain_status(args: list[str]) -> dict | None:
    """``status [JOB] [--json] [--all|-a] [--all-users]`` as :func:`status`'s arguments, or None for anything
    else (``--watch``, ``--help``, a typo: typer parses those). ``sftctl status`` is what scripts
    and prompts poll: typer's parameter adapters cost about 0.1-0.4 s (they import pydantic)."""
    if not args or args[0] != "status":
        return None
    flags = {"--json": "as_json", "--all": "all_", "-a": "all_", "--all-users": "all_users"}
    out = {"job_id": None, "as_json": False, "watch": False, "all_": False, "all_users": False}
    for a in args[1:]:
        if a in flags:
            out[flags[a]] = True
        elif a.startswith("-") or out["job_id"] is not None:
            return None
        else:
            out["job_id"] = a
    return out


_JSON_PRINTED = [False]  # whether this invocation printed its JSON document already
_HELP = [False]  # whether this invocation only asks for help (the config file is not checked)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


if __name__ == "__main__":
    sys.exit(main())
