"""What people see, but the plan: FitTable (the table every view lays out per width), tables for
jobs, nodes, events, the catalog and kernels, the attached run's progress, the metrics plot.

Rendering only; no state is changed here. ``sftctl plan``'s table is :mod:`sftctl.ui.plan`, built
on :class:`FitTable`; :mod:`sftctl.ui` re-exports both modules' names.
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
    ``cut``: long text kept on its row's one line, cut with "…" at the width left over (a table
    whose rows must stay one line each: ``status``); every other column is shown whole, never
    cut, so a number is always exact.
    """

    name: str
    justify: str = "left"
    drop: float | None = None
    wrap: bool = False
    min_wrap: int = 16
    fold_last: bool = False  # kept whole while a droppable column of a lower drop can still be hidden
    cut: bool = False  # a cut column, as a wrap one, takes the width left over down to min_wrap


def _cells(value) -> int:
    return value.cell_len if isinstance(value, Text) else Text(str(value)).cell_len

_line = lambda value: " ".join(str(value).split())  # noqa: E731  a cut column's cell on one line


class FitTable:
    """A table laid out for the width it is rendered at (a rich renderable).

    Numbers, ids and statuses are never cut: when the table does not fit, optional columns are
    hidden (the line under the table says which; ``--json`` has everything) and text columns
    fold. ``notes`` are printed under the table, folded at word boundaries.
    """

    GAP = 2  # cells between columns (padding 1 on each side, none at the edges); 1 when it must

    def __init__(self, cols: list[Col], rows: list[list], title: str | None = None,
                 notes: list | None = None, cut_hint: str = "--json shows them whole"):
        self.cols, self.rows, self.title, self.notes = cols, rows, title, notes or []
        self.cut_hint = cut_hint  # the line under the table when a ``cut`` column's cell was cut

    def layout(self, width: int) -> tuple[list[int], dict[int, int]]:
        """The indices of the columns shown at ``width`` cells and each one's width (``self.gap``:
        the cells between columns, :attr:`GAP` or 1 when the columns never hidden need it)."""
        self.gap = self.GAP
        natural = [max([_cells(c.name)] + [_cells(r[i]) for r in self.rows]) for i, c in enumerate(self.cols)]
        least = [min(n, max(c.min_wrap, _cells(c.name))) if c.wrap or c.cut else n for c, n in zip(self.cols, natural)]
        shown = list(range(len(self.cols)))
        droppable = sorted((c.drop, i) for i, c in enumerate(self.cols) if c.drop is not None)

        def need(idx):
            return sum(least[i] for i in idx) + self.gap * (len(idx) - 1)

        whole = [i for i, c in enumerate(self.cols) if (c.wrap or c.cut) and c.fold_last]
        folded = list(least)
        for i in whole:  # kept whole while lesser columns (a lower drop than its own) can make room
            least[i] = natural[i]
        while need(shown) > width and droppable:
            giving = [i for i in whole if least[i] > folded[i] and (self.cols[i].drop if self.cols[i].drop is not None else 1e9) <= droppable[0][0]]
            if giving:  # the next column to hide outranks this one's whole width: fold it first
                least[giving[0]] = folded[giving[0]]
                continue
            shown.remove(droppable.pop(0)[1])
        if need(shown) > width and len(shown) > 1:  # still too wide: one cell between columns
            self.gap = 1
        for i in whole:
            if need(shown) > width:
                least[i] = folded[i]
        widths = {i: least[i] for i in shown}
        spare = width - need(shown)
        # text columns share what is left in equal parts, each up to its natural width
        wanting = [i for i in shown if (self.cols[i].wrap or self.cols[i].cut) and natural[i] > widths[i]]
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
        t = Table(box=None, header_style="bold", pad_edge=False, title=self.title, title_justify="left",
                  padding=(0, 1) if self.gap == 2 else (0, 0, 0, 1))
        for i in shown:
            c = self.cols[i]
            t.add_column(c.name, justify=c.justify, width=widths[i], no_wrap=not c.wrap,
                         overflow="fold" if c.wrap else "ellipsis" if c.cut else "crop")
        for r in self.rows:  # plain strings are user data: shown as they are, never as markup; a cut cell: one line
            t.add_row(*[Text(_line(r[i])) if self.cols[i].cut else r[i] if isinstance(r[i], Text) else Text(str(r[i]))
                        for i in shown])
        yield t
        hidden = [c.name for i, c in enumerate(self.cols) if i not in shown]
        if hidden:
            yield Text(f"{len(hidden)} column(s) hidden at {options.max_width} columns: {', '.join(hidden)}"
                       " (a wider terminal or --json shows them)", style="dim")
        cut = [c.name for i, c in enumerate(self.cols)
               if i in shown and c.cut and any(_cells(_line(r[i])) > widths[i] for r in self.rows)]
        if cut and self.cut_hint:
            yield Text(f"{', '.join(cut)} cut at {options.max_width} columns: {self.cut_hint}", style="dim")
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


