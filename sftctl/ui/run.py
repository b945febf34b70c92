"""The attached ``sftctl run``'s view (:class:`RunView`: events and node output scroll above a
progress bar, printed by a thread of its own), which lines of a node's log it leaves out
(:class:`TorchNoise`), and :func:`log_line`, the one sanitiser of node output on a terminal
(``sftctl logs`` uses it too).

Rendering only; no state is changed here. Built on :mod:`sftctl.ui.views` (``tty_safe``, the
status styles); :mod:`sftctl.ui` re-exports the names.
"""

from __future__ import annotations

import dataclasses
import re

from rich.console import Console
from rich.text import Text

from sftctl.ui.views import _CONTROL, STATUS_STYLE, tty_safe


#: ``ESC [ params m``: a colour or style (SGR) sequence, the one escape a node's log line keeps
#: on a terminal (training progress bars colour their output); params are digits, ``;`` and ``:``
_SGR = re.compile(r"\x1b\[[0-9;:]{0,64}m")
_RESET = "\x1b[0m"


def log_line(text: str, terminal: bool) -> str:
    """One line of a node's log (str, without its newline) as written to the user's stdout:
    the one place ``sftctl logs`` and an attached ``run`` make node output safe to show.

    ``terminal`` False (a pipe, a file; ``--json`` never comes here): ``text`` unchanged, byte
    for byte, so ``sftctl logs JOB > f`` and ``| grep`` see what the job wrote.

    ``terminal`` True: what a terminal would obey is shown instead (the kubectl CVE-2021-25743
    class: a job on a shared server setting an admin's window title or clearing the screen):

    - SGR colour sequences ``ESC [ ... m`` are kept, and a line that has one ends with a reset
      ``ESC [0m`` so its colour cannot leak into the next line or the shell prompt;
    - ``\\r``: a trailing one (CRLF endings) is dropped, and of a line with several
      ``\\r``-separated parts only the last is kept. That is what a terminal leaves visible of a
      tqdm bar (tqdm redraws with ``\\r`` and writes its ``\\n`` only at the end, so one log line
      holds every redraw) and keeps the bar readable, while the job never gets the cursor back to
      column 0 to overwrite the ``(node N)`` prefix or sftctl's own progress line;
    - every other C0/C1 control character but tab (ESC of any other sequence, BEL, backspace,
      DEL, U+0080..U+009F) is shown as ``\\xNN`` (as :func:`tty_safe` does).

    A ``text`` with newlines is treated line by line. Pure; raises nothing.
    """
    if not terminal:
        return text
    out = []
    for line in text.split("\n"):
        line = line.rstrip("\r").rpartition("\r")[2]
        parts = _SGR.split(line)
        kept = _SGR.findall(line)
        safe = parts[0].translate(_CONTROL) + "".join(k + p.translate(_CONTROL) for k, p in zip(kept, parts[1:]))
        out.append(safe + _RESET if kept else safe)
    return "\n".join(out)


