"""The commands about jobs: ``check``, ``status``, ``metrics``, ``costs``, ``logs``, ``wait``, ``down``,
``events`` (and ``schema``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Literal, Optional

import typer

from sftctl.cli.common import _complete_jobs, _console, _escape, _labels, _planning, _print_json, app
from sftctl.errors import ExitCode, SftctlError

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
        doc: dict[str, Any] = {"clouds": [r.to_dict() for r in rows]}
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
    job_ids: Optional[list[str]] = typer.Argument(None, metavar="[JOB]...", help="Jobs (each an id or a unique "
                                                  "prefix): one in detail, several as a table.",
                                                  autocompletion=_complete_jobs),
    label: list[str] = typer.Option([], "--label", metavar="KEY=VALUE", help="Only jobs with this label; repeatable."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every second until the job ends (Ctrl-C stops)."),
    all_: bool = typer.Option(False, "--all", "-a", help=f"Table: every job, not only the newest {TABLE_ROWS}."),
    all_users: bool = typer.Option(False, "--all-users", help="With a server: every user's jobs (its admins only)."),
) -> None:
    """Show jobs: status, resources, step, loss, throughput (--json: every job)."""
    from sftctl import api
    from sftctl.types import JobStatus

    ids = list(job_ids or [])
    job_id = ids[0] if len(ids) == 1 and not label else None  # one job: in detail
    wanted = _labels(label)
    if watch and as_json and job_id is None:
        raise SftctlError("--watch --json waits for one job to end, then prints its document: give one JOB",
                          hint="sftctl status JOB --watch --json; sftctl wait --json JOB... for several")

    def collect():
        if job_id is not None:
            return api.status(job_id).to_dict()
        if ids:  # several: in the order given, each resolved (an unknown id fails)
            return [v.to_dict() for v in (api.status(j) for j in ids) if all(v.record.spec.get("labels", {}).get(k) == x
                                                                           for k, x in wanted.items())]
        return [v.to_dict() for v in api.status(all_users=all_users, labels=wanted or None)]

    def render(doc):
        from rich.console import Group

        from sftctl.ui import job_detail, jobs_table

        if job_id:
            return Group(*job_detail(doc))
        if not doc:
            return "no job has these labels" if wanted else "no jobs yet: sftctl run examples/quickstart.yaml"
        shown = doc if all_ or ids else _newest(doc)
        more = len(doc) - len(shown)
        table = jobs_table(shown, owners=all_users)
        return Group(table, f"... and {more} older finished job(s): sftctl status --all") if more else table

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


# ------------------------------------------------------------------------------------ metrics


@app.command()
def metrics(
    job_id: str = typer.Argument(..., metavar="JOB", autocompletion=_complete_jobs),
    rank: Optional[int] = typer.Option(None, "--rank", "-r", help="One training rank's steps only."),
    plot: bool = typer.Option(False, "--plot", help="Loss and tokens/s per rank as a plot in the terminal."),
    last: int = typer.Option(20, "--last", metavar="N", min=1, help="Table: each rank's newest N steps."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout: every kept step."),
) -> None:
    """A job's reported steps per rank: loss, step time, tokens/s, learning rate (the state's history)."""
    from sftctl import api

    steps = api.metrics(job_id, rank=rank)
    if as_json:
        _print_json({"job_id": job_id, "steps": [s.to_dict() for s in steps]})
        return
    console = _console()
    if not steps:
        console.print(f"{job_id}: no step reported yet" + (f" by rank {rank}" if rank is not None else ""))
        return
    by_rank: dict[int, list] = {}
    for s in steps:
        by_rank.setdefault(s.rank, []).append(s)
    if plot:
        from sftctl.ui import series_plot

        width = max(20, min(100, console.width - 14))
        for key, title in (("loss", "loss"), ("tokens_per_s", "tokens/s")):
            console.print(series_plot({r: [(s.step, getattr(s, key)) for s in ss] for r, ss in by_rank.items()},
                                      width=width, title=title))
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("RANK", "STEP", "LOSS", "STEP TIME", "TOK/S", "LR"):
        table.add_column(col, justify="right")
    for r, ss in sorted(by_rank.items()):
        for s in ss[-last:]:
            table.add_row(str(r), str(s.step), "-" if s.loss is None else f"{s.loss:.4f}",
                          "-" if s.step_time_s is None else f"{s.step_time_s * 1000:.1f} ms",
                          "-" if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f}",
                          "-" if s.lr is None else f"{s.lr:.3g}")
    console.print(table)


# ------------------------------------------------------------------------------------ costs


def _since(text: str | None, option: str) -> float | None:
    """``--since``/``--until``: ``7d``, ``12h``, ``30m`` ago, or a date ``YYYY-MM-DD`` (UTC) ->
    Unix seconds. Bad text: one line naming the option, exit 2."""
    import calendar
    import re

    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([dhm])\s*", text)
    if m:
        return time.time() - float(m.group(1)) * {"d": 86400, "h": 3600, "m": 60}[m.group(2)]
    try:
        return float(calendar.timegm(time.strptime(text.strip(), "%Y-%m-%d")))
    except ValueError:
        raise SftctlError(f"{option} {text[:40]!r}: expected a duration ago (7d, 12h, 30m) or a date (2026-01-31)",
                          hint=f"e.g. sftctl costs {option} 7d", exit_code=ExitCode.USAGE) from None


@app.command()
def costs(
    by: str = typer.Option("user", "--by", help="user: one row per job owner; lab: one row for all jobs."),
    since: Optional[str] = typer.Option(None, "--since", help="From: 7d, 12h, 30m ago, or a date (YYYY-MM-DD, UTC)."),
    until: Optional[str] = typer.Option(None, "--until", help="To (the same forms); default now."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """What jobs cost: node-hours x price per user or for the lab (the configured server's, or this machine's)."""
    from sftctl import api

    if by not in ("user", "lab"):
        raise SftctlError(f"--by {by[:40]!r}: expected user or lab", hint="sftctl costs --by lab",
                          exit_code=ExitCode.USAGE)
    rows = api.costs(by, _since(since, "--since"), _since(until, "--until"))
    if as_json:
        _print_json({"costs": [r.to_dict() for r in rows]})
        return
    if not rows:
        _console().print("no cost in this period")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    columns: tuple[tuple[str, Literal["left", "right"]], ...] = (
        (by.upper(), "left"), ("JOBS", "right"), ("NODE-HOURS", "right"), ("USD", "right"), ("UNPRICED JOBS", "right"))
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for r in rows:
        table.add_row(_escape(r.group), str(r.jobs), f"{r.node_hours:,.2f}", f"${r.usd:,.2f}", str(r.unpriced_jobs or ""))
    _console().print(table)


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
    from sftctl.ui import log_line

    follow = follow or exit_code
    on_tty = sys.stdout.isatty()  # a terminal obeys escapes in node output: log_line shows them instead
    if node is not None and rank is not None:
        raise SftctlError("--node and --rank both pick a node: give one", hint=f"sftctl logs {job_id} --rank {rank}")
    printed = False
    for line in api.logs(job_id, follow=follow, node=node, rank=rank):
        printed = True
        if line.notice:  # the controller died: following the nodes could last forever
            sys.stdout.flush()
            _console(stderr=True).print(f"[yellow]warning:[/] {_escape(line.text)}", soft_wrap=True)
            continue
        sys.stdout.write(log_line(str(line), on_tty) + "\n")  # a pipe or file: the bytes as written
        if follow:
            sys.stdout.flush()
    sys.stdout.flush()
    if not printed and not follow:  # say why there is nothing (a waiting job's nodes have not started)
        job = api.status(job_id)
        why = f" ({job.record.pending_reason})" if job.status.value == "PENDING" and job.record.pending_reason else ""
        _console(stderr=True).print(f"[dim]{_escape(job.id)} is {job.status.value}{_escape(why)}: no node has written "
                                    f"output yet; sftctl logs -f {_escape(job.id)} waits for it[/]", soft_wrap=True)
    if exit_code:
        from sftctl.types import JobStatus

        raise typer.Exit(0 if api.status(job_id).status == JobStatus.SUCCEEDED else int(ExitCode.JOB_FAILED))


def _not_nan(value: Optional[float]) -> Optional[float]:
    """A float option's callback: ``nan`` passes click's ``min=`` (it compares false) but is no
    number of seconds: a usage error (exit 2)."""
    if value is not None and value != value:
        raise typer.BadParameter("expected a number of seconds, got nan")
    return value


@app.command()
def wait(
    job_ids: list[str] = typer.Argument(..., metavar="JOB...", help="Job ids (or unique prefixes).",
                                   autocompletion=_complete_jobs),
    timeout: Optional[float] = typer.Option(None, "--timeout", metavar="SECONDS", min=0, callback=_not_nan,
                                            help="Give up after this long (>= 0): "
                                            f"exit {int(ExitCode.TIMEOUT)}, the jobs go on."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout: {\"jobs\": [status of each], \"exit_code\"}."),
) -> None:
    """Wait until every job ends and its nodes are down: exit 0 if all SUCCEEDED, 1 if one did
    not, 124 on --timeout, 75 when the server stayed unreachable for server.retry_s (the jobs go on).

    Prints one line per job (id, status, reason) as the jobs end, in the order given.
    """
    from sftctl import api
    from sftctl.types import JobStatus

    try:  # an unknown or ambiguous id fails before any wait; a server down now is ridden out
        ids = api.job_ids(job_ids)
    except SftctlError as lost:
        if as_json and lost.exit_code == ExitCode.SERVER_LOST:  # one document, as a server lost mid-wait gives
            _print_json({"jobs": [], "running": job_ids, "error": lost.message, "hint": lost.hint,
                         "exit_code": int(ExitCode.SERVER_LOST)})
        raise
    end = None if timeout is None else time.monotonic() + timeout
    views = []
    for j in ids:
        try:
            try:
                views.append(api.wait(j, timeout_s=None if end is None else max(0.0, end - time.monotonic())))
            except TimeoutError as e:
                err = SftctlError(f"{e} (sftctl wait --timeout {timeout:g})", hint=f"the job goes on: sftctl status {j}",
                                  exit_code=ExitCode.TIMEOUT)
                if as_json:  # every job's status (a server outage ridden out), with the error: the document scripts read
                    _print_json({"jobs": [v.to_dict() for v in api.statuses(ids)], "error": err.message,
                                 "hint": err.hint, "exit_code": int(ExitCode.TIMEOUT)})
                raise err from None
        except SftctlError as lost:  # the server stayed away for server.retry_s (75): the jobs go on there
            if lost.exit_code != ExitCode.SERVER_LOST:
                raise
            rest = " ".join(ids[len(views):])  # this job and those not waited for yet
            err = SftctlError(lost.message, hint=f"sftctl wait {rest} or sftctl logs -f {j} follows it again once "
                              "the server is back", exit_code=ExitCode.SERVER_LOST)
            if as_json:  # the jobs that ended, those that go on, the error: one document still
                _print_json({"jobs": [v.to_dict() for v in views], "running": ids[len(views):], "error": err.message,
                             "hint": err.hint, "exit_code": int(ExitCode.SERVER_LOST)})
            raise err from None
        if not as_json:
            v = views[-1]
            print(f"{v.id} {v.status.value}" + (f": {v.failure_reason}" if v.failure_reason and v.status != JobStatus.SUCCEEDED else ""),
                  flush=True)
    code = ExitCode.JOB_FAILED if any(v.status != JobStatus.SUCCEEDED for v in views) else ExitCode.OK
    if as_json:
        _print_json({"jobs": [v.to_dict() for v in views], "exit_code": int(code)})
    if code:
        raise typer.Exit(int(code))


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


@app.command()
def nodes(
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    all_: bool = typer.Option(False, "--all", help="Also the machines whose mark has decayed."),
) -> None:
    """Machines a health verdict marked bad (Slurm nodes, Kubernetes hosts, instances): every job keeps
    them out until the mark decays (SFTCTL_BAD_MACHINE_DECAY_H)."""
    from sftctl import api

    marks = api.machines(include_decayed=all_)
    if as_json:
        _print_json({"machines": [m.to_dict() for m in marks]})
        return
    if not marks:
        print("no machine is marked bad")
        return
    from rich.table import Table

    now = time.time()
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("PROVIDER", "MACHINE", "ZONE", "VERDICT", "COUNT", "LAST", "KEPT OUT", "EVIDENCE"):
        table.add_column(column)
    for m in marks:
        left = m.until - now
        kept = f"{left / 3600:.1f} h more" if left > 0 else "decayed"
        table.add_row(m.provider, _escape(m.machine), m.zone or "-", m.kind, str(m.count),
                      time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(m.at)), kept, _escape(m.evidence))
    _console().print(table)


@app.command()
def schema(
    markdown: bool = typer.Option(False, "--markdown", help="The spec reference (docs/spec.md) instead."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", metavar="FILE", help="Write here (default: stdout)."),
) -> None:
    """Print the job spec's JSON Schema (draft-07) for editors: a spec's first line
    `# yaml-language-server: $schema=FILE` makes them complete and check it."""
    from sftctl import schema as spec_schema

    text = spec_schema.markdown() if markdown else spec_schema.dumps()
    if output is None:
        sys.stdout.write(text)
    else:
        spec_schema.write(output, text)
        _console(stderr=True).print(f"wrote {_escape(str(output))}", soft_wrap=True)