def jobs_table(jobs: list[dict], owners: bool = False) -> FitTable:
    """One row per job: id, status, where it runs, progress, loss, throughput, age, reason;
    ``owners`` (``status --all-users``): an OWNER column after JOB.

    Ids, statuses and numbers are never cut: on a narrow terminal the optional columns go first
    (COST, PRED, ACTUAL, DURATION, AGE, TOK/S, LABELS, RESOURCES, LOSS), and every row stays one
    line: a long NOTE or LABELS is cut with "…" (``status JOB`` and ``--json`` have it whole)."""
    cols = [Col("JOB"), Col("STATUS"), Col("RESOURCES", drop=4), Col("STEP", "right"), Col("LOSS", "right", drop=5),
            Col("TOK/S", "right", drop=3), Col("AGE", "right", drop=2), Col("DURATION", "right", drop=1),
            Col("COST", "right", drop=0), Col("NOTE", cut=True, min_wrap=16)]
    rows = [[j["id"], Text(j["status"], style=STATUS_STYLE.get(j["status"], "")), j["resources"], _steps(j),
             _num(j["loss"], ".4f"), _num(j["tokens_per_s"], ",.0f"), _age(j["created_at"]), _duration(j), _usd(j.get("cost")),
             tty_safe(j["failure_reason"] or j.get("pending_reason") or (f"{j['restarts']} restart(s)" if j["restarts"] else ""))]
            for j in jobs]
    if any(j.get("step_time") for j in jobs):  # predicted vs measured step time, after STEP
        cols[4:4] = [Col("PRED", "right", drop=0.5), Col("ACTUAL", "right", drop=0.6)]
        for j, row in zip(jobs, rows):
            row[4:4] = step_time_cells(j.get("step_time"))
    if owners:
        cols[1:1] = [Col("OWNER")]
        for j, row in zip(jobs, rows):
            row[1:1] = [tty_safe(j.get("owner") or "-")]
    if any(j.get("labels") for j in jobs):  # a sweep's jobs told apart: before NOTE
        cols[-1:-1] = [Col("LABELS", cut=True, min_wrap=12, drop=3.5, fold_last=True)]
        for j, row in zip(jobs, rows):
            row[-1:-1] = [tty_safe(labels_text(j.get("labels")) or "-")]
    return FitTable(cols, rows, cut_hint="sftctl status JOB or --json shows them whole")


def labels_text(labels: dict | None) -> str:
    """A job's labels as ``k=v k=v`` (status's LABELS column and detail)."""
    return " ".join(f"{k}={v}" for k, v in (labels or {}).items())


def step_time_cells(st: dict | None) -> list[str]:
    """PRED and ACTUAL of a job's ``step_time`` (``status --json``): the planned step time and the
    measured one (median after warm-up) with its difference, ``31.2 ms +8%``; a measurement too
    far off the model's step for the run history (``measured_refused``): ``1e-09 s refused``;
    ``-`` unknown."""
    if not st:
        return ["-", "-"]
    actual = _seconds(st.get("measured_s"))
    if st.get("measured_refused"):
        actual += " refused"
    elif st.get("difference") is not None:
        actual += f" {st['difference']:+.0%}"
    return [_seconds(st.get("predicted_s")), actual]


