"""Choose where a job runs: rank the offerings by predicted cost (or time) and take the best
feasible one whose provider is usable here.

For a job with a ``model``, the search compiler predicts each offering's step time and peak
memory (:class:`Predictor`) in the execution mode the job runs (``train.compile``: ``none`` ->
``eager``, ``default`` -> ``default``, ``sftensor`` -> ``sftensor``; JAX steps are jitted:
``default``; see :mod:`sftctl.compiler.modes`); the job's cost is then
``usd_per_hour x nodes x steps x step_time``.
Without a model (a plain shell job), offerings are ranked by price per hour.

Objective (``resources.objective``): ``cost`` takes the cheapest job within the deadline and the
max price per hour; ``time`` the fastest within the max price. Ties go to the faster, then to the
order the spec lists its accelerators in. Every rejected candidate says why, in the order the
filters run: clouds, regions, spot price, price per hour, memory, deadline, provider usable,
as a :class:`sftctl.types.FailureReason` (a code programs switch on, and the line people read).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Callable, Sequence

from sftctl import sandboxed_trace
from sftctl.catalog import Offering, accelerator_names, cloud_offerings, refreshed_coverage
from sftctl.catalog.accelerators import find_accelerator
from sftctl.compiler.accuracy import accuracy, factor, overlap
from sftctl.compiler import tpu
from sftctl.compiler.memory import attention_assumed
from sftctl.errors import InfeasibleError, ProviderError, SftctlError, SpecError, UntraceableModelError
from sftctl.health import preflight
from sftctl.history import Prepared, calibrate, kernel_mix
from sftctl.plan_wording import _reason, _why_none, close_call_note, format_hours
from sftctl.providers import names as provider_names, provider_class, usable_providers
from sftctl.providers.base import LiveOfferings, QueueEstimate, Quarantines
from sftctl.providers.local import LocalProvider, local_offering
from sftctl.spec import JobSpec, unknown_accelerator
from sftctl.trace_errors import EntrypointError, trace_error
from sftctl.types import FailureCode, FailureReason, Plan, PlanChoice, RunRecord, capabilities

if TYPE_CHECKING:
    from sftctl.compiler.api import OfferingPrediction


# Predicts the job on an offering at a node count (sftctl.compiler.api.OfferingPrediction), or
# None when it cannot (the predictor says why in its ``error``).
PredictFn = Callable[[Offering, int], "OfferingPrediction | None"]


class Predictor:
    """Traces the spec's model once and compiles it per accelerator, on demand, with caching.

    Args:
        spec: a job spec with a ``model``.
        progress: called with a one-line message before each slow stage (trace, compile).
        isolated: run the model's code (its trace) in a sandboxed child process, not in this
            one (:func:`sftctl.sandboxed_trace.trace`): what a server does.
    """

    def __init__(self, spec: JobSpec, progress: Callable[[str], None] | None = None, strict: bool = True,
                 isolated: bool = False):
        self.spec = spec
        #: trace in a child process, sandboxed as the server's local nodes are (a server's plan:
        #: :mod:`sftctl.sandboxed_trace`), never in this one
        self.isolated = isolated
        self.progress = progress or (lambda msg: None)
        self.strict = strict
        self.error: str | None = None  # why predictions failed, when not strict
        self._graphs: dict[int, object] = {}  # per-rank batch -> traced step
        self._targets: dict[str, object] = {}  # accelerator -> its compiler Target, built once
        self.compiled: dict[tuple, object] = {}
        self.notes: dict[str, str] = {}  # accelerator -> a note on its prediction
        self.features: dict[tuple, dict | None] = {}  # (accelerator, count, nodes) -> the step's kernel-time mix
        #: (accelerator, count, nodes) -> the attention its peak memory assumes (memory.attention_assumed)
        self.attention: dict[tuple, str | None] = {}
        self._attention: dict[tuple, str | None] = {}  # (accelerator, per-rank batch) -> the same, computed once
        self.mode = execution_mode(spec)
        #: how many accelerators the plan compiles for (plan() sets it): "accelerator 2 of 5"
        self.total_accelerators: int | None = None
        self._seen: list[str] = []  # accelerators compiled for so far, in order

    def graph(self, per_rank_batch: int | None = None):
        """The traced step for one data-parallel rank's share of the global batch.

        Raises:
            SpecError, EntrypointError (exit 2), UntraceableModelError (exit 5): the trace
                failed, worded by :func:`sftctl.trace_errors.trace_error`.
            ProviderError: a server's sandbox refused the workdir (exit 4).
        """
        m = self.spec.model
        batch = per_rank_batch or m.batch_size
        if batch not in self._graphs:
            import sftctl.compiler.api as compiler

            trace = sandboxed_trace.trace if self.isolated else compiler.trace
            self.progress(f"tracing {m.entrypoint} ({m.framework}, batch {batch} per rank, {m.dtype})")
            try:
                self._graphs[batch] = trace(m.framework, m.entrypoint, self.spec.workdir, batch, m.dtype,
                                                     mask_fraction=m.mask_fraction, expert_capacity=m.expert_capacity,
                                                     attention=m.attention)
            except (SpecError, ProviderError):  # ProviderError: a server's sandbox refused the workdir
                raise
            except Exception as e:  # the user's model code, or an op the frontend cannot lower
                raise trace_error(e, m.entrypoint) from e
        return self._graphs[batch]

    def target(self, accelerator: str):
        """The compiler's :class:`~sftctl.compiler.target.Target` for ``accelerator`` (built once)."""
        if accelerator not in self._targets:
            from sftctl.compiler.target import load_target

            self._targets[accelerator] = load_target(accelerator)
        return self._targets[accelerator]

    def compile(self, accelerator: str, per_rank_batch: int | None = None):
        """The step compiled for ``accelerator`` (cached per rank batch), with the note for an
        accelerator without bfloat16 tensor cores in ``notes``."""
        import sftctl.compiler.api as compiler

        batch = per_rank_batch or self.spec.model.batch_size
        target = self.target(accelerator)
        name = target.name
        if (name, batch) not in self.compiled:
            graph = self.graph(batch)
            precision = self.spec.model.matmul_precision
            if name not in self._seen:
                self._seen.append(name)
            what = f"compiling for {name} (accelerator {self._seen.index(name) + 1}" + (
                f" of {max(self.total_accelerators, len(self._seen))})" if self.total_accelerators else ")")
            self.progress(what)
            t0 = time.monotonic()

            def searched(done: int, total: int) -> None:
                self.progress(f"{what}: GEMM schedules {done}/{total}, {time.monotonic() - t0:.0f} s")

            compiled = compiler.compile(graph, target, matmul_precision=precision, progress=searched)
            self.compiled[name, batch] = compiled
            if self.spec.model.dtype == "bfloat16" and lacks_bf16_tensor_cores(target.hw):
                fp16 = compiler.compile(graph, target, matmul_precision=precision,
                                        mma_dtype_map={"bfloat16": "float16"})
                self.notes[name] = bf16_note(target.hw, compiled, fp16, self.mode)
            moe = moe_note(graph)
            if moe and moe not in self.notes.get(name, ""):
                self.notes[name] = "; ".join(filter(None, [self.notes.get(name), moe]))
        return self.compiled[name, batch]

    def __call__(self, offering: Offering, nodes: int) -> OfferingPrediction | None:
        if self.error is not None:
            return None
        try:
            return self._predict(offering, nodes)
        except _Unsplittable:
            raise
        except (SpecError, UntraceableModelError) as e:
            if self.strict or isinstance(e, EntrypointError):
                raise
            self.error = e.message
        except Exception as e:  # a compiler bug must not stop a job that could run unpredicted
            if self.strict:
                raise
            self.error = f"the compiler failed on {offering.accelerator}: {type(e).__name__}: {e}"
        return None

    def _predict(self, offering: Offering, nodes: int) -> OfferingPrediction:
        """DDP and FSDP, with and without activation checkpointing, as the spec allows
        (``train.parallelism``, ``train.activation_checkpointing``), priced on the offering; the
        fastest that fits is chosen (see :mod:`sftctl.compiler.sharding`)."""
        import sftctl.compiler.api as compiler

        world = offering.count * nodes
        per_rank = per_rank_batch(self.spec.model.batch_size, offering.count, nodes)
        t = self.spec.train
        target = self.target(offering.accelerator)
        if target.hw.vendor == "google":  # a TPU slice: one XLA program, priced by compiler/tpu.py
            self.features[offering.accelerator, offering.count, nodes] = None
            return tpu.predict_offering(self.graph(per_rank), target.hw, chips=world,
                                        ici_bytes_per_s=offering.intra_node_bytes_per_s,
                                        parallelisms=("ddp", "fsdp") if t.parallelism == "auto" else (t.parallelism,),
                                        mode=self.mode)
        compiled = self.compile(offering.accelerator, per_rank)
        got = compiler.predict(
            compiled, self.target(offering.accelerator), gpus_per_node=offering.count, nodes=nodes,
            intra_node_bytes_per_s=offering.intra_node_bytes_per_s,
            inter_node_bytes_per_s=offering.inter_node_bytes_per_s, mode=self.mode,
            param_dtype_bytes=2 if self.spec.model.dtype in ("bfloat16", "float16") else 4,
            parallelisms=("ddp", "fsdp") if t.parallelism == "auto" else (t.parallelism,),
            checkpointing=(False, True) if t.activation_checkpointing is None else (t.activation_checkpointing,),
            provider=f"{offering.provider}:{offering.instance_type}",
            graph=self.graph(per_rank), global_batch=self.spec.model.batch_size,  # the layouts (issue 38)
            model_parallel=t.parallelism == "auto" and t.activation_checkpointing is None,
            # pipeline stages only where the script drives their schedule (train.pipeline: it
            # calls sft.prepare(model, loss_fn=...) and steps the Pipeline it returns)
            pipeline=t.pipeline)
        ch = got.chosen
        if (offering.accelerator, per_rank) not in self._attention:
            self._attention[offering.accelerator, per_rank] = attention_assumed(self.graph(per_rank), target.name)
        self.attention[offering.accelerator, offering.count, nodes] = self._attention[offering.accelerator, per_rank]
        self.features[offering.accelerator, offering.count, nodes] = kernel_mix(
            compiled.kernels, ch.comm_time_s / ch.step_time_s if ch.step_time_s > 0 else 0.0)
        return got


