"""``sftctl plan``'s table: the top offerings (one row each at its best region), one line of what
was left out, rejection reasons grouped (regions folded into one line), the close-call note.

Rendering only; the rows are the planner's :class:`sftctl.types.PlanChoice` records. The table is
a :class:`sftctl.ui.views.FitTable`.
"""

from __future__ import annotations

from rich.text import Text

from sftctl.plan_wording import close_call_note, format_hours
from sftctl.ui.views import Col, FitTable, _num, _seconds


def _region_free(c) -> str:
    """A rejection's line with the candidate's own region taken out, so one reason given for many
    regions ("region X is not in resources.regions") groups as one."""
    msg = str(c.rejected)
    region = c.offering.region
    return msg.replace(region, "{region}") if region and region in msg else msg


def _rejection_notes(rows: list) -> tuple[list[str], list[Text]]:
    """Each row's ``[k]`` and one note per distinct reason (regions folded: "region a, b, c
    (+4) is not in ..."), with how many rows share it."""
    keys: dict[str, list] = {}
    refs = []
    for c in rows:
        if c.rejected is None:
            refs.append("")
            continue
        keys.setdefault(_region_free(c), []).append(c)
        refs.append(f"[{list(keys).index(_region_free(c)) + 1}]")
    notes = []
    for k, (line, group) in enumerate(keys.items(), 1):
        if "{region}" in line:
            regions = list(dict.fromkeys(c.offering.region for c in group))
            named = ", ".join(regions[:3]) + (f" (+{len(regions) - 3})" if len(regions) > 3 else "")
            line = line.replace("{region}", named)
        notes.append(Text.assemble((f"[{k}] ", "bold"), (f"{len(group)} x " if len(group) > 1 else ""), line, style="dim"))
    return refs, notes


def _offering_key(c) -> tuple:
    o = c.offering
    return (o.provider, o.instance_type, o.accelerator, o.count, c.nodes)


def plan_rows(candidates: list, top: int | None = None) -> tuple[list, dict[int, list], str | None]:
    """What ``sftctl plan`` shows by default: one row per offering (provider, instance type,
    accelerator, nodes) at its best-ranked region, the feasible ones first, at most ``top`` of
    them (only when none is feasible: the best-ranked rejected ones); ``top`` None: every candidate,
    each its own row. Returns the rows, for each shown row's index the candidates it stands for
    (itself first), and one line saying what was left out and why (None when nothing was)."""
    if top is None:
        return list(candidates), {i: [c] for i, c in enumerate(candidates)}, None
    groups: dict[tuple, list] = {}
    for c in candidates:  # ranked best first: a group's first is its best region
        groups.setdefault(_offering_key(c), []).append(c)
    firsts = [g[0] for g in groups.values()]
    feasible = [c for c in firsts if c.rejected is None]
    shown = (feasible or firsts)[:top]
    members = {i: groups[_offering_key(c)] for i, c in enumerate(shown)}
    covered = sum(len(m) for m in members.values())
    if covered == len(candidates):
        return shown, members, None
    left = [c for c in candidates if not any(c is m for ms in members.values() for m in ms)]
    parts = []
    more = sum(c.rejected is None for c in left)
    if more:
        parts.append(f"{more} feasible ranked lower")
    codes: dict[str, int] = {}
    for c in left:
        if c.rejected is not None:
            codes[c.rejected.code.value] = codes.get(c.rejected.code.value, 0) + 1
    parts += [f"{n} {code.replace('_', ' ')}" for code, n in sorted(codes.items(), key=lambda kv: -kv[1])]
    other_regions = covered - len(shown)
    line = (f"showing {len(shown)} of {len(candidates)} candidates"
            + (f" (+{other_regions} in other regions, counted in REGION)" if other_regions else "")
            + (f"; left out: {', '.join(parts)}" if parts else "")
            + "; --all shows every row, --json every candidate")
    return shown, members, line


def _close_call_line(pick, ranked: list, shown: list, members: dict[int, list]) -> str:
    """The pick's close-call note naming the runner-up by the row this table shows it as (``#3``;
    regions grouped, so not its rank among the candidates), or as not shown; the note as the plan
    keeps it (the offering named, no number) when the runner-up cannot be found in ``ranked``."""
    close = getattr(pick, "close_call", None) or {}
    rank = close.get("runner_up_rank")
    other = ranked[rank - 1] if isinstance(rank, int) and 0 < rank <= len(ranked) else None
    if other is None:
        return pick.ranking_note
    row = next((k for k in range(len(shown)) if any(m is other for m in members[k])), None)
    return close_call_note(close, None if row is None else row + 1, shown=row is not None) or pick.ranking_note


def _learned_runs(c) -> int:
    """How many past runs corrected candidate ``c``'s step: on its accelerator and on others."""
    learned = getattr(c, "learned", None) or {}
    return int(learned.get("runs") or 0) + int(learned.get("other_accelerator_runs") or 0)