def refused_words(st: dict) -> str:
    """Why a job's ``step_time`` with ``measured_refused`` is not learned from: ``refused:
    1.43e-06 x the model's 700.0 us, not learned from``; ``beyond a float's range of`` for a
    ratio (``refused_ratio``) past a float."""
    ratio = st.get("refused_ratio")
    far = f"{ratio:.3g} x" if ratio is not None else "beyond a float's range of"
    return f"refused: {far} the model's {_seconds(st.get('model_s'))}, not learned from"


def _usd(cost: dict | None) -> str:
    """A job's accumulated cost for the table: ``$12.34``; ``-`` unplanned or unpriced."""
    if not cost or cost.get("usd") is None:
        return "-"
    return f"${cost['usd']:,.2f}"


def cost_line(cost: dict) -> str:
    """``sftctl status JOB``'s cost: ``cost: $1.23 (0.50 node-hours at $2.46/h, SOURCE)``; the
    price unknown: ``cost: - (0.50 node-hours; no price: SOURCE)``."""
    hours = f"{cost['node_hours']:,.2f} node-hours"
    if cost.get("usd") is None or cost.get("price_per_hour") is None:
        return f"cost: - ({hours}; no price: {tty_safe(str(cost.get('source') or 'unknown'))})"
    return f"cost: ${cost['usd']:,.2f} ({hours} at ${cost['price_per_hour']:,.2f}/h, {tty_safe(str(cost['source']))})"


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
    if job.get("labels"):
        out.append(Text(f"labels: {tty_safe(labels_text(job['labels']))}"))
    if job.get("overrides"):
        out.append(Text("submitted with: " + tty_safe(" ".join(f"--set {a}" for a in job["overrides"]))))
    if job["plan"]:
        out.append(Text(f"plan: {job['plan']}", style="dim"))
    if job.get("cost"):
        out.append(Text(cost_line(job["cost"])))
    if job.get("step_time"):
        pred, actual = step_time_cells(job["step_time"])
        n, world = job["step_time"].get("measured_steps"), max(1, len(job.get("ranks") or ()))
        over = f"{round(n / world)} steps x {world} ranks" if n and world > 1 else f"{n} steps"  # n: reports
        refused = job["step_time"].get("measured_refused")
        if refused:
            actual = _seconds(job["step_time"].get("measured_s"))
        out.append(Text(f"step time: predicted {pred}, measured {actual}" + (f" (median of {over} after warm-up)"
                                                                             if n else "")
                        + (f"; {refused_words(job['step_time'])}" if refused else ""),
                        style="yellow" if refused else ""))
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


def calibration_table(summary: list[dict], runs: int) -> FitTable:
    """``sftctl calibrate show``: per accelerator, offering and source (``run``: this lab's jobs;
    ``imported``), the runs and their measured / predicted step (median, min-max)."""
    cols = [Col("ACCEL"), Col("PROVIDER"), Col("INSTANCE", drop=1), Col("SOURCE"), Col("RUNS", "right"),
            Col("MEASURED/PREDICTED", "right"), Col("RANGE", "right", drop=2), Col("LABELS", wrap=True, drop=0)]
    rows = [[g["accelerator"], g["provider"], g["instance_type"], g["source"], str(g["runs"]),
             f"{g['median_measured_over_predicted']:.2f}", f"{g['min']:.2f}-{g['max']:.2f}",
             tty_safe(", ".join(g["labels"]))] for g in summary]
    return FitTable(cols, rows, title=f"run history: {runs} run(s)",
                    notes=[] if runs else [Text("no runs yet: jobs add theirs when they end; sftctl calibrate import "
                                                "adds measured runs from a file", style="dim")])


def events_table(events: list[dict]) -> FitTable:
    """``sftctl events``: time and kind whole, the message folded."""
    rows = [[time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["ts"])), e["kind"], tty_safe(e["message"])] for e in events]
    return FitTable([Col("TIME"), Col("KIND"), Col("MESSAGE", wrap=True, min_wrap=24)], rows)