def execution_mode(spec: JobSpec) -> str:
    """The execution mode the job's step runs in (see :mod:`sftctl.compiler.modes`): the spec's
    ``train.compile`` for PyTorch; a JAX step is jitted (XLA fuses as ``default`` does)."""
    from sftctl.compiler.modes import COMPILE_TO_MODE

    if spec.model is not None and spec.model.framework == "jax":
        return "default"
    return COMPILE_TO_MODE[spec.train.compile]


def moe_note(graph) -> str | None:
    """The line a plan of a mixture-of-experts model carries (None for a dense model): its
    experts are priced at the uniform top-k load and placed as every other weight (DDP/FSDP);
    expert parallelism (experts sharded over ranks, tokens sent by all-to-all) is not modelled."""
    experts = {(n.attrs["experts"], n.attrs.get("capacity")) for n in graph.nodes
               if n.op == "dot_general" and "experts" in n.attrs}
    if not experts:
        return None
    e, cap = max(experts)
    return (f"MoE: {e} experts priced at the uniform top-k load ({cap} rows per expert per grouped GEMM, "
            "model.expert_capacity scales it), sharded like dense weights; expert parallelism "
            "(all-to-all dispatch) is not yet supported")


def bf16_note(hw, compiled, fp16, mode: str) -> str:
    """The note for an accelerator without bfloat16 tensor cores: what ``model.dtype: float16``
    would give (``fp16``: the step compiled with bf16 matmuls priced as fp16)."""
    return (f"{hw.name} has no bfloat16 tensor cores: bf16 matmuls run on its CUDA cores at "
            f"{hw.matrix_peak('bfloat16') / 1e12:.1f} TFLOP/s; model.dtype float16 would run them on its "
            f"tensor cores ({hw.matrix_peak('float16') / 1e12:.0f} TFLOP/s): predicted "
            f"{fp16.mode_time_s(mode) * 1e3:.1f} ms/step instead of {compiled.mode_time_s(mode) * 1e3:.1f} ({mode})")