class RunView:
    """The attached ``sftctl run`` view: events and node logs scroll, a progress bar stays.

    Implements the controller's Reporter protocol without ever waiting on the output:
    :meth:`event` and :meth:`log` only queue; a printer thread of its own writes what is queued
    in large chunks (node output as text, each line with a ``(node N) `` prefix, long lines as
    they are: the terminal wraps them). So a job's outcome, end time and teardown never wait for
    a slow terminal or a pipe nobody reads; the rest of the output follows in :meth:`finish`.
    Use as a context manager (leaving it: :meth:`finish`), or :meth:`start` and :meth:`finish`.

    Args:
        console: where to draw (stderr when ``--json`` owns stdout).
        steps: total training steps, for the bar; None: no total (a plain script's own steps).
        show_logs: stream node logs (prefixed with their node rank).
        raw: every log line, torch's noise too (``sftctl --debug run``; else :class:`TorchNoise`).
    """

    #: characters of one line held back waiting for its end (its prefix and the noise filter
    #: need its start); past that the line is printed as it comes, its rest following it
    LONG_LINE = 65536
    #: characters of node output queued for the printer at most: past that (a terminal or pipe far
    #: slower than the job) node output is skipped until the printer catches up, and one line
    #: then says how much (``sftctl logs`` has all of it), so the backlog never grows without bound
    BACKLOG = 64 << 20

    def __init__(self, console: Console, steps: int | None, show_logs: bool = True, raw: bool = False):
        import threading

        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console
        self.show_logs = show_logs
        self.raw = raw
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
        self._tps: dict[int, float] = {}
        self._first: dict[int, float] = {}  # per rank: first and latest loss
        self._last: dict[int, float] = {}
        # the queue between the reporter's callers and the printer thread
        self._cv = threading.Condition()
        self._queue: list[tuple[int, str] | Text] = []  # (rank, node text) or an event's line
        self._queued = 0  # characters of node text in the queue
        self._skipped = 0  # characters of node text not queued since the printer last took it (BACKLOG)
        self._closing = False  # finish(): print what is queued, then end
        self._dropped = False  # abandon() or a closed output: the rest is not printed
        self._thread: threading.Thread | None = None
        # the printer thread's own: each rank's line in progress, and whose line the output ends in
        self._lines: dict[int, _NodeLines] = {}
        self._mid: int | None = None
        self._tags: dict[int, object] = {}  # each rank's prefix
        self._tty = console.is_terminal

    def __enter__(self) -> "RunView":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.finish()

    def start(self) -> "RunView":
        """Show the bar and start the printer thread."""
        import threading

        self.progress.start()
        self._thread = threading.Thread(target=self._print_loop, name="sftctl-run-printer", daemon=True)
        self._thread.start()
        return self

    def finish(self) -> None:
        """Print everything queued (each node's unfinished last line too), then stop the bar.
        Blocks until it is written; a signal (Ctrl-C) interrupts the wait, and :meth:`abandon`
        then drops the rest."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None:
            while self._thread.is_alive():
                self._thread.join(0.2)  # short waits: a signal's handler runs in between
        self.progress.stop()

    def abandon(self) -> None:
        """Print nothing more: what is queued is dropped, and so is whatever is reported later.
        The printer thread may still be inside one write to an output nobody reads."""
        with self._cv:
            self._dropped = self._closing = True
            self._queue.clear()
            self._cv.notify()

    def event(self, message: str) -> None:
        status = message.split(":", 1)[0]
        if status in STATUS_STYLE:
            self.progress.update(self.task, description=status.lower())
        self._put(Text.assemble(("▸ ", "bold blue"), tty_safe(message)))

    def log(self, rank: int, text: str) -> None:
        if self.show_logs and text:
            self._put((rank, text))

    def _put(self, item: tuple[int, str] | Text) -> None:
        with self._cv:
            if self._dropped:
                return
            if isinstance(item, tuple):
                if self._skipped or self._queued + len(item[1]) > self.BACKLOG:
                    self._skipped += len(item[1])
                    return
                self._queued += len(item[1])
            self._queue.append(item)
            self._cv.notify()

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

    # ------------------------------------------------------------------ the printer thread

    def _print_loop(self) -> None:
        """Take everything queued at once, render it to one chunk of text per run of node
        output, write it; at :meth:`finish`, the nodes' unfinished lines and end."""
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                items, self._queue, self._queued = self._queue, [], 0
                closing, dropped = self._closing, self._dropped
                if self._skipped:  # said after what was queued before it, the queue empty again
                    items.append(Text(f"▸ {self._skipped:,} characters of node output skipped here: the "
                                      "output fell behind the job (sftctl logs has all of it)", style="yellow"))
                    self._skipped = 0
            if dropped:
                return
            out: list = []
            for item in items:
                if isinstance(item, Text):
                    self._end_mid(out)
                    out.append(item)
                else:
                    self._node_text(item[0], item[1], out)
            if closing and not items:
                for rank, lines in self._lines.items():
                    if lines.held:
                        self._line_start(rank, lines.held + "\n", out)
                        lines.held = ""
                self._end_mid(out)
            self._write(out)
            if closing and not items:
                return

    def _node_text(self, rank: int, text: str, out: list) -> None:
        """Append node ``rank``'s ``text`` to ``out`` as whole lines, each after its prefix;
        the start of an unfinished line is held back until its end or :data:`LONG_LINE`."""
        lines = self._lines.setdefault(rank, _NodeLines(TorchNoise()))
        pieces = text.split("\n")
        for i, piece in enumerate(pieces):
            ends = i < len(pieces) - 1
            if lines.open:  # the rest of a long line, shown or not as its start was
                if lines.shown and (piece or ends):
                    self._line_rest(rank, (piece.rstrip("\r") + "\n") if ends else piece, out)
                lines.open = not ends
            elif ends:
                line, lines.held = lines.held + piece, ""
                if self.raw or lines.noise.keep(line):
                    self._line_start(rank, line.rstrip("\r") + "\n", out)
            else:
                lines.held += piece
                if len(lines.held) > self.LONG_LINE:
                    lines.shown = self.raw or lines.noise.keep(lines.held)
                    if lines.shown:
                        self._line_start(rank, lines.held, out)
                    lines.open, lines.held = True, ""

    def _line_start(self, rank: int, text: str, out: list) -> None:
        self._end_mid(out)
        out += [self._prefix(rank), self._safe(text)]
        self._mid = None if text.endswith("\n") else rank

    def _line_rest(self, rank: int, text: str, out: list) -> None:
        if self._mid != rank:  # another node's output came between: the rest on a line of its own
            self._end_mid(out)
            out.append(self._prefix(rank))
        out.append(self._safe(text))
        self._mid = None if text.endswith("\n") else rank

    def _end_mid(self, out: list) -> None:
        if self._mid is not None:
            out.append("\n")
            self._mid = None

    def _prefix(self, rank: int):
        """``(node RANK) ``: dim on a terminal (a Segment), else plain text."""
        tag = self._tags.get(rank)
        if tag is None:
            from rich.segment import Segment
            from rich.style import Style

            text = f"(node {rank}) "
            tag = self._tags[rank] = Segment(text, Style(dim=True)) if self._tty else text
        return tag

    def _safe(self, text: str) -> str:
        """Node output as it goes out (whole lines, or a part of a line longer than
        :data:`LONG_LINE`): on a terminal through :func:`log_line` (the one sanitiser of node
        output: colour kept, other escapes shown as ``\\xNN``); to a file or pipe, as the node
        wrote it."""
        return log_line(text, True) if self._tty else text

    def _write(self, out: list) -> None:
        """Write ``out``: each run of node text (str and prefix Segments) as one chunk, event
        lines through rich. A terminal gets the chunk through the console, which keeps the bar
        below it (no wrapping: soft_wrap); a file or pipe gets the text as it is, in one write.
        An output that fails (closed pipe, a terminal gone) drops the rest."""
        from rich.segment import Segment

        run: list = []
        for part in [*out, None]:
            if isinstance(part, (str, Segment)):
                run.append(part)
                continue
            try:
                if run:
                    if self._tty:
                        self.console.print(_Segments([p if isinstance(p, Segment) else Segment(p) for p in run]),
                                           soft_wrap=True, end="")
                    elif not self.console.quiet:
                        _write_text(self.console.file, "".join(p.text if isinstance(p, Segment) else p for p in run))
                if part is not None:
                    self.console.print(part)
            except (OSError, ValueError):  # EPIPE, EIO, a closed file: the job goes on without its view
                on_broken = getattr(self.console, "on_broken_pipe", None)
                if on_broken is not None:
                    on_broken()
                self.abandon()
                return
            run = []


