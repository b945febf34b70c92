"""What people see: rich tables for jobs, nodes and events, and the attached run's progress.

Rendering only; no state is changed here. ``--json`` documents are built in :mod:`sftctl.api`; these
tables render the same documents.
"""

from __future__ import annotations

import dataclasses
import os
import time

from rich.console import Console
from rich.table import Table
from rich.text import Text

class SafeConsole(Console):
    """A rich Console whose output may vanish without ending the program.

    ``sftctl run ... | head`` closes the pipe after ten lines and a closed terminal (SIGHUP)
    turns every write into EIO; the job goes on either way. rich's own answer to a broken pipe
    is ``SystemExit(1)``, which would end the controller mid-job: here the console goes quiet
    instead (its file descriptor is pointed at /dev/null, so later flushes are silent too).
    """

    def __init__(self, *args, **kwargs):
        # user input (job names, reasons, log lines) never turns into emoji: ":smile:" stays text
        kwargs.setdefault("emoji", False)
        super().__init__(*args, **kwargs)

    def on_broken_pipe(self) -> None:
        self.quiet = True
        try:
            fd = self.file.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        except (OSError, ValueError):  # a file without a descriptor: quiet is enough
            pass

    def _render_buffer(self, buffer) -> str:
        text = super()._render_buffer(buffer)
        if not self.is_terminal:  # piped: no padding after the last column (tables fill each line)
            text = "\n".join(line.rstrip(" ") for line in text.split("\n"))
        return text

    def _check_buffer(self) -> None:
        try:
            super()._check_buffer()
        except OSError:  # EIO from a terminal that is gone
            self.on_broken_pipe()


@dataclasses.dataclass
class Col:
    """A column of a :class:`FitTable`.

    ``drop``: columns with a number are hidden at narrow widths, the lowest number first (None:
    always shown). ``wrap``: long text folded over several lines (takes the width left over);
    every other column is shown whole, never cut, so a number is always exact.
    """

    name: str
    justify: str = "left"
    drop: int | None = None
    wrap: bool = False
    min_wrap: int = 16


def _cells(value) -> int:
    return value.cell_len if isinstance(value, Text) else Text(str(value)).cell_len


