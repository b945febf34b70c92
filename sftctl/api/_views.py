"""Jobs as the api shows them (see :mod:`sftctl.api`): :class:`JobView` and :func:`status`,
:func:`wait`, :func:`logs`, :func:`events`, :func:`metrics`, :func:`costs`, :func:`down`."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from sftctl.api._base import JOB_ARGS, Progress, _reap, _remote, _resolve, _store, _type_name, _typed
from sftctl.errors import ExitCode, NotFoundError, SftctlError
from sftctl.types import Attempt, Cost, CostTotal, Event, JobRecord, JobStatus, MetricsRecord, NodeRecord, NodeState, Record, StepRecord

if TYPE_CHECKING:
    from sftctl.state import Store


# ------------------------------------------------------------------------------ status


@dataclasses.dataclass(frozen=True)
class JobView:
    """A job as ``sftctl status`` shows it: its record, the latest metrics of each rank and, for
    one job (``detail``), its nodes (with what the provider sees when the controller is gone),
    attempts and health events.

    ``step`` is the slowest rank's step, ``loss`` the mean over the ranks' latest reports,
    ``tokens_per_s`` their sum.
    """

    record: JobRecord
    ranks: list[MetricsRecord]
    detail: bool = False
    nodes: list[NodeRecord] = dataclasses.field(default_factory=list)
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    health: list[Event] = dataclasses.field(default_factory=list)
    rank_nodes: dict[int, int] = dataclasses.field(default_factory=dict)  # training rank -> node rank
    cost: Cost | None = None  # accumulated so far (None before it is planned)
    step_time: dict | None = None  # predicted vs measured step (sftctl.history.step_time_view); None: neither
    overrides: list[str] = dataclasses.field(default_factory=list)  # detail: the --set it was submitted with

    id = property(lambda self: self.record.id)
    name = property(lambda self: self.record.name)
    status = property(lambda self: self.record.status)
    failure_reason = property(lambda self: self.record.failure_reason)

    @property
    def step(self) -> int | None:
        return min(r.step for r in self.ranks) if self.ranks else None

    @property
    def loss(self) -> float | None:
        losses = [r.loss for r in self.ranks if r.loss is not None]
        return sum(losses) / len(losses) if losses else None

    @property
    def tokens_per_s(self) -> float | None:
        tps = [r.tokens_per_s for r in self.ranks if r.tokens_per_s is not None]
        return sum(tps) if tps else None

    def to_dict(self) -> dict[str, Any]:
        """``status --json``'s document for this job (``run --json`` adds ``wall_s``).

        Unlike :meth:`JobRecord.to_dict` it summarizes: ``resources`` ("local cpu:1 x2"),
        ``nodes`` (the count; with detail, the node rows ``{"id", "rank", "status", "where"}``),
        ``step``/``steps``/``loss``/``tokens_per_s`` over the ranks, ``plan`` (the plan's reason,
        not the plan), ``pending_reason`` while PENDING (local admission) or RUNNING with its nodes
        queued by the scheduler (Slurm's reason), and leaves out the spec. With
        detail: ``ranks`` (:class:`MetricsRecord` each, with ``node``: the node rank it runs on), ``attempts`` (:class:`Attempt` each) and
        ``health`` (each health event's ``ts`` and ``message`` with its data's keys).
        """
        job = self.record
        res = job.spec["resources"]
        o = job.offering
        doc = {
            "id": job.id,
            "name": job.name,
            "owner": job.owner,  # the user it belongs to (this machine's user without a server)
            "labels": dict(job.spec.get("labels") or {}),  # the spec's labels: and run --label
            "status": job.status.value,
            "terminal": job.status.terminal,  # SUCCEEDED, FAILED, CANCELLED, FAILED_CONTROLLER
            "resources": f"{o.provider} {o.accelerator}:{o.count} x{res['nodes']}" if o else f"x{res['nodes']}",
            "provider": job.provider,
            "nodes": res["nodes"],
            "step": self.step,
            # a plain shell job that reports no metrics has no step count to show
            "steps": job.spec["train"]["steps"] if job.spec.get("model") or self.ranks else None,
            "loss": self.loss,
            "tokens_per_s": self.tokens_per_s,
            "restarts": job.restarts,
            "failure_reason": job.failure_reason,
            "failure_code": job.failure_code,
            # local admission (PENDING) or the scheduler's queue (RUNNING, nodes queued in Slurm)
            "pending_reason": job.pending_reason if job.status in (JobStatus.PENDING, JobStatus.RUNNING) else None,
            "created_at": job.created_at,
            "ended_at": job.ended_at,
            "controller_pid": job.controller_pid,
            "cost": self.cost.to_dict() if self.cost else None,  # {usd, price_per_hour, source, node_hours}
            # {predicted_s, model_s, interval_s, measured_s, measured_steps, difference, measured_refused,
            # refused_ratio}: PRED vs ACTUAL
            "step_time": self.step_time,
        }
        if self.detail:
            doc["plan"] = job.plan_reason
            doc["ranks"] = [{**r.to_dict(), "node": self.rank_nodes.get(r.rank)} for r in self.ranks]
            doc["nodes"] = [{"id": n.id, "rank": n.rank, "status": n.status, "where": getattr(n.node_handle, "ip", None) or n.provider}
                            for n in self.nodes]
            doc["attempts"] = [a.to_dict() for a in self.attempts]
            doc["health"] = [{"ts": e.ts, "message": e.message, **(e.data or {})} for e in self.health]
            doc["overrides"] = list(self.overrides)  # "key.path=value" each, in the order given
        return doc

    def to_wire(self) -> dict[str, Any]:
        """The view as the server sends it: its records whole (:meth:`from_wire` reads it back),
        so a client's :meth:`to_dict` is the same document as the server's; a view without
        ``detail`` (a row of the jobs list) leaves out its plan's ``candidates``, which can be
        hundreds per job (``status(job)`` has them)."""
        record = self.record.to_dict()
        if not self.detail and record.get("plan"):
            record["plan"] = {k: v for k, v in record["plan"].items() if k != "candidates"}
        return {"record": record, "ranks": [r.to_dict() for r in self.ranks], "detail": self.detail,
                "nodes": [n.to_dict() for n in self.nodes], "attempts": [a.to_dict() for a in self.attempts],
                "health": [e.to_dict() for e in self.health],
                "rank_nodes": {str(k): v for k, v in self.rank_nodes.items()},
                "cost": self.cost.to_dict() if self.cost else None, "step_time": self.step_time,
                "overrides": list(self.overrides)}

    @classmethod
    def from_wire(cls, doc: dict[str, Any]) -> "JobView":
        """Read :meth:`to_wire`'s document back."""
        return cls(JobRecord.from_dict(doc["record"]), [MetricsRecord.from_dict(r) for r in doc["ranks"]],
                   doc["detail"], [NodeRecord.from_dict(n) for n in doc["nodes"]],
                   [Attempt.from_dict(a) for a in doc["attempts"]], [Event.from_dict(e) for e in doc["health"]],
                   {int(k): v for k, v in doc["rank_nodes"].items()},
                   Cost.from_dict(doc["cost"]) if doc.get("cost") else None, doc.get("step_time"),
                   list(doc.get("overrides") or []))


JOB_ARGS[JobView] = "id"  # a job argument may be a JobView


@_typed
def job(job: str) -> JobRecord:
    """The job's record, by id or unique id prefix (a dead controller's job reads FAILED_CONTROLLER).

    Raises:
        NotFoundError: empty, unknown or ambiguous id (exit 2).
    """
    if _remote() is not None:
        return status(job).record
    return _resolve(_store(), job)


#: the newest reported steps (all ranks together) a running job's ACTUAL is the median of
STATUS_SERIES_ROWS = 2048


def _step_time(store: Store, job: JobRecord, run: Any, refused: dict | None = None) -> dict | None:
    """PRED vs ACTUAL of a job: the plan's step time (corrected by history where it was) and the
    measured one: its run-history row once measured, else (while it runs) its reported steps;
    ended without a row, the measurement the controller refused (``refused``: the data of its
    ``measured`` event with ``kept`` false; None: read from ``store`` here). Beyond
    :data:`~sftctl.controller.common.MEASURED_MAX_FACTOR` of the model's step, ``measured_refused``
    is true and ``refused_ratio`` the measured over the model's step (None beyond a float): the
    run history does not keep it (:func:`~sftctl.controller.common.off_prediction`)."""
    import math

    from sftctl.controller.common import off_prediction
    from sftctl.history import measured_step_s, step_time_view

    plan = job.plan
    model = plan.planned("step_time_s") if plan is not None else None
    predicted = (plan.planned("calibrated_step_s") or model) if plan is not None else None
    ratio: float | None = None
    if run is not None:
        measured, n = run.measured_step_s, run.measured_steps or 0
    elif predicted is not None and not job.status.terminal:
        measured, n = measured_step_s(store.step_series(job.id, last=STATUS_SERIES_ROWS))
        ratio = None if measured is None or not model else off_prediction(measured, model)
    elif predicted is not None and (refused := _refused(store, job.id) if refused is None else refused):
        measured, n = refused.get("measured_s"), refused.get("measured_steps") or 0
        ratio = refused.get("ratio") or math.inf  # null: beyond a float
    else:
        measured, n = None, 0
    view = step_time_view(predicted, measured, n, plan.planned("step_time_interval_s") if plan is not None else None)
    if view is None:
        return None
    if view["difference"] is not None and not math.isfinite(view["difference"]):
        view["difference"] = None  # 1e308 s over 0.7 ms: no JSON number
    return {**view, "model_s": model, "measured_refused": ratio is not None,
            "refused_ratio": ratio if ratio is not None and math.isfinite(ratio) else None}


def _refused(store: Store, job_id: str) -> dict:
    """The data of the job's ``measured`` event whose measurement the controller did not keep
    (``kept`` false, ``measured_s``, ``ratio``, ...); ``{}`` when there is none."""
    return next((e.data for e in reversed(store.events_of_kind("measured", [job_id]))
                 if e.data and e.data.get("kept") is False), {})


def _view(store: Store, job: JobRecord, detail: bool = False, ranks: list[MetricsRecord] | None = None,
          spans: list[tuple[float, float | None]] | None = None, runs: dict[str, Any] | None = None,
          refused: dict[str, dict] | None = None) -> JobView:
    if ranks is None:
        ranks = store.metrics(job.id)
    if spans is None:
        spans = store.node_spans(job.id).get(job.id, [])
    if runs is None:
        runs = {r.job_id: r for r in store.runs(job_ids=[job.id])}
    cost = _cost(job, spans)
    step_time = _step_time(store, job, runs.get(job.id), None if refused is None else refused.get(job.id, {}))
    if not detail:
        return JobView(job, ranks, cost=cost, step_time=step_time)
    nodes = [dataclasses.replace(n, status=_node_status(job, n)) for n in store.nodes(job.id)]
    events = store.events(job.id)
    health = [e for e in events if e.kind == "health"]
    overrides = next((list(e.data.get("overrides") or []) for e in events if e.kind == "submit" and e.data), [])
    return JobView(job, ranks, True, nodes, store.attempts(job.id), health, _job_rank_nodes(job, events), cost, step_time,
                   overrides)


def _node_hours(job: JobRecord, spans: list[tuple[float, float | None]], since: float | None = None,
                until: float | None = None, now: float | None = None) -> float:
    """Hours the job's nodes billed inside [since, until]. A node bills from when it was recorded
    until it was TERMINATED or REPLACED; one with no end bills until the job ended (its
    controller tore it down), or until now when the job is live or its controller died (then
    nothing may have stopped it: ``sftctl down`` does). Local nodes stop by themselves within
    seconds of their controller's death (:func:`sftctl.procs.guard`), so theirs end with the job."""
    from sftctl.types import capabilities

    now = time.time() if now is None else now
    stopped = job.status != JobStatus.FAILED_CONTROLLER or (job.provider and capabilities(job.provider).local_admission)
    open_end = job.ended_at if job.status.terminal and stopped else None
    total = 0.0
    for start, end in spans:
        end = end if end is not None else (open_end if open_end is not None else now)
        lo, hi = max(start, since if since is not None else start), min(end, until if until is not None else end)
        total += max(0.0, hi - lo)
    return total / 3600.0


def _cost(job: JobRecord, spans: list[tuple[float, float | None]], since: float | None = None,
          until: float | None = None) -> Cost | None:
    """The job's :class:`~sftctl.types.Cost` (None before it has an offering)."""
    o = job.offering
    if o is None:
        return None
    spot = bool((job.spec.get("resources") or {}).get("spot"))
    price = o.price(spot)
    hours = _node_hours(job, spans, since, until)
    where = f"{o.provider} {o.instance_type}" + (f" in {o.region}" if o.region else "")
    if price is None:
        source = f"no spot price for {where} in the catalog"
    else:
        source = (f"{'spot' if spot else 'on-demand'} price of {where}: {o.source or 'the catalog'}"
                  + (f" ({o.as_of})" if o.as_of else ""))
    usd = None if price is None else round(price * hours, 6)
    return Cost(usd=usd, price_per_hour=price, source=source, node_hours=round(hours, 6))


def _rank_nodes(events: list[Event]) -> dict[int, int]:
    """Training (global) rank -> node rank, from the controller's latest ``ranks`` event (the
    rendezvous, not sftctl, assigns ranks: c10d may give rank 0 to node 1)."""
    placed = [e for e in events if e.kind == "ranks"]
    return {int(r): n for r, n in ((placed[-1].data or {}).get("ranks") or {}).items()} if placed else {}


def _job_rank_nodes(job: JobRecord, events: list[Event]) -> dict[int, int]:
    """:func:`_rank_nodes`, and for a one-node job whose script reported no rank (a plain script
    that never calls ``sftctl.train.report``) every rank it can have, each on node 0: rank 0 for
    one process, 0..count-1 for one per accelerator."""
    placed = _rank_nodes(events)
    if placed or job.spec["resources"]["nodes"] != 1:
        return placed
    count = job.offering.count if job.offering is not None and job.offering.count else 1
    return dict.fromkeys(range(count), 0)


def _node_status(job: JobRecord, node: NodeRecord) -> str:
    """The node's recorded status, or, when its controller is gone, what the provider sees now."""
    handle = node.node_handle
    if job.status != JobStatus.FAILED_CONTROLLER or node.status == NodeState.TERMINATED or handle is None:
        return node.status
    from sftctl.controller.submit import job_provider

    return job_provider(job, node.provider).status(handle).state.value


@_typed
def status(job: str | None = None, *, all_users: bool = False,
           labels: Mapping[str, str] | None = None) -> JobView | list[JobView]:
    """One job in detail, or every job (newest first) without. Marks jobs whose controller died
    FAILED_CONTROLLER first. ``labels``: the list only has the jobs whose spec's ``labels`` hold
    every one of these ``key: value`` pairs.

    Raises:
        NotFoundError: ``job`` matches no job or several (exit 2).

    With a server configured: the jobs of this token's user there (``all_users``: every user's,
    for an admin; else a :class:`SftctlError`, exit 2); the list's records carry their plan
    without its ``candidates`` (one job's view has them).
    """
    remote = _remote()
    if remote is not None:
        if job is not None:
            return JobView.from_wire(remote.request("GET", remote.job_path(job)))
        views = [JobView.from_wire(d) for d in remote.request("GET", "/v1/jobs", params={"all_users": all_users})["jobs"]]
        return [v for v in views if _labelled(v.record, labels)]
    if all_users:
        raise SftctlError("--all-users is for a server's admins; without a server every job here is shown",
                          hint="sftctl status")
    store = _store()
    if job is not None:
        return _view(store, _resolve(store, job), detail=True)
    _reap(store)
    by_job: dict[str, list[MetricsRecord]] = {}
    for r in store.metrics():
        by_job.setdefault(r.job_id, []).append(r)
    spans = store.node_spans()
    runs = {r.job_id: r for r in store.runs(source="run")}
    jobs = [j for j in store.list_jobs() if _labelled(j, labels)]
    unkept = [j.id for j in jobs if j.status.terminal and j.id not in runs and j.plan is not None]
    refused = {e.job_id: e.data for e in store.events_of_kind("measured", unkept) if e.data and e.data.get("kept") is False}
    return [_view(store, j, ranks=by_job.get(j.id, []), spans=spans.get(j.id, []), runs=runs, refused=refused)
            for j in jobs]


def _labelled(job: JobRecord, labels: Mapping[str, str] | None) -> bool:
    """Whether the job's spec's ``labels`` hold every pair of ``labels`` (None or empty: any job)."""
    have = job.spec.get("labels") or {}
    return all(have.get(k) == v for k, v in (labels or {}).items())


def costs(by: str = "user", since: float | None = None, until: float | None = None) -> list[CostTotal]:
    """What the jobs cost over a period, per user (``by="user"``: one row per job owner, by
    name) or for the whole lab (``by="lab"``: one row, group ``lab``). ``since``/``until``: Unix
    seconds (None: open); each node counts only its hours inside the period, at its job's price
    (see :class:`~sftctl.types.Cost`).

    With a server configured, the server sums them: a user gets their own row (``by="user"``),
    an admin every user's and the lab's (else a :class:`SftctlError`, exit 2).

    Raises:
        SftctlError: ``by`` is neither user nor lab, or since > until (exit 2).
    """
    if by not in ("user", "lab"):
        raise SftctlError(f"costs: by must be 'user' or 'lab', not {by!r}", exit_code=ExitCode.USAGE)
    for name, value in (("since", since), ("until", until)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"api.costs: {name} must be Unix seconds (int or float), or None, got {_type_name(value)}")
    if since is not None and until is not None and since > until:
        def day(t: float) -> str:
            return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))

        raise SftctlError(f"costs: since ({day(since)}) is after until ({day(until)})", exit_code=ExitCode.USAGE,
                          hint="swap them: --since is the start of the period, --until its end")
    remote = _remote()
    if remote is not None:
        params = {"by": by, **{k: v for k, v in (("since", since), ("until", until)) if v is not None}}
        return [CostTotal.from_dict(r) for r in remote.request("GET", "/v1/costs", params=params)["costs"]]
    store = _store()
    spans = store.node_spans()
    totals: dict[str, dict[str, Any]] = {}
    for job in store.list_jobs():
        cost = _cost(job, spans.get(job.id, []), since, until)
        if cost is None or cost.node_hours == 0:
            continue
        group = (job.owner or "unknown") if by == "user" else "lab"
        t = totals.setdefault(group, {"usd": 0.0, "node_hours": 0.0, "jobs": 0, "unpriced_jobs": 0})
        t["jobs"] += 1
        t["node_hours"] += cost.node_hours
        if cost.usd is None:
            t["unpriced_jobs"] += 1
        else:
            t["usd"] += cost.usd
    return [CostTotal(group=g, usd=round(t["usd"], 6), node_hours=round(t["node_hours"], 6), jobs=t["jobs"],
                      unpriced_jobs=t["unpriced_jobs"], since=since, until=until) for g, t in sorted(totals.items())]