def lacks_bf16_tensor_cores(hw) -> bool:
    """True where bfloat16 matmuls run no faster than FP32 on the CUDA cores (T4, V100: the
    catalog gives their bf16 matrix rate as the FP32 rate) but float16 has tensor cores."""
    try:
        bf16, fp16 = hw.matrix_peak("bfloat16"), hw.matrix_peak("float16")
    except KeyError:
        return False
    return bf16 <= hw.vector_peak("float32") * 1.01 and fp16 > 2 * bf16


def per_rank_batch(batch_size: int, per_node: int, nodes: int, exact: bool = True) -> int:
    """One data-parallel rank's share of ``model.batch_size`` (sequences or samples per step)
    on ``nodes`` nodes of ``per_node`` accelerators (worker processes) each: what the launcher
    hands each rank as ``SFTCTL_BATCH_SIZE`` (:func:`sftctl.controller.submit.node_env`), so
    what ``plan`` prices per offering, ``compile`` per target and ``calibrate import`` traces.

    With ``exact`` false (the launcher's: a job the planner could not predict had its split
    never checked) an uneven split is rounded down, and a share below one sequence is 1.

    Raises:
        _Unsplittable: with ``exact``, ``batch_size`` is not a multiple of ``per_node x nodes``.
    """
    world = per_node * nodes
    if not exact:
        return max(1, batch_size // world)
    if batch_size % world:
        raise _Unsplittable(batch_size, world)
    return batch_size // world


class _Unsplittable(Exception):
    """The global batch does not divide evenly over an offering's data-parallel ranks."""

    def __init__(self, batch: int, world: int):
        self.batch, self.world = batch, world
        super().__init__(f"model.batch_size {batch} does not split evenly over {world} data-parallel ranks")


def plan(spec: JobSpec, usable: dict[str, str | None] | None = None, predict: PredictFn | None = None,
         history: list[RunRecord] | None = None, avoid: dict[str, set[str]] | None = None) -> Plan:
    """Rank the offerings that match ``spec.resources`` and choose the best usable one.

    Args:
        spec: the validated job spec.
        usable: provider name -> None if usable here, else why not. Default: ask the providers.
        predict: step-time predictor; default a :class:`Predictor` when the spec has a model.
        history: run-history rows (:meth:`sftctl.state.Store.runs`) that correct each predicted
            row (:func:`sftctl.history.calibrate`): its ``calibrated_step_s`` then sets hours,
            cost, the interval and the ranking. None or empty: the model's figures as they are.
        avoid: provider -> machines the state marks bad (:meth:`sftctl.state.Store.bad_machines`):
            Slurm's start estimate leaves them out (``--exclude``), as the job's allocation will.

    Raises:
        SpecError: an accelerator name the catalog does not know (exit 2), with a did-you-mean.
        InfeasibleError: nothing matches, or nothing that matches is usable (exit 3).
    """
    if usable is None:
        usable = usable_providers()
    if predict is None and spec.model is not None:
        predict = Predictor(spec)
    if isinstance(predict, Predictor):  # its progress lines count the accelerators
        predict.total_accelerators = len({a.name.lower() for a in spec.resources.accelerators})
    res = spec.resources
    known = {n.lower(): n for n in accelerator_names()}  # the catalog's spelling of each name
    candidates: list[PlanChoice] = []
    # every row reads them all (another accelerator's runs of a step speak for it too), as arrays made once
    runs: Prepared | tuple = Prepared(history) if history else ()
    memo: dict = {}  # offerings in several regions calibrate the same way once
    asked = {name for name, why in usable.items() if why is None}
    for i, acc in enumerate(res.accelerators):
        error = unknown_accelerator(i, acc.name)  # load_spec says it at its line already
        if error is not None:
            raise error
        offerings = _offerings(acc.name, acc.count, usable, res.clouds, spec=spec)
        for offering in offerings:
            c = _judge(offering, spec, usable, predict, runs, memo)
            if c.rejected is None and issubclass(provider_class(offering.provider), QueueEstimate):
                c = _queue(c, spec, (avoid or {}).get(offering.provider, ()))
            candidates.append(c)
        if not offerings and acc.name.lower() != "cpu":
            candidates.append(_not_sold(known[acc.name.lower()], acc.count, res.nodes))
        elif not offerings and (res.clouds is None or any(capabilities(c).local_admission for c in res.clouds)):
            # cpu:N over this machine's cores
            too_big = LocalProvider().too_large(acc.count)
            if too_big is not None:
                candidates.append(PlanChoice(local_offering(acc.count), res.nodes, None, rejected=FailureReason(
                    FailureCode.NO_CAPACITY, too_big, {"cpus": acc.count, "cores": os.cpu_count() or 1})))
        elif res.regions is not None:
            candidates += _not_offered_in(known.get(acc.name.lower(), acc.name), acc.count, res, offerings)
    ranked = _ranking_notes(sorted(candidates, key=lambda c: (c.rejected is not None, _objective(c, res.objective))),
                            res.objective, _tokens_per_step(predict, spec))
    feasible = [c for c in ranked if c.rejected is None]
    if not feasible:
        wanted = ", ".join(str(a) for a in res.accelerators)
        raise InfeasibleError(
            candidates=ranked,
            # a cluster whose query failed (sinfo over SSH, the Kubernetes API) has no row to
            # reject: its reason goes in the message, not lost
            message=f"no offering can run {res.nodes} node(s) of {wanted}" + _why_none(ranked)
            + "".join(f"; {usable[name]}" for name in sorted(asked) if usable.get(name) is not None),
            hint=("make model.batch_size a multiple of nodes x accelerators per node"
                  if any(c.rejected.code == FailureCode.UNSUPPORTED for c in ranked) else
                  f"lower resources.nodes or the cpu:N count (this machine holds at most {os.cpu_count() or 1} local "
                  "CPU worker(s)), "
                  "or run on a cluster (resources.clouds: [slurm], [kubernetes], a cloud)"
                  if any(c.rejected.code == FailureCode.NO_CAPACITY and capabilities(c.offering.provider).local_admission
                         for c in ranked) else  # (a placeholder row's provider "-" has no capabilities)
                  f"the spec leaves resources.clouds out, so {spec.defaults_from['resources.clouds']} applies: "
                  "widen it there, or set resources.clouds in the spec"
                  if "resources.clouds" in spec.defaults_from
                  and all(c.rejected.code == FailureCode.EXCLUDED for c in ranked) else
                  # (not "[local]": this machine runs CPU workers, and a job asking for them there
                  # has local rows that are not NOT_CONFIGURED, so it never ends here)
                  "set the credentials of a cloud (sftctl check says what each one needs)"
                  if ranked and all(c.rejected.code == FailureCode.NOT_CONFIGURED for c in ranked) else
                  "widen resources (accelerators, clouds, regions, max_price_per_hour, deadline, spot); "
                  "sftctl plan shows all"),
        )
    best = feasible[0]
    return Plan(best, _reason(best, ranked, res.objective), ranked)


#: the availability signal a refresh reads per zone, by cloud (``sftctl catalog refresh``)
_ZONE_SIGNAL = {"aws": "EC2 DescribeInstanceTypeOfferings per availability zone",
                "gcp": "Compute Engine machineTypes and acceleratorTypes per zone"}


def _not_offered_in(name: str, count: int, res, offerings: list[Offering]) -> list[PlanChoice]:
    """Rows for the regions of ``resources.regions`` where no offering of ``name:count`` is sold:
    where a refresh read the region (its coverage), the reason names the signal (no zone of the
    region offers the type); elsewhere it says the catalog lists none there."""
    offered = {o.region for o in offerings}
    covered = refreshed_coverage()
    out = []
    for region in res.regions:
        if region in offered:
            continue
        clouds = [c for c, regions in covered.items() if (res.clouds is None or c in res.clouds)
                  and (regions is None or region in regions)]
        if clouds:
            signal = "; ".join(_ZONE_SIGNAL.get(c, f"{c}'s API") for c in clouds)
            why = f"no zone of {region} offers {name}:{count} (sftctl catalog refresh read it: {signal})"
        else:
            why = (f"the catalog lists no {name}:{count} in {region} (`sftctl catalog refresh` reads "
                   "which zones offer it)")
        reason = FailureReason(FailureCode.NOT_SOLD, why, {"accelerator": name, "count": count, "region": region})
        placeholder = Offering(provider="-", instance_type="(not offered)", accelerator=name, count=count,
                               region=region, usd_per_hour=0.0, source="sftctl catalog: no offering in this region")
        out.append(PlanChoice(placeholder, res.nodes, None, rejected=reason))
    return out


def _not_sold(name: str, count: int, nodes: int) -> PlanChoice:
    """A row for an accelerator asked at a count no offering has: what is sold instead."""
    sold = sorted({o.count for o in cloud_offerings() if o.accelerator.lower() == name.lower()})
    if sold:
        as_ = " and ".join(f":{n}" for n in sold)
        why = (f"{name} is sold as {as_}{' only' if len(sold) == 1 else ''} here; ask for "
               + " or ".join(f"{name}:{n}" for n in sold))
    else:
        why = f"no provider sftctl supports sells {name}"
    reason = FailureReason(FailureCode.NOT_SOLD, why, {"accelerator": name, "count": count, "sold_counts": sold})
    placeholder = Offering(provider="-", instance_type="(not sold)", accelerator=name, count=count, region="-",
                           usd_per_hour=0.0, source="sftctl catalog: no offering of this count")
    return PlanChoice(placeholder, nodes, None, rejected=reason)


def _calibration(accelerator: str, step_time_s: float, comm_time_s: float = 0.0) -> dict:
    """A prediction's calibration (sources, error factor for a step with ``comm_time_s`` of exposed
    communication: :func:`sftctl.compiler.accuracy.factor`) and its step-time interval."""
    acc = accuracy(accelerator)
    f = factor(accelerator, comm_time_s / step_time_s if step_time_s > 0 else 0.0)
    return {"calibration": {"calibrated": acc["calibrated"], "sources": acc["sources"], "error": f},
            "step_time_interval_s": [step_time_s / f, step_time_s * f]}


def _ranking_notes(ranked: list[PlanChoice], objective: str,
                   tokens_per_step: tuple[float, str] | None = None) -> list[PlanChoice]:
    """The pick (the top row, when feasible and predicted) against the runner-up: the best
    feasible predicted row on another accelerator or node shape (rows of the same shape share the
    prediction's error, so price alone orders them).

    ``close_call`` (the top row only, whenever there is a runner-up) has the comparison as data:
    ``within_error`` (their intervals overlap: the value the ranking compared, total cost or for
    ``objective: time`` the step, history-corrected where it is, divided and multiplied by each
    row's error factor), ``pick`` and ``runner_up`` (``H100:8``, ``x 2`` nodes), ``runner_up_rank``
    (its place among the candidates, 1-based), ``runner_up_offering`` (provider, instance_type, region),
    ``margin`` (runner-up / pick - 1), ``metric``, both values and intervals, both rows' USD per
    step and, where ``tokens_per_step`` (count, unit: a step's tokens or samples over the whole
    job) says, per million of them (``usd_per_mtok``, or ``usd_per_msample``). When the intervals overlap,
    ``ranking_note`` says so in one line with both figures (:func:`close_call_note`: it names the
    runner-up's offering, never its rank, which a grouped table does not show): the pick may not
    be the cheapest. No other row gets either: one line per plan."""
    if not ranked:
        return ranked
    pick = ranked[0]

    def shape(c: PlanChoice) -> tuple:
        return c.offering.accelerator, c.offering.count, c.nodes

    def predicted(c: PlanChoice) -> bool:
        return c.rejected is None and c.step_time_s is not None and c.calibration is not None

    if not predicted(pick):
        return ranked
    runner = next(((j, c) for j, c in enumerate(ranked[1:], 2) if predicted(c) and shape(c) != shape(pick)), None)
    if runner is None:
        return ranked
    j, other = runner

    def value(c: PlanChoice) -> float:  # what the ranking compared: the step history corrected, or the cost
        if objective == "time":
            return getattr(c, "calibrated_step_s", None) or c.step_time_s
        return c.total_usd or 0.0

    def name(c: PlanChoice) -> str:
        return f"{c.offering.accelerator}:{c.offering.count}{'' if c.nodes == 1 else f' x {c.nodes}'}"

    def per_step(c: PlanChoice) -> float | None:  # USD of one step on the row's offering (all its nodes)
        step = getattr(c, "calibrated_step_s", None) or c.step_time_s
        return None if c.usd_per_hour is None or step is None else c.usd_per_hour * step / 3600

    a, b = value(pick), value(other)
    fa, fb = pick.calibration["error"], other.calibration["error"]
    ia, ib = (a / fa, a * fa), (b / fb, b * fb)
    if a <= 0:
        return ranked
    within = overlap(ia, ib)
    sa, sb = per_step(pick), per_step(other)
    count, unit = tokens_per_step if tokens_per_step and tokens_per_step[0] > 0 else (0.0, "")
    key = {"tokens": "usd_per_mtok", "samples": "usd_per_msample"}.get(unit)
    o = other.offering
    close = {"within_error": within, "pick": name(pick), "runner_up": name(other), "runner_up_rank": j,
             "runner_up_offering": {"provider": o.provider, "instance_type": o.instance_type, "region": o.region},
             "margin": b / a - 1, "metric": "step_time_s" if objective == "time" else "total_usd",
             "pick_value": a, "runner_up_value": b, "pick_interval": list(ia), "runner_up_interval": list(ib),
             "pick_usd_per_step": sa, "runner_up_usd_per_step": sb}
    if key and sa is not None and sb is not None:
        close |= {f"pick_{key}": sa / count * 1e6, f"runner_up_{key}": sb / count * 1e6}
    if not within:
        return [dataclasses.replace(pick, close_call=close)] + ranked[1:]
    note = close_call_note(close)
    return [dataclasses.replace(pick, ranking_note=note, close_call=close)] + ranked[1:]


def _tokens_per_step(predict, spec: JobSpec) -> tuple[float, str] | None:
    """What one step of the whole job consumes, (count, ``tokens`` or ``samples``), from a rank's
    traced step (:func:`sftctl.compiler.report.tokens_per_step`) scaled to the global batch; None
    without a traced step (no model, or a predictor that traces none)."""
    graphs = getattr(predict, "_graphs", None)
    if not graphs or spec.model is None:
        return None
    from sftctl.compiler.report import tokens_per_step

    per_rank, graph = next(iter(graphs.items()))
    count, unit = tokens_per_step(graph)
    return count * spec.model.batch_size / max(1, per_rank), unit


def _objective(c: PlanChoice, objective: str) -> tuple:
    price = c.usd_per_hour if c.usd_per_hour is not None else float("inf")
    step = c.calibrated_step_s or c.step_time_s
    step = step if step is not None else float("inf")
    total = c.total_usd if c.total_usd is not None else price
    wait = c.queue_wait_s or 0.0
    if objective == "time":  # the finish: a Slurm queue's wait counts as much as the run
        finish = c.finish_s if c.finish_s is not None else float("inf")
        return (finish, step, total, wait)
    return (total, step, wait)


def _queue(c: PlanChoice, spec: JobSpec, avoid=()) -> PlanChoice:
    """A candidate of a provider with a :class:`~sftctl.providers.base.QueueEstimate` (Slurm's
    ``sbatch --test-only``, ``avoid``'s nodes excluded) with the scheduler's start estimate;
    rejected when the scheduler says the allocation can never run, or when wait + run is past
    the deadline."""
    try:
        provider = provider_class(c.offering.provider).for_plan(spec)
        if isinstance(provider, Quarantines):
            provider.keep_out("", set(avoid))  # machines a verdict marked bad (issue 41.3)
        wait_s, detail = provider.estimate_start(c.offering, c.nodes)
    except SftctlError as e:
        return dataclasses.replace(c, rejected=error_reason(e))
    c = dataclasses.replace(c, queue_wait_s=wait_s, queue_detail=detail)
    deadline_s = spec.resources.deadline_s
    if deadline_s is not None and wait_s > deadline_s:
        return dataclasses.replace(c, rejected=FailureReason(FailureCode.TOO_SLOW, (
            f"Slurm's queue wait of {format_hours(wait_s / 3600)} alone is past the deadline of {spec.resources.deadline}"),
            {"queue_wait_s": wait_s, "deadline_s": deadline_s}))
    if deadline_s is not None and c.hours is not None and c.finish_s > deadline_s:
        return dataclasses.replace(c, rejected=FailureReason(FailureCode.TOO_SLOW, (
            f"queue wait {format_hours(wait_s / 3600)} + predicted {format_hours(c.hours)} "
            f"is past the deadline of {spec.resources.deadline}"), {"finish_s": c.finish_s, "deadline_s": deadline_s}))
    return c


def _offerings(accelerator: str, count: int, usable: dict[str, str | None] | None = None,
               clouds: Sequence[str] | None = None, spec: JobSpec | None = None) -> list[Offering]:
    """The catalog's offerings of ``count`` x ``accelerator``, plus what each usable provider
    with :class:`~sftctl.providers.base.LiveOfferings` offers (a Kubernetes cluster from its
    nodes' GPU labels, a Slurm cluster from sinfo: a cluster has no catalog); cpu offerings of
    a cluster only when the spec names it."""
    if accelerator.lower() == "cpu":
        out = LocalProvider().offerings(accelerator, count)
    else:
        out = [o for o in cloud_offerings() if o.accelerator.lower() == accelerator.lower() and o.count == count]
    for name in provider_names():
        wanted = name in clouds if clouds is not None else accelerator.lower() != "cpu"
        if usable is None or usable.get(name, "") is not None or not wanted:
            continue
        cls = provider_class(name)
        if not issubclass(cls, LiveOfferings):
            continue
        try:
            provider = cls.for_plan(spec)
            if provider is not None:
                out += provider.offerings(accelerator, count)
        except SftctlError as e:  # an unreachable cluster is a reason, shown by sftctl check
            usable[name] = e.message
    return out


def _spot_signal(o: Offering) -> str:
    """Where an offering's (missing) spot price comes from, for a rejection reason."""
    if "DescribeSpotPriceHistory" in o.source:
        return "EC2 DescribeSpotPriceHistory per zone"
    if "Cloud Billing" in o.source:
        return "Cloud Billing Catalog Spot SKUs"
    return f"source: {o.source.split(':')[0]}"


def _judge(o: Offering, spec: JobSpec, usable: dict[str, str | None], predict: PredictFn | None,
           history: Prepared | Sequence[RunRecord] = (), memo: dict | None = None) -> PlanChoice:
    res = spec.resources
    unit = o.price(res.spot)
    c = PlanChoice(o, res.nodes, None if unit is None else unit * res.nodes)

    def reject(code: FailureCode, why: str, **data) -> PlanChoice:
        return dataclasses.replace(c, rejected=FailureReason(code, why, data))

    if res.clouds is not None and o.provider not in res.clouds:
        origin = spec.defaults_from.get("resources.clouds")  # the spec leaves clouds to the user's defaults
        return reject(FailureCode.EXCLUDED, f"{o.provider} is not in resources.clouds"
                      + (f" [{', '.join(res.clouds)}], which {origin} sets" if origin else ""))
    if res.regions is not None and o.region not in res.regions and capabilities(o.provider).regional:
        return reject(FailureCode.EXCLUDED, f"region {o.region} is not in resources.regions")
    if c.usd_per_hour is None:
        return reject(FailureCode.NOT_SOLD, f"no spot price for this offering: no zone of {o.region} reported one "
                      f"({_spot_signal(o)}, as of {o.as_of or 'an unknown date'})")
    if res.max_price_per_hour is not None and c.usd_per_hour > res.max_price_per_hour:
        return reject(FailureCode.OVER_BUDGET,
                      f"${c.usd_per_hour:.2f}/h is above max_price_per_hour ${res.max_price_per_hour:.2f}",
                      usd_per_hour=c.usd_per_hour, max_price_per_hour=res.max_price_per_hour)
    if capabilities(o.provider).local_admission:  # before the compiler: a job this machine can never hold says so at once

        never = LocalProvider().never_fits(o, res.nodes)
        if never is not None:
            return reject(FailureCode.NO_CAPACITY, f"local: {never}", nodes=res.nodes, cores=os.cpu_count() or 1)
    hw = find_accelerator(o.accelerator)
    if hw is not None and hw.vendor == "google" and spec.model is not None and spec.model.framework != "jax":
        return reject(FailureCode.UNSUPPORTED, f"a {spec.model.framework} model on a TPU needs PyTorch/XLA, which "
                      "sftctl does not launch: write the model in JAX (model.framework: jax) or run it on a GPU",
                      framework=spec.model.framework)
    if predict is not None:
        try:
            got = predict(o, res.nodes)
        except _Unsplittable as e:
            return reject(FailureCode.UNSUPPORTED, str(e), batch_size=e.batch, ranks=e.world)
        if got is not None:
            mode = getattr(predict, "mode", None)
            features = getattr(predict, "features", {}).get((o.accelerator, o.count, res.nodes))
            comm = got.chosen.comm_time_s / got.step_time_s if got.step_time_s > 0 else 0.0
            key = (got.step_time_s, o.accelerator, o.provider, o.instance_type, mode, repr(features), comm)
            memo = {} if memo is None else memo
            if key not in memo:
                memo[key] = calibrate(got.step_time_s, o.accelerator, history, provider=o.provider,
                                      instance_type=o.instance_type, mode=mode, features=features, comm_share=comm)
            learned = memo[key]
            step_s = learned["calibrated_step_s"]
            calib = _calibration(o.accelerator, got.step_time_s, got.chosen.comm_time_s)
            if learned["runs"] or learned["other_accelerator_runs"]:  # history narrows the range around it
                calib = {"calibration": {**calib["calibration"], "error": learned["error"],
                                         "model_error": calib["calibration"]["error"]},
                         "step_time_interval_s": learned["interval_s"]}
            hours = step_s * spec.train.steps / 3600
            hours += preflight.estimate_s(preflight.level(spec.health.preflight, o.accelerator, spec.health.enabled),
                                          o.accelerator, hours, spec.health.thresholds().preflight_long_job_h) / 3600  # issue 41
            attention = getattr(predict, "attention", {}).get((o.accelerator, o.count, res.nodes))
            c = dataclasses.replace(c, step_time_s=got.step_time_s, peak_memory_bytes=got.memory_bytes,
                                    devices_needed=got.devices_needed, hours=hours,
                                    total_usd=hours * c.usd_per_hour, mode=getattr(predict, "mode", None),
                                    note=getattr(predict, "notes", {}).get(o.accelerator),
                                    parallelism=got.chosen.parallelism,
                                    activation_checkpointing=got.chosen.activation_checkpointing,
                                    # the memory line names the attention its peak assumed
                                    parallelism_reason=got.reason + (f"; attention: {attention}" if attention else ""),
                                    strategies=[p.to_dict() for p in got.strategies],
                                    layout=getattr(got, "layout", None),
                                    features=features, calibrated_step_s=step_s,
                                    learned={k: learned[k] for k in ("runs", "other_accelerator_runs", "weight",
                                                                     "correction", "sources", "error", "prior_error")},
                                    **calib)
            if res.spot:
                c = _with_spot_loss(c, spec, step_s, hours)
                hours = c.hours
            if got.devices_needed != 1:
                # where the attention keeps S x S scores, the refusal says so: a fused kernel would not
                s_by_s = attention is not None and attention.startswith(("eager", "SDPA math"))
                return reject(FailureCode.DOES_NOT_FIT, got.reason + (
                    f"; {'eager attention' if (attention or '').startswith('eager') else 'SDPA math'} keeps its "
                    "S x S scores (a fused SDPA or flash kernel keeps none)" if s_by_s else "") + (
                    f"; train.parallelism {spec.train.parallelism} rules out the other strategy"
                    if spec.train.parallelism != "auto" else "; lower model.batch_size"),
                    peak_memory_bytes=got.memory_bytes, memory_bytes=got.chosen.memory_capacity_bytes,
                    devices_needed=got.devices_needed)
            deadline_s = res.deadline_s
            if deadline_s is not None and hours * 3600 > deadline_s:
                return reject(FailureCode.TOO_SLOW, f"predicted {format_hours(hours)} is past the deadline of {res.deadline}",
                              hours=hours, deadline_s=deadline_s)
    why_not = usable.get(o.provider, f"unknown provider {o.provider!r}")
    if why_not:
        return reject(FailureCode.NOT_CONFIGURED, why_not)
    return c


#: Expected preemptions per spot node-hour when neither the spec nor a cloud says. ASSUMPTION: no
#: cloud publishes a per-type rate sftctl can read offline (AWS's Spot Instance Advisor gives
#: monthly interruption-frequency bands per type and region, from <5 % to >20 % of instances a
#: month; GCP publishes none and may preempt a Spot VM at any time); one per 24 node-hours is a
#: pessimistic figure for GPU types, which are often in the advisor's highest band.
SPOT_PREEMPTIONS_PER_NODE_HOUR = 1 / 24
SPOT_RATE_SOURCE = ("stated default: 1 preemption per 24 node-hours (an assumption: no per-type rate is "
                    "published offline; set resources.spot.preemptions_per_hour)")


def _with_spot_loss(c: PlanChoice, spec: JobSpec, step_time_s: float, hours: float) -> PlanChoice:
    """``c`` with the expected cost of preemptions in its hours and total: each preemption loses
    the work since the last checkpoint (half a ``train.checkpoint_interval`` on average) plus the
    relaunch (``resources.spot.relaunch_s``); ``rate x nodes x hours`` preemptions are expected
    (first order). ``spot_loss`` says every number and the rate's source."""
    rules = spec.resources.spot_rules
    rate = rules.preemptions_per_hour or SPOT_PREEMPTIONS_PER_NODE_HOUR
    source = "resources.spot.preemptions_per_hour" if rules.preemptions_per_hour else SPOT_RATE_SOURCE
    lost_work_s = spec.train.checkpoint_interval * step_time_s / 2
    loss_h = (lost_work_s + rules.relaunch_s) / 3600
    expected = rate * c.nodes * hours
    extra_h = expected * loss_h
    total_h = hours + extra_h
    return dataclasses.replace(c, hours=total_h, total_usd=total_h * c.usd_per_hour, spot_loss={
        "preemptions_per_node_hour": rate, "rate_source": source, "expected_preemptions": expected,
        "lost_work_s": lost_work_s, "relaunch_s": rules.relaunch_s, "loss_per_preemption_h": loss_h,
        "extra_hours": extra_h, "usd": extra_h * c.usd_per_hour})


def error_reason(e: SftctlError) -> FailureReason:
    """The :class:`FailureReason` an error carries (a provider's, see
    :class:`sftctl.errors.ProviderError`), else ``provider_error`` with its message."""
    reason = getattr(e, "reason", None)
    return reason if isinstance(reason, FailureReason) else FailureReason(FailureCode.PROVIDER_ERROR, e.message)