def _seconds(s: float | None) -> str:
    """``s`` seconds as ``31.2 ms``, ``700.0 us``, ``2.50 s``; below 0.1 us or from 1e5 s (a
    glitching clock's step) ``1e-09 s``, ``1e+308 s``; ``-`` None."""
    if s is None:
        return "-"
    if not 1e-7 <= s < 1e5:
        return f"{s:.3g} s"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"



def catalog_table(offerings: list, zones: bool = False):
    """``sftctl catalog``: the offerings with prices (``!``: an older price than the newest of its
    instance type, :func:`sftctl.catalog.older_prices`); each price's source a numbered footnote
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
    from sftctl.catalog import older_prices

    older = older_prices()  # "!": an older price than its type's newest (the note under the table)
    rows = []
    for o in offerings:
        row = [o.provider, o.instance_type, f"{o.accelerator}:{o.count}", o.region,
               f"{o.usd_per_hour:.3f}" + (" !" if (o.provider, o.instance_type, o.region) in older else ""),
               _num(o.spot_usd_per_hour, ".3f"), _num(o.vcpus, "d"), _num(o.memory_gib, ".0f"),
               getattr(o, "as_of", "") or "", f"[{notes.index(o.source) + 1}]" if o.source else "-"]
        if not zones:
            rows.append(row)
            continue
        per_zone = list(getattr(o, "spot_zones", ()) or ()) or [(o.zone or "-", o.spot_usd_per_hour)]
        for zone, spot in per_zone:
            rows.append(row[:4] + [zone] + row[4:5] + [_num(spot, ".3f")] + row[6:])
    flagged = {o.instance_type for o in offerings if (o.provider, o.instance_type, o.region) in older}
    mark = [Text(f"! an older price (AS OF) than the newest of its type ({', '.join(sorted(flagged))}); "
                 "sftctl catalog refresh reads current prices", style="dim")] if flagged else []
    return Group(FitTable(cols, rows), *mark, *(Text(f"[{i}] {n}") for i, n in enumerate(notes, 1)))


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


#: the colours ``series_plot`` draws ranks in, in turn
PLOT_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")


def series_plot(series: dict[int, list[tuple[float, float]]], width: int = 72, height: int = 16,
                title: str = "") -> Text:
    """A line per rank as a terminal plot (``sftctl metrics --plot``): ``series`` maps a rank to
    its (step, value) points; each point is one ``•`` cell in the rank's colour (the last rank
    drawn wins a shared cell), with the y range on the left and the step range below. Points
    whose value is None are skipped; no points: one line saying so."""
    pts = [(x, y) for s in series.values() for x, y in s if y is not None]
    if not pts:
        return Text(f"{title}: no values reported" if title else "no values reported")
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    grid: list[list[tuple[str, str]]] = [[(" ", "")] * width for _ in range(height)]
    for i, (_rank, points) in enumerate(sorted(series.items())):
        style = PLOT_STYLES[i % len(PLOT_STYLES)]
        for x, y in points:
            if y is None:
                continue
            col = 0 if x1 == x0 else round((x - x0) / (x1 - x0) * (width - 1))
            row = 0 if y1 == y0 else round((y1 - y) / (y1 - y0) * (height - 1))
            grid[row][col] = ("•", style)
    label = max(len(f"{y0:.4g}"), len(f"{y1:.4g}"))
    out = Text()
    if title:
        out.append(title + "  ")
        for i, rank in enumerate(sorted(series)):
            out.append(f"rank {rank} ", style=PLOT_STYLES[i % len(PLOT_STYLES)])
        out.append("\n")
    for r, cells in enumerate(grid):
        tick = f"{y1:.4g}" if r == 0 else f"{y0:.4g}" if r == height - 1 else ""
        out.append(f"{tick:>{label}} │")
        for ch, style in cells:
            out.append(ch, style=style or None)
        out.append("\n")
    out.append(" " * label + " └" + "─" * width + "\n")
    left, right = f"step {x0:g}", f"{x1:g}"
    out.append(" " * (label + 2) + left + " " * max(1, width - len(left) - len(right)) + right)
    return out