#: Seconds (at most) :func:`wait` waits, once a job has ended, for its controller to bring the
#: job's nodes down: the controller records the end first, then terminates them.
WAIT_TEARDOWN_S = 120.0


def _nodes_released(view: JobView) -> bool:
    """Whether an ended job's nodes are down (every record TERMINATED or REPLACED), or nobody is
    left to bring them down (FAILED_CONTROLLER: ``sftctl down`` does that)."""
    if view.status == JobStatus.FAILED_CONTROLLER:
        return True
    return all(n.status in (NodeState.TERMINATED, NodeState.REPLACED) for n in view.nodes)


def statuses(jobs: list[str]) -> list[JobView]:
    """:func:`status` of each of ``jobs`` (ids or unique prefixes), in order. Through a server that
    cannot be reached, retried as :func:`wait` retries (one notice, for ``server.retry_s``).

    Raises:
        NotFoundError: no such job, or an ambiguous prefix (exit 2).
        sftctl.remote.ServerLost: through a server, still unreachable after ``server.retry_s``
            seconds (exit 75; its ``job``: the first not reached).
    """
    remote, told = _remote(), [False]
    return [status(j) if remote is None else remote.riding_out(j, lambda j=j: status(j), told) for j in jobs]


def job_ids(jobs: list[str]) -> list[str]:
    """The full id of each of ``jobs`` (ids or unique prefixes), in order: :func:`statuses`'
    (a ``wait`` started while the server restarts waits).

    Raises:
        NotFoundError: no such job, or an ambiguous prefix (exit 2).
        sftctl.remote.ServerLost: through a server, still unreachable after ``server.retry_s``
            seconds (exit 75): one line naming the server's URL and what went wrong, the fix
            in its hint.
    """
    remote = _remote()
    if remote is None:
        return [v.id for v in statuses(jobs)]
    from sftctl.remote import ServerLost

    try:
        return [v.id for v in statuses(jobs)]
    except ServerLost as lost:  # no job was reached: the server's trouble, not "the job goes on"
        cause = lost.cause or lost
        raise ServerLost(f"{cause.message}; gave up after {remote.retry_s:g} s (server.retry_s)",
                         hint=(f"{cause.hint}; " if cause.hint else "") + f"then sftctl wait {' '.join(jobs)}",
                         job=lost.job, cause=cause) from None