class FitTable:
    """A table laid out for the width it is rendered at (a rich renderable).

    Numbers, ids and statuses are never cut: when the table does not fit, optional columns are
    hidden (the line under the table says which; ``--json`` has everything) and text columns
    fold. ``notes`` are printed under the table, folded at word boundaries.
    """

    GAP = 2  # cells between columns (padding 1 on each side, none at the edges)

    def __init__(self, cols: list[Col], rows: list[list], title: str | None = None,
                 notes: list | None = None):
        self.cols, self.rows, self.title, self.notes = cols, rows, title, notes or []

    def layout(self, width: int) -> tuple[list[int], dict[int, int]]:
        """The indices of the columns shown at ``width`` cells and each one's width."""
        natural = [max([_cells(c.name)] + [_cells(r[i]) for r in self.rows]) for i, c in enumerate(self.cols)]
        least = [min(n, max(c.min_wrap, _cells(c.name))) if c.wrap else n for c, n in zip(self.cols, natural)]
        shown = list(range(len(self.cols)))
        droppable = sorted((c.drop, i) for i, c in enumerate(self.cols) if c.drop is not None)

        def need(idx):
            return sum(least[i] for i in idx) + self.GAP * (len(idx) - 1)

        while need(shown) > width and droppable:
            shown.remove(droppable.pop(0)[1])
        widths = {i: least[i] for i in shown}
        spare = width - need(shown)
        # text columns share what is left in equal parts, each up to its natural width
        wanting = [i for i in shown if self.cols[i].wrap and natural[i] > widths[i]]
        while spare > 0 and wanting:
            share = max(1, spare // len(wanting))
            for i in list(wanting):
                extra = min(share, natural[i] - widths[i], spare)
                widths[i] += extra
                spare -= extra
                if widths[i] >= natural[i]:
                    wanting.remove(i)
        return shown, widths

    def __rich_console__(self, console, options):
        shown, widths = self.layout(options.max_width)
        t = Table(box=None, header_style="bold", pad_edge=False, title=self.title, title_justify="left")
        for i in shown:
            c = self.cols[i]
            t.add_column(c.name, justify=c.justify, width=widths[i], no_wrap=not c.wrap,
                         overflow="fold" if c.wrap else "crop")
        for r in self.rows:  # plain strings are user data: shown as they are, never as markup
            t.add_row(*[r[i] if isinstance(r[i], Text) else Text(str(r[i])) for i in shown])
        yield t
        hidden = [c.name for i, c in enumerate(self.cols) if i not in shown]
        if hidden:
            yield Text(f"{len(hidden)} column(s) hidden at {options.max_width} columns: {', '.join(hidden)}"
                       " (a wider terminal or --json shows them)", style="dim")
        for note in self.notes:
            yield note if isinstance(note, Text) else Text(str(note))


def _grouped(reasons: list[str | None]) -> tuple[list[str], list[Text]]:
    """Long reasons as short references (``[1]``) plus one note per distinct reason, so a
    reason shared by many rows is printed once, folded under the table."""
    keys: dict[str, int] = {}
    refs = []
    for r in reasons:
        if r is None:
            refs.append("")
            continue
        keys.setdefault(r, len(keys) + 1)
        refs.append(f"[{keys[r]}]")
    counts = {r: reasons.count(r) for r in keys}
    notes = [Text.assemble((f"[{k}] ", "bold"), (f"{counts[r]} x " if counts[r] > 1 else ""), r, style="dim")
             for r, k in keys.items()]
    return refs, notes


STATUS_STYLE = {
    "PENDING": "dim",
    "PROVISIONING": "cyan",
    "LAUNCHING": "cyan",
    "RUNNING": "bold cyan",
    "RECOVERING": "yellow",
    "SUCCEEDED": "green",
    "FAILED": "bold red",
    "CANCELLED": "magenta",
    "FAILED_CONTROLLER": "bold red",
}


def _age(ts: float | None) -> str:
    if ts is None:
        return "-"
    s = max(0.0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit}"
    return f"{s:.0f}s"


def _duration(job: dict) -> str:
    end = job.get("ended_at") or time.time()
    s = end - job["created_at"]
    return f"{s / 60:.1f}m" if s >= 120 else f"{s:.0f}s"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def jobs_table(jobs: list[dict]) -> FitTable:
    """One row per job: id, status, where it runs, progress, loss, throughput, age, reason.

    Ids, statuses and numbers are never cut: on a narrow terminal the optional columns go first
    (COST, DURATION, AGE, TOK/S, LOSS, RESOURCES) and the note folds."""
    cols = [Col("JOB"), Col("STATUS"), Col("RESOURCES", drop=5), Col("STEP", "right"), Col("LOSS", "right", drop=4),
            Col("TOK/S", "right", drop=3), Col("AGE", "right", drop=2), Col("DURATION", "right", drop=1),
            Col("COST", "right", drop=0), Col("NOTE", wrap=True, min_wrap=20)]
    rows = [[j["id"], Text(j["status"], style=STATUS_STYLE.get(j["status"], "")), j["resources"], _steps(j),
             _num(j["loss"], ".4f"), _num(j["tokens_per_s"], ",.0f"), _age(j["created_at"]), _duration(j), _usd(j.get("cost")),
             tty_safe(j["failure_reason"] or j.get("pending_reason") or (f"{j['restarts']} restart(s)" if j["restarts"] else ""))]
            for j in jobs]
    return FitTable(cols, rows)


def _usd(cost: dict | None) -> str:
    """A job's accumulated cost for the table: ``$12.34``; ``-`` unplanned or unpriced."""
    if not cost or cost.get("usd") is None:
        return "-"
    return f"${cost['usd']:,.2f}"


def _steps(job: dict) -> str:
    if job["steps"] is None:
        return "-"
    return f"{job['step'] if job['step'] is not None else '-'}/{job['steps']}"


def job_detail(job: dict) -> list:
    """Renderables for ``sftctl status JOB``: header, nodes, ranks, attempts."""
    head = Text.assemble(
        (job["id"], "bold"), "  ", (job["status"], STATUS_STYLE.get(job["status"], "")),
        f"  {job['resources']}  step {_steps(job)}",
        f"  age {_age(job['created_at'])}, ran {_duration(job)}",
    )
    out: list = [head]
    if job["failure_reason"]:
        out.append(Text(f"reason: {tty_safe(job['failure_reason'])}", style="red"))
    if job.get("pending_reason"):
        out.append(Text(f"pending: {tty_safe(job['pending_reason'])}", style="yellow"))
    if job["plan"]:
        out.append(Text(f"plan: {job['plan']}", style="dim"))
    for h in job.get("health", []):
        out.append(Text(f"health {time.strftime('%H:%M:%S', time.localtime(h['ts']))}: {h['message']} -> {h.get('action')}",
                        style="yellow"))
    nodes = Table(title="nodes", box=None, header_style="bold", title_justify="left")
    for col in ("RANK", "NODE", "STATUS", "WHERE"):
        nodes.add_column(col)
    for n in job["nodes"]:
        nodes.add_row(*(Text(str(v)) for v in (n["rank"], n["id"], n["status"], n["where"])))
    out.append(nodes)
    if job["ranks"]:
        ranks = Table(title="training ranks", box=None, header_style="bold", title_justify="left")
        for col in ("RANK", "ON NODE", "STEP", "FIRST LOSS", "LOSS", "STEP TIME", "TOK/S", "LAST REPORT"):
            ranks.add_column(col, justify="right")
        for r in job["ranks"]:
            ranks.add_row(
                str(r["rank"]), _num(r.get("node"), "d"), str(r["step"]), _num(r["first_loss"], ".4f"), _num(r["loss"], ".4f"),
                _num(r["step_time_s"] and r["step_time_s"] * 1000, ".1f") + " ms",
                _num(r["tokens_per_s"], ",.0f"), _age(r["ts"]) + " ago",
            )
        out.append(ranks)
    if job["attempts"]:
        att = Table(title="attempts", box=None, header_style="bold", title_justify="left")
        for col in ("#", "STATUS", "EXIT", "REASON"):
            att.add_column(col)
        for a in job["attempts"]:
            att.add_row(str(a["number"]), a["status"], _num(a["exit_code"], "d"), Text(tty_safe(a["reason"] or "")))
        out.append(att)
    return out


def events_table(events: list[dict]) -> FitTable:
    """``sftctl events``: time and kind whole, the message folded."""
    rows = [[time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["ts"])), e["kind"], tty_safe(e["message"])] for e in events]
    return FitTable([Col("TIME"), Col("KIND"), Col("MESSAGE", wrap=True, min_wrap=24)], rows)


