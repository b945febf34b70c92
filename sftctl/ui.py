"""What people see: rich tables for jobs, nodes and events, and the attached run's progress.

Rendering only; no state is changed here. ``--json`` output is built in :mod:`sftctl.cli`.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table
from rich.text import Text

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


def jobs_table(jobs: list[dict]) -> Table:
    """One row per job: id, status, where it runs, progress, loss, throughput, age, reason."""
    t = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("JOB", "STATUS", "RESOURCES", "STEP", "LOSS", "TOK/S", "AGE", "DURATION", "NOTE"):
        t.add_column(col, no_wrap=col != "NOTE", overflow="fold")
    for j in jobs:
        t.add_row(
            j["id"],
            Text(j["status"], style=STATUS_STYLE.get(j["status"], "")),
            j["resources"],
            f"{j['step']}/{j['steps']}" if j["step"] is not None else f"-/{j['steps']}",
            _num(j["loss"], ".4f"),
            _num(j["tokens_per_s"], ",.0f"),
            _age(j["created_at"]),
            _duration(j),
            j["failure_reason"] or (f"{j['restarts']} restart(s)" if j["restarts"] else ""),
        )
    return t


def job_detail(job: dict) -> list:
    """Renderables for ``sftctl status JOB``: header, nodes, ranks, attempts."""
    head = Text.assemble(
        (job["id"], "bold"), "  ", (job["status"], STATUS_STYLE.get(job["status"], "")),
        f"  {job['resources']}  step {job['step'] if job['step'] is not None else '-'}/{job['steps']}",
        f"  age {_age(job['created_at'])}, ran {_duration(job)}",
    )
    out: list = [head]
    if job["failure_reason"]:
        out.append(Text(f"reason: {job['failure_reason']}", style="red"))
    if job["plan"]:
        out.append(Text(f"plan: {job['plan']}", style="dim"))
    nodes = Table(title="nodes", box=None, header_style="bold", title_justify="left")
    for col in ("RANK", "NODE", "STATUS", "WHERE"):
        nodes.add_column(col)
    for n in job["nodes"]:
        nodes.add_row(str(n["rank"]), n["id"], n["status"], n["where"])
    out.append(nodes)
    if job["ranks"]:
        ranks = Table(title="training ranks", box=None, header_style="bold", title_justify="left")
        for col in ("RANK", "STEP", "FIRST LOSS", "LOSS", "STEP TIME", "TOK/S", "LAST REPORT"):
            ranks.add_column(col, justify="right")
        for r in job["ranks"]:
            ranks.add_row(
                str(r["rank"]), str(r["step"]), _num(r["first_loss"], ".4f"), _num(r["loss"], ".4f"),
                _num(r["step_time_s"] and r["step_time_s"] * 1000, ".1f") + " ms",
                _num(r["tokens_per_s"], ",.0f"), _age(r["ts"]) + " ago",
            )
        out.append(ranks)
    if job["attempts"]:
        att = Table(title="attempts", box=None, header_style="bold", title_justify="left")
        for col in ("#", "STATUS", "EXIT", "REASON"):
            att.add_column(col)
        for a in job["attempts"]:
            att.add_row(str(a["number"]), a["status"], _num(a["exit_code"], "d"), a["reason"] or "")
        out.append(att)
    return out


def events_table(events: list[dict]) -> Table:
    t = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("TIME", "KIND", "MESSAGE"):
        t.add_column(col, overflow="fold")
    for e in events:
        t.add_row(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["ts"])), e["kind"], e["message"])
    return t


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
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task("pending", total=steps, loss="-", tps="-")
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self._partial: dict[int, str] = {}
        self._tps: dict[int, float] = {}

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
        self.progress.console.print(Text.assemble(("▸ ", "bold blue"), message))

    def log(self, rank: int, text: str) -> None:
        if not self.show_logs:
            return
        lines = (self._partial.get(rank, "") + text).split("\n")
        self._partial[rank] = lines.pop()
        for line in lines:
            self._print_log(rank, line)

    def _print_log(self, rank: int, line: str) -> None:
        self.progress.console.print(Text.assemble((f"(node {rank}) ", "dim"), line.rstrip("\r")))

    def metrics(self, samples: list[dict]) -> None:
        for s in samples:
            if s.get("loss") is not None and int(s.get("rank", 0)) == 0:
                if self.first_loss is None:
                    self.first_loss = float(s["loss"])
                self.last_loss = float(s["loss"])
            if s.get("tokens_per_s"):
                self._tps[int(s.get("rank", 0))] = float(s["tokens_per_s"])
        step = max(int(s["step"]) for s in samples)
        self.progress.update(
            self.task,
            completed=step,
            loss=f"{self.last_loss:.4f}" if self.last_loss is not None else "-",
            tps=f"{sum(self._tps.values()):,.0f}" if self._tps else "-",
        )