@_typed
def wait(job: str, *, timeout_s: float | None = None, poll_s: float = 1.0) -> JobView:
    """Poll :func:`status` until the job ends and its controller has brought its nodes down
    (at most :data:`WAIT_TEARDOWN_S` more, and not past ``timeout_s``); return its final view.
    A script that starts the next job after ``wait`` thus never runs beside this one's nodes.

    Raises:
        NotFoundError: no such job (exit 2).
        TimeoutError: still running after ``timeout_s`` seconds (an ended job never raises).
        sftctl.remote.ServerLost: through a server, the server could not be reached for
            ``server.retry_s`` seconds, or was still unreachable at ``timeout_s`` (exit 75; the
            job goes on there). Shorter outages (a restart) are retried
            (:meth:`sftctl.remote.Client.riding_out`).
    """
    now = time.monotonic()
    end = None if timeout_s is None else now + timeout_s
    teardown_end = None
    remote = _remote()
    told = [False]
    while True:
        view = status(job) if remote is None else remote.riding_out(job, lambda: status(job), told, until=end)
        now = time.monotonic()
        if view.status.terminal:
            teardown_end = teardown_end or now + WAIT_TEARDOWN_S
            if _nodes_released(view) or now >= teardown_end or (end is not None and now >= end):
                return view
        elif end is not None and now >= end:
            raise TimeoutError(f"job {view.id} is still {view.status.value} after {timeout_s:.3g} s")
        time.sleep(poll_s)