class RunView:
    """The attached ``sftctl run`` view: events and node logs scroll, a progress bar stays.

    Implements the controller's Reporter protocol. Use as a context manager.

    Args:
        console: where to draw (stderr when ``--json`` owns stdout).
        steps: total training steps, for the bar.
        show_logs: stream node logs (prefixed with their node rank).
    """

    def __init__(self, console: Console, steps: int, show_logs: bool = True):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console
        self.show_logs = show_logs
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]}"),  # empty until a rank reports tokens (a model without them: never)
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task("pending", total=steps, loss="-", tps="")
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self._partial: dict[int, str] = {}
        self._tps: dict[int, float] = {}
        self._noise: dict[int, "TorchNoise"] = {}  # per node: known torch noise left out of this view
        self._first: dict[int, float] = {}  # per rank: first and latest loss
        self._last: dict[int, float] = {}

    def __enter__(self) -> "RunView":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        for rank, rest in self._partial.items():
            if rest:
                self._print_log(rank, rest)
        self.progress.stop()

    def event(self, message: str) -> None:
        status = message.split(":", 1)[0]
        if status in STATUS_STYLE:
            self.progress.update(self.task, description=status.lower())
        self.progress.console.print(Text.assemble(("▸ ", "bold blue"), tty_safe(message)))

    def log(self, rank: int, text: str) -> None:
        if not self.show_logs:
            return
        lines = (self._partial.get(rank, "") + text).split("\n")
        self._partial[rank] = lines.pop()
        noise = self._noise.setdefault(rank, TorchNoise())
        for line in lines:
            if noise.keep(line):
                self._print_log(rank, line)

    def _print_log(self, rank: int, line: str) -> None:
        text = line.rstrip("\r")
        if self.progress.console.is_terminal:
            text = tty_safe(text)
        self.progress.console.print(Text.assemble((f"(node {rank}) ", "dim"), text))

    def metrics(self, samples: list[dict]) -> None:
        """Progress from step reports. The loss shown is the mean over the ranks of each one's
        latest loss, as ``sftctl status`` shows it; ``first_loss`` is the mean of each rank's
        first reported loss."""
        for s in samples:
            if s.get("loss") is not None:
                rank = int(s.get("rank", 0))
                self._first.setdefault(rank, float(s["loss"]))
                self._last[rank] = float(s["loss"])
                self.first_loss = sum(self._first.values()) / len(self._first)
                self.last_loss = sum(self._last.values()) / len(self._last)
            if s.get("tokens_per_s"):
                self._tps[int(s.get("rank", 0))] = float(s["tokens_per_s"])
        step = max(int(s["step"]) for s in samples)
        self.progress.update(
            self.task,
            completed=step,
            loss=f"{self.last_loss:.4f}" if self.last_loss is not None else "-",
            tps=f"{sum(self._tps.values()):,.0f} tok/s" if self._tps else "",
        )


