"""How a plan reads: the lines :func:`sftctl.planner.plan` and the plan table say about its rows
(durations, prices, the chosen offering's reason, why nothing is feasible, why no row has a
step time, a close call between the pick and its runner-up). Wording only: every figure comes
from the :class:`~sftctl.types.PlanChoice` rows (and the ``close_call`` data) the planner made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from sftctl.types import FailureCode, PlanChoice

if TYPE_CHECKING:
    from sftctl.spec import JobSpec


def close_call_note(close: dict, row: int | None = None, shown: bool = True) -> str | None:
    """The one line a close call prints (None when the intervals do not overlap), from
    :func:`sftctl.planner._ranking_notes`' ``close_call``. The runner-up is named by its offering
    (``H100:8 (aws p5.48xlarge, us-east-1)``), after ``#row`` when a table shows it as that row
    (the row the reader sees, not its rank among the candidates: ``sftctl plan`` groups regions),
    or with "not among the rows shown" when ``shown`` is false."""
    if not close.get("within_error"):
        return None
    fmt: Callable[[float], str]
    if close.get("metric") == "step_time_s":
        fmt, what, worse = _step_figure, "fastest", "slower"
    else:
        fmt, what, worse = _usd_figure, "cheapest", "more"

    def span(iv: list) -> str:  # $0.715-2.42, 8.7 ms-11.5 ms
        return f"{fmt(iv[0])}-{fmt(iv[1]).lstrip('$')}"

    pick, other = close["pick"], close["runner_up"]
    where = close.get("runner_up_offering") or {}
    place = ", ".join(x for x in (f"{where.get('provider', '')} {where.get('instance_type', '')}".strip(),
                                  where.get("region", "")) if x)
    if not shown:
        place += "; not among the rows shown, --all lists it"
    named = (f"#{row} " if row is not None and shown else "") + other + (f" ({place})" if place else "")
    a, b = close["pick_value"], close["runner_up_value"]
    note = (f"may not be the {what}: {named} is {b / a - 1:.1%} {worse} ({fmt(b)} vs {fmt(a)}), "
            f"within the error ({span(close['runner_up_interval'])} vs {span(close['pick_interval'])})")
    sa, sb = close.get("pick_usd_per_step"), close.get("runner_up_usd_per_step")
    per = next(((u, close[f"pick_{k}"], close[f"runner_up_{k}"]) for k, u in
                (("usd_per_mtok", "tokens"), ("usd_per_msample", "samples")) if f"pick_{k}" in close), None)
    if per is not None:
        note += f"; per 1M {per[0]}: {pick} {_usd_figure(per[1])}, {other} {_usd_figure(per[2])}"
    elif sa is not None and sb is not None:
        note += f"; per step: {pick} {_usd_figure(sa)}, {other} {_usd_figure(sb)}"
    return note


def _usd_figure(v: float) -> str:
    """``$0.167``, ``$12.3``, ``$1,234``: three significant figures, whole dollars from 1,000."""
    return f"${v:,.0f}" if v >= 1000 else f"${v:.3g}"


def _step_figure(s: float) -> str:
    """``10.0 ms`` below a second, else ``1.25 s``."""
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _reason(best: PlanChoice, ranked: list[PlanChoice], objective: str) -> str:
    o = best.offering
    feasible = sum(c.rejected is None for c in ranked)
    what = "fastest" if objective == "time" else "cheapest"
    pred = ""
    if best.step_time_s is not None:
        how = f" ({best.mode} mode)" if best.mode else ""
        runs = (best.learned or {}).get("runs") or 0
        other = (best.learned or {}).get("other_accelerator_runs") or 0
        by = " and ".join([f"{runs} past run(s)"] * bool(runs) + [f"{other} on other accelerators"] * bool(other))
        learned = (f" (model {best.step_time_s * 1000:.1f}, corrected by {by})"
                   if by and best.calibrated_step_s else "")
        pred = (f", predicted {(best.calibrated_step_s or best.step_time_s) * 1000:.1f} ms/step{how}{learned}, "
                f"{format_hours(best.hours)}, ${best.total_usd:,.2f} in all")
    if best.parallelism is not None:
        pred += f", {best.parallelism_reason}"
    blocked = sorted({c.offering.provider for c in ranked
                      if c.rejected is not None and c.rejected.code == FailureCode.NOT_CONFIGURED})
    if best.queue_wait_s is not None:
        pred += f", Slurm start in {format_hours(best.queue_wait_s / 3600)}"
        if best.finish_s is not None:
            pred += f", finish in {format_hours(best.finish_s / 3600)}"
    return (
        f"chose {o.provider} {o.instance_type} ({o.accelerator}:{o.count}) x {best.nodes} node(s) "
        f"at ${best.usd_per_hour:.2f}/h{pred}: {what} of {feasible} feasible offering(s) of {len(ranked)}"
        + (f"; not usable here: {', '.join(blocked)}" if blocked else "")
    )


def no_step_time(spec: JobSpec, candidates: Sequence[PlanChoice]) -> str | None:
    """Why no row of ``candidates`` has a step time, in one line with the fix (``plan``'s line
    under its table and ``plan --json``'s ``no_step_time``), or None when a row has one or the
    spec has a model (a model that could not be predicted has its own warning)."""
    if spec.model is not None or any(c.step_time_s is not None for c in candidates):
        return None
    return ("no step time: the spec has no `model:` to trace, so no TIME or TOTAL $ (ranked by $/H); add "
            "model: {framework, entrypoint, batch_size, dtype} (docs/spec.md) to predict them")


def format_hours(h: float | None) -> str:
    """A duration given in hours, in the unit a person reads best (s, min or h)."""
    if h is None:
        return "-"
    if h < 1 / 60:
        return f"{h * 3600:.1f} s"
    return f"{h * 60:.1f} min" if h < 1 else f"{h:.1f} h"


def _why_none(ranked: list[PlanChoice], width: int = 160) -> str:
    """The rejections of an infeasible plan in one short clause (``sftctl plan`` lists them all):
    each distinct line with its count when they fit ``width`` characters, else grouped by
    failure code, most common first, ``N x <line>`` when a group has one line, else
    ``N <code> (e.g. <its shortest line>)``; groups that would pass ``width`` characters are
    left to ``...``."""
    if not ranked:
        return ": no provider offers it"
    counts: dict[str, int] = {}
    for c in ranked:
        counts[c.rejected.message] = counts.get(c.rejected.message, 0) + 1
    each = "; ".join(f"{n} x {why}" for why, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    if len(each) <= width:  # every distinct line fits: say them all
        return f" ({each})"
    by_code: dict[str, list[str]] = {}
    for c in ranked:
        by_code.setdefault(c.rejected.code.value, []).append(c.rejected.message)
    parts: list[str] = []
    for code, lines in sorted(by_code.items(), key=lambda kv: -len(kv[1])):
        unique = set(lines)
        part = (f"{len(lines)} x {lines[0]}" if len(unique) == 1
                else f"{len(lines)} {code.replace('_', ' ')} (e.g. {min(unique, key=len)})")
        if parts and len("; ".join(parts + [part])) > width:
            parts.append("...")
            break
        parts.append(part)
    return f" ({'; '.join(parts)})"