def plan_table(candidates: list, steps: int, top: int | None = None, script_steps: bool = False,
               no_step: str | None = None) -> FitTable:
    """``sftctl plan``: one row per candidate offering, best first; with ``top`` (the CLI's
    default, 10): one row per offering at its best region (``+N`` in REGION: the other regions
    it is sold in, up to which $/H), at most ``top`` rows, and one line of what was left out
    (:func:`plan_rows`).

    A rejected row says ``no [k]``; reason ``k`` is printed once under the table, with how many
    rows share it (one reason given for many regions is one line naming them). CLOUD is the
    provider, as ``resources.clouds`` names it. With a model, STRATEGY says ``ddp`` or ``fsdp`` (``+ckpt``: activation checkpointing) for each offering;
    LAYOUT instead where a row's layout is model-parallel (``tp8 pp4 dp2 fsdp+ckpt``, every row's
    layout: :mod:`sftctl.compiler.layouts`).
    Numbers are never cut, and the columns that say what would launch and where (PROVIDER,
    INSTANCE, ACCEL, NODES, REGION, $/H, STEP, TOTAL $) are never hidden: narrow terminals hide
    #, $/STEP, TIME, MEMORY, STRATEGY and STEP RANGE, in that order, then NODES when every row has
    the same count (the title says it) and VERDICT when every row is feasible, then put one cell
    between columns and fold REGION. STEP RANGE
    is the step time divided and multiplied by the accelerator's error factor
    (:mod:`sftctl.compiler.accuracy`); `*` marks an uncalibrated accelerator, and one note says
    when the pick's interval overlaps the runner-up's (:func:`sftctl.planner._ranking_notes`).

    When no row shown has a step time the title promises no total (``by $/H: no step time``)
    and ``no_step`` (:func:`sftctl.plan_wording.no_step_time`: why, and the field to add) is the
    first line under the table."""
    shown, members, left_out = plan_rows(candidates, top)
    ranked, candidates = candidates, shown
    refs, notes = _rejection_notes(candidates)
    one_count = len({c.nodes for c in candidates}) == 1  # NODES tells no row from another: the title says it
    all_ok = all(c.rejected is None for c in candidates)  # VERDICT: "chosen" then "ok" (the line below names the pick)
    cols = [Col("#", "right", drop=0), Col("CLOUD"), Col("INSTANCE"), Col("ACCEL"),
            Col("NODES", "right", drop=7 if one_count else None),
            Col("REGION", wrap=True, min_wrap=9, fold_last=True), Col("$/H", "right"), Col("STEP", "right"),
            Col("MEMORY", "right", drop=3), Col("$/STEP", "right", drop=1), Col("TIME", "right", drop=2),
            Col("TOTAL $", "right"), Col("VERDICT", drop=8 if all_ok else None)]
    ranged = any(getattr(c, "step_time_interval_s", None) for c in candidates)
    if ranged:  # the step's interval from the accelerator's calibration error, after STEP
        cols.insert(8, Col("STEP RANGE", "right", drop=5))
    queued = any(getattr(c, "queue_wait_s", None) is not None for c in candidates)
    if queued:  # a Slurm cluster: its queue wait and the finish (wait + run), before VERDICT
        cols[-1:-1] = [Col("QUEUE", "right"), Col("FINISH", "right")]
    strategies = any(getattr(c, "parallelism", None) for c in candidates)
    # issue 38: a model-parallel layout on some row: LAYOUT (tp8 pp4 dp2 fsdp) instead of STRATEGY
    layouts = any((getattr(c, "layout", None) or {}).get("source") == "search" for c in candidates)
    if strategies:  # a model: the data-parallel strategy (or the layout) the memory and step are predicted for
        cols.insert(10 if any(getattr(c, "step_time_interval_s", None) for c in candidates) else 9,
                    Col("LAYOUT" if layouts else "STRATEGY", drop=4))
    from sftctl.catalog import older_prices

    older = older_prices()  # rows priced from an older catalog row than their type's newest: "!"
    dated = len({c.offering.as_of for c in candidates}) > 1  # PRICED: each row's price date, where they differ
    rows = []
    for i, (c, ref) in enumerate(zip(candidates, refs), 1):
        o = c.offering
        step = _learned_runs(c) and c.calibrated_step_s or c.step_time_s  # STEP, $/STEP and TOTAL agree
        per_step = c.usd_per_hour * step / 3600 if c.usd_per_hour is not None and step else None
        verdict = Text("ok", style="green") if c.rejected is None else Text(f"no {ref}", style="dim")
        if i == 1 and c.rejected is None:
            verdict = Text("chosen", style="bold green")
        owned = o.provider == "slurm" and c.usd_per_hour == 0  # the lab's own cluster, no price set
        row = [
            str(i), o.provider, o.instance_type, f"{o.accelerator}:{o.count}", str(c.nodes),
            o.region + (f" +{len(members[i - 1]) - 1}" if len(members[i - 1]) > 1 else ""),
            "owned" if owned else _num(c.usd_per_hour, ",.2f"),
            _seconds(step),
            "-" if c.peak_memory_bytes is None else f"{c.peak_memory_bytes / 2**30:.1f} GiB",
            "-" if per_step is None else f"{per_step:.5f}", format_hours(c.hours), _num(c.total_usd, ",.2f"), verdict,
        ]
        cal = getattr(c, "calibration", None)
        if cal is not None and not cal.get("calibrated") and not (getattr(c, "learned", None) or {}).get("runs"):
            row[7] += " *"  # uncalibrated, and no run of its own corrects it: noted under the table
        if ranged:
            iv = getattr(c, "step_time_interval_s", None)
            row.insert(8, "-" if not iv else f"{_seconds(iv[0])}-{_seconds(iv[1])}")
        if strategies:
            par = getattr(c, "parallelism", None)
            lay = (getattr(c, "layout", None) or {}).get("label") if layouts else None
            row.insert(10 if ranged else 9,
                       "-" if par is None else (lay or par) + ("+ckpt" if getattr(c, "activation_checkpointing", False) else ""))
        if queued:
            wait = getattr(c, "queue_wait_s", None)
            finish = getattr(c, "finish_s", None)
            row[-1:-1] = ["-" if wait is None else format_hours(wait / 3600),
                          "-" if finish is None else format_hours(finish / 3600)]
        if (o.provider, o.instance_type, o.region) in older:
            row[6] += " !"  # noted under the table
        if dated:
            row.insert(7, o.as_of or "-")
        rows.append(row)
    if dated:
        cols.insert(7, Col("PRICED", drop=6))
    flagged = {}
    for c in candidates:
        newest = older.get((c.offering.provider, c.offering.instance_type, c.offering.region))
        if newest is not None:
            flagged.setdefault(c.offering.instance_type, (c, newest))
    if flagged:
        notes.append(Text("! an older price than its type's newest: " + ", ".join(
            f"{t} {c.offering.as_of or '?'} (newest {n.as_of}: ${n.usd_per_hour:,.2f}/h in {n.region})"
            for t, (c, n) in flagged.items()) + "; sftctl catalog refresh reads current prices", style="dim"))
    learned = sorted({(c.offering.accelerator, c.learned.get("runs") or 0, c.learned.get("other_accelerator_runs") or 0)
                      for c in candidates if _learned_runs(c)})
    # an accelerator its own past runs correct is calibrated by them, whatever its kernels' table says
    uncal = sorted({c.offering.accelerator for c in candidates
                    if getattr(c, "calibration", None) and not c.calibration.get("calibrated")}
                   - {a for a, own, _ in learned if own})
    if uncal:
        notes.append(Text(f"* uncalibrated: no measured kernels or steps on {', '.join(uncal)}; the range is the "
                          "error of the published-steps check", style="dim"))
    if learned:
        notes.append(Text("STEP and STEP RANGE learned from past runs (" + ", ".join(
            f"{a}: " + " + ".join([f"{own}"] * bool(own) + [f"{other} on other GPUs"] * bool(other))
            for a, own, other in learned)
                          + "; sftctl calibrate show); --json has the model's step_time_s beside calibrated_step_s",
                          style="dim"))
    for i, c in enumerate(candidates, 1):
        if getattr(c, "ranking_note", None):
            notes.append(Text(f"#{i}: {_close_call_line(c, ranked, shown, members)}", style="dim"))
    dearer = []  # offerings whose other regions cost much more: one line
    for i, c in enumerate(candidates, 1):
        prices = [m.usd_per_hour for m in members[i - 1] if m.usd_per_hour]
        if len(prices) > 1 and max(prices) >= 1.5 * min(prices):
            stale = sum((m.offering.provider, m.offering.instance_type, m.offering.region) in older for m in members[i - 1])
            dearer.append(f"{c.offering.instance_type} ${min(prices):,.2f}-{max(prices):,.2f}"
                          + (f" ({stale} of them older prices, !)" if stale else ""))
    if dearer:
        notes.append(Text(f"$/H by region (--all lists each): {', '.join(dearer)}", style="dim"))
    if left_out:
        notes.append(Text(left_out, style="dim"))
    nodes = f" on {candidates[0].nodes} node(s)" if candidates and one_count else ""
    # script_steps: the spec sets no train.steps, so its script decides; TOTAL $ is for the default
    what = f"steps: set by your script (TOTAL $ for {steps:,})" if script_steps else f"for {steps:,} steps"
    if candidates and all(c.step_time_s is None for c in candidates):  # no TIME, no TOTAL $ to promise
        if no_step:
            notes.insert(0, Text(no_step))
        what = "steps: set by your script" if script_steps else what
        return FitTable(cols, rows, title=f"offerings {what}{nodes}, by $/H: no step time", notes=notes)
    return FitTable(cols, rows, title=f"offerings {what}{nodes}", notes=notes)