class TorchNoise:
    """Which lines of one node's log the attached view shows: known torch noise is left out
    (``sftctl logs`` and the node logs keep every line). Known noise: torchrun's warning that
    ``node_rank is only used for static rdzv_backend`` (sftctl launches with c10d and passes the
    node rank for the logs), and torchrun's ``Error waiting on exit barrier`` with the traceback
    frames that follow it (pytorch#69520: the exit barrier times out after the job finished)."""

    LINES = ("node_rank is only used for static rdzv_backend",)
    BLOCKS = ("Error waiting on exit barrier",)
    CHAINED = ("During handling of the above exception", "The above exception was the direct cause")

    def __init__(self) -> None:
        self.state = "show"  # show | block (after a block's first line) | frames | after (its exception line)

    def keep(self, line: str) -> bool:
        if any(s in line for s in self.LINES):
            return False
        if any(s in line for s in self.BLOCKS):
            self.state = "block"
            return False
        if self.state == "show":
            return True
        if line.startswith("Traceback (most recent call last):"):
            self.state = "frames"
            return False
        if self.state == "frames":
            if line.startswith((" ", "\t")) or not line.strip():
                return False
            self.state = "after"  # the exception's own line ends the frames
            return False
        if not line.strip() or line.startswith(self.CHAINED):
            return False  # a chained exception: its traceback follows
        self.state = "show"
        return True


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def plan_table(candidates: list, steps: int) -> FitTable:
    """``sftctl plan``: one row per candidate offering, best first.

    A rejected row says ``no [k]``; reason ``k`` is printed once under the table, with how many
    rows share it. With a model, STRATEGY says ``ddp`` or ``fsdp`` (``+ckpt``: activation
    checkpointing) for each offering. Numbers are never cut: narrow terminals hide $/STEP, NODES,
    REGION, MEMORY, TIME, INSTANCE, STRATEGY and STEP RANGE, in that order. STEP RANGE is the
    step time divided and multiplied by the accelerator's error factor (:mod:`sftctl.compiler.accuracy`);
    `*` marks an uncalibrated accelerator, and a note says when two rows' intervals overlap."""
    from sftctl.planner import format_hours

    refs, notes = _grouped([None if c.rejected is None else str(c.rejected) for c in candidates])
    cols = [Col("#", "right"), Col("PROVIDER"), Col("INSTANCE", drop=6), Col("ACCEL"), Col("NODES", "right", drop=2),
            Col("REGION", drop=3), Col("$/H", "right"), Col("STEP", "right"), Col("MEMORY", "right", drop=4),
            Col("$/STEP", "right", drop=1), Col("TIME", "right", drop=5), Col("TOTAL $", "right"), Col("VERDICT")]
    ranged = any(getattr(c, "step_time_interval_s", None) for c in candidates)
    if ranged:  # the step's interval from the accelerator's calibration error, after STEP
        cols.insert(8, Col("STEP RANGE", "right", drop=8))
    queued = any(getattr(c, "queue_wait_s", None) is not None for c in candidates)
    if queued:  # a Slurm cluster: its queue wait and the finish (wait + run), before VERDICT
        cols[-1:-1] = [Col("QUEUE", "right"), Col("FINISH", "right")]
    strategies = any(getattr(c, "parallelism", None) for c in candidates)
    if strategies:  # a model: the data-parallel strategy the memory and step are predicted for
        cols.insert(10 if any(getattr(c, "step_time_interval_s", None) for c in candidates) else 9,
                    Col("STRATEGY", drop=7))
    rows = []
    for i, (c, ref) in enumerate(zip(candidates, refs), 1):
        o = c.offering
        per_step = c.usd_per_hour * c.step_time_s / 3600 if c.usd_per_hour is not None and c.step_time_s else None
        verdict = Text("ok", style="green") if c.rejected is None else Text(f"no {ref}", style="dim")
        if i == 1 and c.rejected is None:
            verdict = Text("chosen", style="bold green")
        owned = o.provider == "slurm" and c.usd_per_hour == 0  # the lab's own cluster, no price set
        row = [
            str(i), o.provider, o.instance_type, f"{o.accelerator}:{o.count}", str(c.nodes), o.region,
            "owned" if owned else _num(c.usd_per_hour, ",.2f"), _seconds(c.step_time_s),
            "-" if c.peak_memory_bytes is None else f"{c.peak_memory_bytes / 2**30:.1f} GiB",
            "-" if per_step is None else f"{per_step:.5f}", format_hours(c.hours), _num(c.total_usd, ",.2f"), verdict,
        ]
        cal = getattr(c, "calibration", None)
        if cal is not None and not cal.get("calibrated"):
            row[7] += " *"  # uncalibrated: noted under the table
        if ranged:
            iv = getattr(c, "step_time_interval_s", None)
            row.insert(8, "-" if not iv else f"{_seconds(iv[0])}-{_seconds(iv[1])}")
        if strategies:
            par = getattr(c, "parallelism", None)
            row.insert(10 if ranged else 9,
                       "-" if par is None else par + ("+ckpt" if getattr(c, "activation_checkpointing", False) else ""))
        if queued:
            wait = getattr(c, "queue_wait_s", None)
            finish = getattr(c, "finish_s", None)
            row[-1:-1] = ["-" if wait is None else format_hours(wait / 3600),
                          "-" if finish is None else format_hours(finish / 3600)]
        rows.append(row)
    uncal = sorted({c.offering.accelerator for c in candidates
                    if getattr(c, "calibration", None) and not c.calibration.get("calibrated")})
    if uncal:
        notes.append(Text(f"* uncalibrated: no measured kernels or steps on {', '.join(uncal)}; the range is the "
                          "error of the published-steps check (issue 20)", style="dim"))
    for i, c in enumerate(candidates, 1):
        if getattr(c, "ranking_note", None):
            notes.append(Text(f"#{i}: {c.ranking_note}", style="dim"))
    return FitTable(cols, rows, title=f"offerings for {steps:,} steps", notes=notes)