# ------------------------------------------------------------------------------ logs and events


@dataclasses.dataclass(frozen=True)
class LogLine(Record):
    """One line a node's script wrote (``rank`` its node), without its newline; or, with
    ``notice``, sftctl's own line about the logs (``rank`` None), e.g. that the controller died
    while following. ``str()`` is the line as ``sftctl logs`` prints it: ``(node N) `` in front
    when the job has several nodes and no one node was asked for."""

    text: str
    rank: int | None = None
    prefix: str = ""
    notice: bool = False

    def __str__(self) -> str:
        return self.prefix + self.text


@_typed
def logs(job: str, *, follow: bool = False, node: int | None = None, rank: int | None = None,
         poll_s: float = 0.5) -> Iterator[LogLine]:
    """A job's node logs, line by line, from the start (every attempt appends to the same log).

    Args:
        follow: keep yielding until the job ended and no node process writes any more (or its
            controller died: a notice line says so and the iteration ends).
        node: only this node rank.
        rank: only the node that runs this training (global) rank, as the nodes reported it.

    Raises:
        NotFoundError: no such job (exit 2); the job's logs were purged (``down(purge=True)``;
            exit 1, as ``kubectl logs`` of a deleted pod); the job's directory
            (``$SFTCTL_HOME/jobs/JOB``) of a job without storage was deleted (exit 1).
        SftctlError: ``node`` is not a rank of the job, or no node reported ``rank`` (exit 2).
        TypeError: ``job`` or ``node`` of the wrong type (as every function here).

    With a server configured, the server reads the nodes and streams the lines (``follow``: as
    they come, riding out a server restart without a line twice or lost:
    :meth:`sftctl.remote.Client.follow_lines`; one unreachable for ``server.retry_s`` raises
    :class:`sftctl.remote.ServerLost`, exit 75, as the lines are read).
    """
    remote = _remote()
    if remote is not None:
        params = {"follow": follow, **({"node": node} if node is not None else {}),
                  **({"rank": rank} if rank is not None else {})}
        path = remote.job_path(job, "/logs")
        docs = remote.follow_lines(job, path, params) if follow else remote.stream_lines(path, params)
        return (LogLine(d["text"], d.get("rank"), d.get("prefix", ""), d.get("notice", False)) for d in docs)
    return (line for line in _local_logs(job, follow, node, rank, poll_s, idle=False) if line is not None)


