"""The compiler's front door: a traced step in, a compiled step and a prediction out.

    graph = trace("torch", "model.py:build", workdir, batch_size=8, dtype="bfloat16")
    target = load_target("H200")                        # built once, passed to each call
    compiled = compile(graph, target, matmul_precision="highest")
    p = predict(compiled, target, gpus_per_node=8, nodes=1, intra_node_bytes_per_s=450e9,
                inter_node_bytes_per_s=None, mode="eager", param_dtype_bytes=2)
    p.chosen.step_time_s, p.chosen.memory_bytes, p.devices_needed, p.reason

The planner (:class:`sftctl.planner.Predictor`) and ``sftctl.api.compile`` both go through these
three functions; nothing else orchestrates trace -> compile -> predict. Every call takes its
:class:`~sftctl.compiler.target.Target` (no call derives coefficients on its own). Results are
typed records: :class:`~sftctl.compiler.step.CompiledStep`, :class:`OfferingPrediction` (the plain
data-parallel :class:`~sftctl.compiler.step.StepPrediction` and every
:class:`~sftctl.compiler.sharding.StrategyPrediction` priced, with the one chosen).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, cast

from sftctl.compiler.driver import compile_for, trace_model
from sftctl.compiler.ir import Graph
from sftctl.compiler.sharding import PARALLELISMS, REDUCE_DTYPE_BYTES, StrategyPrediction, choose, predict_strategies
from sftctl.compiler.step import CompiledStep, StepPrediction, predict as predict_step
from sftctl.compiler.target import Target, load_target

__all__ = ["OfferingPrediction", "Target", "compile", "load_target", "predict", "trace"]


def trace(framework: str, entrypoint: str, workdir: str, batch_size: int, dtype: str, *,
          use_cache: bool = True, mask_fraction: float = 1.0, expert_capacity: float = 1.0,
          attention: str = "auto") -> Graph:
    """The whole training step ``entrypoint`` builds, as an IR graph (disk-cached:
    :func:`sftctl.compiler.driver.trace_model`). ``batch_size`` is one data-parallel rank's.
    ``mask_fraction`` / ``expert_capacity``: the bounds of data-dependent sizes (the spec's
    ``model.mask_fraction`` / ``model.expert_capacity``; torch frontend, see its ``dynamic`` module).
    ``attention``: the attention implementation the job runs (the spec's ``model.attention``,
    :func:`sftctl.compiler.attention.with_implementation`; ``auto``: what the model says, else
    torch SDPA's choice per GPU).

    Raises:
        SpecError: the entrypoint cannot be imported or called, or returns the wrong things.
        NotImplementedError: the step uses an op the frontend cannot lower (named).
    """
    from sftctl.compiler.attention import with_implementation

    return with_implementation(trace_model(framework, entrypoint, workdir, batch_size, dtype, use_cache=use_cache,
                                           mask_fraction=mask_fraction, expert_capacity=expert_capacity), attention)


def compile(graph: Graph, target: Target, *, matmul_precision: str,  # noqa: A001 - the compiler's verb
            mma_dtype_map: dict[str, str] | None = None, progress: Callable[[int, int], None] | None = None,
            use_cache: bool = True) -> CompiledStep:
    """``graph`` compiled for ``target``: kernels, schedules, per-mode times and peak memory
    (disk-cached: :func:`sftctl.compiler.driver.compile_for`). ``matmul_precision``: ``highest``,
    ``high`` or ``medium`` (as ``torch.set_float32_matmul_precision``); ``mma_dtype_map`` prices
    contractions of one dtype as another (``{"bfloat16": "float16"}``).

    Raises:
        ValueError: an unknown ``matmul_precision``.
    """
    return compile_for(graph, target, progress=progress, use_cache=use_cache, matmul_precision=matmul_precision,
                       mma_dtype_map=mma_dtype_map)


@dataclasses.dataclass(frozen=True)
class OfferingPrediction:
    """A compiled step predicted on an offering (``gpus_per_node`` x ``nodes`` devices).

    ``step``: plain data parallel (DDP, no activation checkpointing), as
    :func:`sftctl.compiler.step.predict` prices it; ``strategies``: every strategy priced, in the
    order asked; ``chosen``: the fastest that fits, else the one needing the least memory
    (:func:`sftctl.compiler.sharding.choose`), ``reason`` says why in one line.
    """

    step: StepPrediction
    strategies: tuple[StrategyPrediction, ...]
    chosen: StrategyPrediction
    reason: str
    #: the parallel layout (:func:`sftctl.compiler.layouts.offering.plan_layout`'s document: label,
    #: degrees, source); a model-parallel layout that replaces the strategy is ``chosen`` too
    layout: dict | None = None

    @property
    def step_time_s(self) -> float:
        """The chosen strategy's seconds per step."""
        return self.chosen.step_time_s

    @property
    def memory_bytes(self) -> int:
        """The chosen strategy's peak bytes per device."""
        return self.chosen.memory_bytes

    @property
    def devices_needed(self) -> int:
        """1 when the chosen strategy fits a device; else the devices plain data parallel would
        need with parameters and optimizer state sharded (> 1), or 0 when activations alone do
        not fit."""
        if self.chosen.fits:
            return 1
        return self.step.devices_needed if self.step.devices_needed > 1 else 0


def predict(compiled: CompiledStep, target: Target, *, gpus_per_node: int, nodes: int,
            intra_node_bytes_per_s: float | None, inter_node_bytes_per_s: float | None, mode: str,
            param_dtype_bytes: int, parallelisms: tuple[str, ...] = PARALLELISMS,
            checkpointing: tuple[bool, ...] = (False, True), provider: str | None = None,
            graph: Graph | None = None, global_batch: int | None = None,
            model_parallel: bool = True, pipeline: bool = True,
            reduce_dtype_bytes: int = REDUCE_DTYPE_BYTES) -> OfferingPrediction:
    """``compiled`` (one rank's share of the batch) on ``nodes`` x ``gpus_per_node`` devices of
    ``target``, in execution ``mode`` (``eager``, ``default``, ``sftensor``), under each of
    ``parallelisms`` x ``checkpointing``.

    Args:
        intra_node_bytes_per_s / inter_node_bytes_per_s: the offering's links, bytes/s (None:
            :mod:`sftctl.compiler.step`'s defaults); inter-node is per node.
        param_dtype_bytes: bytes of the dtype FSDP gathers parameters in (2 under bf16/fp16
            mixed precision, 4 in float32).
        reduce_dtype_bytes: bytes of the dtype FSDP reduce-scatters gradients in (torch's
            ``MixedPrecisionPolicy.reduce_dtype``: 4, float32, as ``sftctl.train.prepare`` runs; 2
            for a job reducing in bf16).
        provider: the offering's provider, or ``provider:instance_type``: which network joins
            its nodes (EFA on ``aws``, GPUDirect-TCPX on ``gcp:a3-highgpu-8g``, else RDMA /
            InfiniBand; :func:`sftctl.compiler.collectives.network_link`).
        graph / global_batch: the traced step and the sequences per step: with both, the parallel
            layouts are searched (:mod:`sftctl.compiler.layouts`) and a tensor/pipeline/context
            parallel one replaces the strategy where that does not fit or is slower
            (``model_parallel`` False: data parallel only; ``pipeline`` False: no pipeline stages).
    """
    step = predict_step(compiled, target, gpus_per_node, nodes, intra_node_bytes_per_s, inter_node_bytes_per_s,
                        mode=mode, provider=provider)
    strategies = predict_strategies(compiled, target, gpus_per_node, nodes, intra_node_bytes_per_s,
                                    inter_node_bytes_per_s, mode=mode, param_dtype_bytes=param_dtype_bytes,
                                    parallelisms=parallelisms, checkpointing=checkpointing, provider=provider,
                                    reduce_dtype_bytes=reduce_dtype_bytes)
    chosen, reason = choose(strategies)
    layout = None
    if global_batch:
        from sftctl.compiler.layouts import Links
        from sftctl.compiler.layouts.offering import plan_layout

        links = Links(target.name, gpus_per_node, nodes, intra_node_bytes_per_s, inter_node_bytes_per_s, provider)
        layout, replaced, why = plan_layout(graph, target, chosen, links, global_batch, model_parallel=model_parallel,
                                            pipeline=pipeline)
        if replaced is not None:
            chosen, reason = cast(StrategyPrediction, replaced), why or reason
    return OfferingPrediction(step, tuple(strategies), chosen, reason, layout)