def catalog_table(offerings: list, zones: bool = False):
    """``sftctl catalog``: the offerings with prices; each price's source a numbered footnote
    under the table (a source is a long URL or sentence: in a column it wrapped to many lines).
    ``zones``: one row per zone with a spot price (``Offering.spot_zones``), that zone's spot."""
    from rich.console import Group
    from rich.text import Text

    notes = list(dict.fromkeys(o.source for o in offerings if o.source))
    cols = [Col("PROVIDER"), Col("INSTANCE"), Col("ACCEL"), Col("REGION", drop=6), Col("$/H", "right"),
            Col("SPOT $/H", "right", drop=4), Col("VCPUS", "right", drop=2), Col("MEM GIB", "right", drop=3),
            Col("AS OF", drop=1), Col("SRC", "right", drop=5)]
    if zones:
        cols.insert(4, Col("ZONE", drop=4))
    rows = []
    for o in offerings:
        row = [o.provider, o.instance_type, f"{o.accelerator}:{o.count}", o.region, f"{o.usd_per_hour:.3f}",
               _num(o.spot_usd_per_hour, ".3f"), _num(o.vcpus, "d"), _num(o.memory_gib, ".0f"),
               getattr(o, "as_of", "") or "", f"[{notes.index(o.source) + 1}]" if o.source else "-"]
        if not zones:
            rows.append(row)
            continue
        per_zone = list(getattr(o, "spot_zones", ()) or ()) or [(o.zone or "-", o.spot_usd_per_hour)]
        for zone, spot in per_zone:
            rows.append(row[:4] + [zone] + row[4:5] + [_num(spot, ".3f")] + row[6:])
    return Group(FitTable(cols, rows), *(Text(f"[{i}] {n}") for i, n in enumerate(notes, 1)))