#: the most lines :func:`log_chunks` puts in one chunk
LOG_CHUNK_LINES = 2048
#: the most characters of text :func:`log_chunks` puts in one chunk (one line may pass it)
LOG_CHUNK_CHARS = 1 << 20
#: a node's log line longer than this many characters comes as several lines of at most this
#: many: a node writes its log, and one line of gigabytes (a sparse ``truncate -s``) held whole
#: took the server's memory (OOM-killed serving a 1 GiB one)
LOG_LINE_MAX_CHARS = 64 << 10


def log_chunks(job: str, *, follow: bool = False, node: int | None = None, rank: int | None = None,
               poll_s: float = 0.5) -> Iterator[list[LogLine]]:
    """:func:`logs` of this machine's state (never through a server: the server's own ``GET
    /v1/jobs/{job}/logs`` reads it) in chunks: the lines read so far, at most
    :data:`LOG_CHUNK_LINES` each, a chunk ending whenever following waits for more, so that a
    follower gets each line as soon as it is read; an empty chunk when following found nothing
    new (``poll_s`` 0: the caller waits, as the server does on its event loop). One HTTP chunk per line (a thread hop each)
    took the server 89.5 s for a 200,002-line log that this machine reads in 0.5 s; in chunks,
    1.9 s (2-core machine, benchmark in the commit that made this).

    Raises:
        As :func:`logs`, now (before the first chunk).
    """
    lines = _local_logs(job, follow, node, rank, poll_s, idle=True)

    def chunks() -> Iterator[list[LogLine]]:
        batch: list[LogLine] = []
        size = 0
        for line in lines:
            if line is not None:
                batch.append(line)
                size += len(line.text)
            if batch and (line is None or len(batch) >= LOG_CHUNK_LINES or size >= LOG_CHUNK_CHARS):
                yield batch
                batch, size = [], 0
            elif line is None:
                yield []  # following, nothing new: a caller that waits itself (poll_s 0) waits now
        if batch:
            yield batch

    return chunks()