@dataclasses.dataclass
class _NodeLines:
    """One node's output in the attached view, between two chunks of it."""

    noise: "TorchNoise"
    held: str = ""  # the start of a line not printed yet
    open: bool = False  # a long line printed in part: its rest is printed as it comes
    shown: bool = True  # whether that open line is shown (the noise filter saw its start)


class _Segments:
    """Segments printed as they are: no wrapping, no cropping, no markup."""

    def __init__(self, segments: list) -> None:
        self.segments = segments

    def __rich_console__(self, console, options):
        return self.segments


def _write_text(file, text: str) -> None:
    """``text`` to ``file`` in one write and flushed; characters its encoding lacks are escaped."""
    try:
        file.write(text)
    except UnicodeEncodeError:
        encoding = getattr(file, "encoding", None) or "utf-8"
        file.write(text.encode(encoding, "backslashreplace").decode(encoding))
    file.flush()


class TorchNoise:
    """Which lines of one node's log the attached view shows: known torch noise is left out
    (``sftctl logs``, the node logs and ``sftctl --debug run`` keep every line). Known noise:
    torchrun's warning that ``node_rank is only used for static rdzv_backend`` (sftctl sets no node
    rank with c10d, but a run: that calls torchrun with ``--node_rank`` itself prints it), and torchrun's ``Error waiting on exit
    barrier`` with the traceback frames that follow it (pytorch#69520: the exit barrier times out
    after the job finished); torch.distributed's warning and info log lines (``W1206 17:37:18.04
    11577 torch/distributed/...``: a node failing to shut the rendezvous down once the others
    left), c10d's C++ warnings (``[W1206 ... TCPStore.cpp:115] [c10d] recvVector failed``) with
    the C++ stack trace after them (``Exception raised from``, ``frame #N:``), and ``[c10d]``
    lines: at the clean end of a multi-node run the node whose store went away first prints them
    (issue 37.5). Error lines (``E1206 ...``) are shown: they say why a run failed."""

    LINES = ("node_rank is only used for static rdzv_backend",)
    BLOCKS = ("Error waiting on exit barrier",)
    CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
    # torch's Python log format (W/I only) for torch.distributed, and glog-style C++ warnings/info
    TORCH_LOG = re.compile(r"^[WI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ torch/distributed/")
    CXX_LOG = re.compile(r"^\[[WI]\d{4} \d\d:\d\d:\d\d\.\d+ ")
    CXX_TRACE = re.compile(r"^(Exception raised from |frame #\d+: |<omitting python frames>)")

    def __init__(self) -> None:
        self.state = "show"  # show | block (after a block's first line) | frames | after (its exception line)
        self.cxx = False  # after a hidden C++ warning: its stack trace follows

    def keep(self, line: str) -> bool:
        if self.TORCH_LOG.match(line) or line.startswith("[c10d]"):
            return False
        if self.CXX_LOG.match(line):
            self.cxx = True
            return False
        if self.cxx:
            if self.CXX_TRACE.match(line) or not line.strip():
                return False
            self.cxx = False
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