def kernels_table(kernels: list, top: int) -> FitTable:
    """``sftctl compile``: the slowest kernels with their schedule and roofline position."""
    total = sum(k.time_s for k in kernels) or 1.0
    cols = [Col("#", "right"), Col("KERNEL", wrap=True, min_wrap=16), Col("TIME", "right"), Col("SHARE", "right"),
            Col("BOUND", drop=2), Col("INTENSITY", "right", drop=1), Col("OF ROOFLINE", "right", drop=3),
            Col("SCHEDULE", wrap=True, min_wrap=16, drop=4)]
    rows = []
    for k in sorted(kernels, key=lambda k: -k.time_s)[:top]:
        cfg = k.config or {}
        sched = " ".join(f"{key.replace('BLOCK_', '')}={v}" for key, v in cfg.items()) if cfg else "-"
        rows.append([str(k.index), k.label, _seconds(k.time_s), f"{100 * k.time_s / total:.1f}%", k.bound,
                     f"{k.arithmetic_intensity:.1f} F/B", f"{100 * k.roofline_fraction:.0f}%", sched])
    return FitTable(cols, rows, title=f"slowest {min(top, len(kernels))} of {len(kernels)} kernels")


#: C0 and C1 control characters but newline and tab: what a terminal would obey (ESC sequences
#: set the title, clear the screen, move the cursor; the kubectl CVE-2021-25743 class)
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0, 32), *range(127, 160)) if c not in (9, 10)}


def tty_safe(text: str) -> str:
    """``text`` with every control character other than newline and tab shown as ``\\xNN``:
    node output printed on a terminal (``sftctl logs``, an attached ``run``, the reasons and
    event messages of ``status``/``events`` tables, which quote node output) cannot drive it.
    ``--json`` and output to a file or pipe keep the bytes as the node wrote them."""
    return text.translate(_CONTROL)