def _local_logs(job: str, follow: bool, node: int | None, rank: int | None, poll_s: float,
                idle: bool) -> Iterator[LogLine | None]:
    """:func:`logs` from this machine's state; ``idle``: None before each wait for more."""
    from sftctl.controller.submit import job_provider

    store = _store()
    record = _resolve(store, job)
    purged = [e for e in store.events(record.id) if e.kind == "purge"]
    if purged:  # as `kubectl logs` of a deleted pod: an error, not an empty log
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(purged[-1].ts))
        raise NotFoundError(f"logs of {record.id} were purged (sftctl down --purge at {when})",
                            hint=f"sftctl events {record.id} shows its history; sftctl status {record.id} its record",
                            exit_code=ExitCode.JOB_FAILED)
    from pathlib import Path

    from sftctl.paths import job_dir
    from sftctl.protocol import NodeDir

    gone = job_dir(record.id)
    # nodes on this machine (a handle with a dir: local, a server's) that ran: each wrote its node log
    # there; the agents recreate an empty tree after an `rm -rf`, so the logs are what to look for
    here = [Path(n.node_handle.dir) for n in store.nodes(record.id)
            if n.node_handle is not None and getattr(n.node_handle, "dir", None) and n.node_handle.attempt]
    # (a node just launched has its attempt's script there before its log)
    # a job with storage reads its nodes' logs from there (a replaced node's dir is fresh)
    if not (record.spec or {}).get("storage") and here and not any(
            NodeDir(d).log.exists() or any(d.glob("node-*.sh")) for d in here):  # deleted by hand
        raise NotFoundError(f"{gone}: the directory of job {record.id} is gone (deleted while the job was "
                            f"{record.status.value}): its node logs went with it",
                            hint=f"sftctl down {record.id} stops what is left of it; sftctl events {record.id} "
                                 "shows its history", exit_code=ExitCode.JOB_FAILED)
    if rank is not None:
        placed = _job_rank_nodes(record, store.events(record.id))
        if rank not in placed:
            known = f"ranks reported so far: {', '.join(map(str, sorted(placed)))}" if placed else "no rank reported yet"
            raise SftctlError(f"--rank {rank}: no node of job {record.id} reported training rank {rank} ({known}; "
                              "ranks are known once the script calls sftctl.train.report)",
                              hint=f"sftctl status {record.id} shows rank -> node; sftctl logs {record.id} --node N")
        node = placed[rank]
    ranks = record.spec["resources"]["nodes"]
    if node is not None and not 0 <= node < ranks:
        which = "node 0" if ranks == 1 else f"nodes 0-{ranks - 1}"
        raise SftctlError(f"--node {node}: job {record.id} has {ranks} node(s): {which}",
                          hint=f"sftctl logs {record.id} --node 0 (or no --node: every node)")
    return _log_lines(store, record, job_provider(record), follow, node, poll_s, NodeState, idle)


def _log_lines(store, record, provider, follow, node, poll_s, NodeState, idle=False) -> Iterator[LogLine | None]:
    from sftctl.providers.local import READ_MAX_BYTES

    offsets: dict[str, int] = {}
    partial: dict[str, tuple[str, int, str]] = {}  # node id -> (text after the last newline, rank, prefix)
    while True:
        nodes = [n for n in store.nodes(record.id) if node is None or n.rank == node]
        handles = {n.id: n.node_handle for n in nodes}
        got = False
        for n in nodes:
            h = handles[n.id]
            while True:  # a provider reads a bounded part of a log at a time (local: READ_MAX_BYTES)
                data, offsets[n.id] = provider.read_log(h, offsets.get(n.id, 0)) if h is not None else (b"", 0)
                if not data:
                    break
                got = True
                prefix = f"(node {n.rank}) " if node is None and len(nodes) > 1 else ""
                lines = (partial.get(n.id, ("",))[0] + data.decode("utf-8", "replace")).split("\n")
                rest = lines.pop()
                while len(rest) > LOG_LINE_MAX_CHARS:  # an unterminated line of any length: held in pieces
                    lines.append(rest[:LOG_LINE_MAX_CHARS])
                    rest = rest[LOG_LINE_MAX_CHARS:]
                partial[n.id] = (rest, n.rank, prefix)
                for line in lines:
                    for at in range(0, max(len(line), 1), LOG_LINE_MAX_CHARS):
                        yield LogLine(line[at:at + LOG_LINE_MAX_CHARS], n.rank, prefix)
                if len(data) < READ_MAX_BYTES:
                    break
        if not follow:
            break
        _reap(store)
        now = store.get_job(record.id)
        if now.status == JobStatus.FAILED_CONTROLLER:
            # nobody supervises the nodes any more: following them could last forever
            yield LogLine(now.failure_reason or "the controller died", notice=True)
            break
        if now.status.terminal and not got and not any(
            provider.status(handles[n.id]).state == NodeState.RUNNING for n in nodes
            if handles[n.id] is not None and handles[n.id].attempt
        ):
            break  # the job ended and no node process writes any more (a dead controller's may)
        if idle:
            yield None
        time.sleep(poll_s)
    for rest, rank, _prefix in partial.values():
        if rest:
            yield LogLine(rest, rank)  # the unterminated last line, unprefixed as sftctl logs prints it


@_typed
def events(job: str) -> list[Event]:
    """A job's history, oldest first: plan, transitions, nodes, restarts, health, teardown.

    Raises:
        NotFoundError: no such job (exit 2).
    """
    remote = _remote()
    if remote is not None:
        return [Event.from_dict(e) for e in remote.request("GET", remote.job_path(job, "/events"))["events"]]
    store = _store()
    return store.events(_resolve(store, job).id)


@_typed
def metrics(job: str, rank: int | None = None) -> list[StepRecord]:
    """A job's reported steps, oldest first per rank (:class:`StepRecord` each: step, loss,
    step_time_s in seconds, tokens_per_s, lr, checkpoint, ts in Unix seconds); the state keeps at
    most ``STEP_SERIES_CAP`` per rank (older ones thinned). ``rank``: that rank's only. Through
    the configured server when there is one (the user's own jobs).

    Raises:
        NotFoundError: no such job (exit 2).
    """
    remote = _remote()
    if remote is not None:
        params = {} if rank is None else {"rank": rank}
        doc = remote.request("GET", remote.job_path(job, "/metrics"), params=params)
        return [StepRecord.from_dict(s) for s in doc["steps"]]
    store = _store()
    job_id = _resolve(store, job).id
    steps = store.step_series(job_id, rank)
    if rank is not None and not steps:
        ranks = sorted({s.rank for s in store.step_series(job_id, None, last=2048)})
        if ranks:
            raise NotFoundError(f"job {job_id} has no rank {rank}: its ranks reported are {_span(ranks)}",
                                hint=f"sftctl metrics {job_id} --rank {ranks[0]}")
    return steps


def _span(numbers: list[int]) -> str:
    """``[0, 1, 2]`` as ``0-2``, else the numbers joined by commas."""
    if numbers == list(range(numbers[0], numbers[-1] + 1)) and len(numbers) > 1:
        return f"{numbers[0]}-{numbers[-1]}"
    return ", ".join(map(str, numbers))


def events_doc(job_id: str, evs: list[Event]) -> dict:
    """``sftctl events --json``: ``{"job_id", "events": [{"id", "ts", "kind", "message", "data"}]}``
    (each :meth:`Event.to_dict` less its ``job_id``, which is said once at the top). Once the job
    ended, the last event's ``data`` carries ``final``: ``step`` (the slowest rank's),
    ``loss_mean_over_ranks`` (the mean of each rank's latest loss: ``status``'s ``loss``),
    ``loss_by_rank`` (``{"0": ..., ...}``: each rank's latest, e.g. what rank 0 logs as its last
    loss) and ``tokens_per_s`` (summed over ranks); None each when no rank reported."""
    doc: dict[str, Any] = {"job_id": job_id, "events": [{k: v for k, v in e.to_dict().items() if k != "job_id"}
                                                        for e in evs]}
    if doc["events"]:
        view = status(job_id)
        if view.status.terminal:
            last = doc["events"][-1]
            last["data"] = {**(last.get("data") or {}), "final": {
                "step": view.step, "loss_mean_over_ranks": view.loss, "tokens_per_s": view.tokens_per_s,
                "loss_by_rank": {str(r.rank): r.loss for r in view.ranks}, "step_time": view.step_time}}
    return doc


# ------------------------------------------------------------------------------ down


@dataclasses.dataclass(frozen=True)
class DownResult(Record):
    """What ``down`` did to one job: its status after, a one-line summary and, with ``purge``,
    what was removed (:func:`sftctl.controller.teardown.purge`'s ``{"job_id", "objects", "bytes",
    "removed", "kept"}``). ``to_dict()`` is a row of ``down --json``'s ``down``; ``purged`` is
    there only when a purge was asked."""

    job_id: str
    status: str
    summary: str
    purged: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        doc = super().to_dict()
        if self.purged is None:
            del doc["purged"]
        return doc


@_typed
def down(job: str | None = None, *, all: bool = False, purge: bool = False,  # noqa: A002 (the CLI's --all)
         progress: Progress | None = None, admin: str | None = None) -> list[DownResult]:
    """Cancel a job (or, with ``all``, every job not finished or with nodes left) and remove its
    nodes and processes, also after its controller died; with ``purge``, then remove what sftctl
    wrote for it (its storage prefix, the workdir pack it uploaded, its local directory; never
    the bucket, other objects or a spec's ``train.checkpoint_dir``). Idempotent. Every node of
    a job is taken down at once; ``progress`` hears one line per stage of a long teardown. ``admin``
    (a server's, never sent to one): the admin taking down another user's job, named in its events and end reason.

    Raises:
        NotFoundError: no such job (exit 2).
        SftctlError: neither or both of ``job`` and ``all`` (exit 2).
        StorageError: the job's storage failed while purging (exit 4).
    """
    from sftctl.controller.teardown import down as down_job
    from sftctl.controller.teardown import purge as purge_job
    from sftctl.types import TERMINAL

    if bool(job) == all:
        raise SftctlError("give one JOB or --all", hint="sftctl down JOB, or sftctl down --all, or sftctl down --orphans")
    remote = _remote()
    if remote is not None:  # --all: this user's jobs on the server
        doc = remote.request("POST", "/v1/down", read_s=None, json={"job": job, "all": all, "purge": purge})
        return [DownResult(**d) for d in doc["down"]]
    store = _store()
    if all:
        _reap(store)
        ids = [j.id for j in store.list_jobs()
               if j.status not in TERMINAL or any(n.status != NodeState.TERMINATED for n in store.nodes(j.id))]
    else:
        ids = [_resolve(store, job).id]
    summaries = [down_job(store, i, progress, admin) for i in ids]
    purged = [purge_job(store, i) for i in ids] if purge else [None] * len(ids)  # down first, in this call
    return [DownResult(i, store.get_job(i).status.value, s, p) for i, s, p in zip(ids, summaries, purged)]


def down_orphans(checked: list[str] | None = None) -> list[str]:
    """Delete every labelled resource, on every configured cloud, whose job is gone or ended;
    one summary line per job swept (see :func:`sftctl.controller.teardown.down_orphans`). ``checked``, a
    list, receives the providers that were asked (``local`` always; a cloud once configured).

    With a server configured, the server sweeps its own state with its own credentials.

    Raises:
        SftctlError: through a server, the user is not one of its admins (exit 2).
    """
    from sftctl.controller.teardown import down_orphans as sweep

    remote = _remote()
    if remote is not None:  # the server sweeps with its state and its credentials (admins only)
        doc = remote.request("POST", "/v1/orphans", read_s=None)
        if checked is not None:
            checked.extend(doc["checked"])
        return list(doc["swept"])
    try:
        store = _store()
    except SftctlError as e:  # a lost or damaged state: the job dirs and provider tags still know
        return [f"state: {e.message}; every job counts as unknown"] + sweep(None, checked)
    return sweep(store, checked)
