"""From a job's ``model`` section to compiled steps, with a disk cache for both stages.

* ``trace_model``: the entrypoint's whole training step as an IR graph. Cached (pickle) under
  ``<cache>/traces/``, keyed by the framework, entrypoint, batch size, dtype, the bytes of every
  ``.py`` file in the entrypoint's directory, and the compiler's fingerprint.
* ``compile_for``: one target's CompiledStep. Cached (JSON) under ``<cache>/steps/``, keyed
  by graph signature, matmul precision, dtype map, the target (hardware numbers, cost-model
  coefficients, peer model) and the compiler's fingerprint.

``<cache>`` is :func:`sftctl.compiler.cache.cache_dir` (the platform's user cache directory);
every key is :func:`sftctl.compiler.cache.cache_key`.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Callable

from sftctl.compiler.cache import atomic_write
from sftctl.compiler.cache import cache_dir, cache_key
from sftctl.compiler.ir import Graph
from sftctl.compiler.step import CompiledStep, compile_graph, graph_signature
from sftctl.compiler.target import Target


def trace_key(framework: str, entrypoint: str, workdir: str, batch_size: int, dtype: str,
              *bounds: float) -> str:
    """Cache key of a trace: the arguments and the bytes of every ``.py`` file next to the
    entrypoint's file (the modules a model imports from its directory)."""
    file = Path(workdir) / entrypoint.rsplit(":", 1)[0]
    sources = {py.name: py.read_bytes() for py in sorted(file.parent.glob("*.py"))}
    return cache_key("trace", framework, entrypoint, batch_size, dtype, sources, *(b for b in bounds if b != 1.0))


def trace_model(framework: str, entrypoint: str, workdir: str, batch_size: int, dtype: str,
                use_cache: bool = True, mask_fraction: float = 1.0, expert_capacity: float = 1.0) -> Graph:
    """Trace the whole training step that ``entrypoint`` builds (see the job spec's ``model``).

    Raises:
        SpecError: the entrypoint cannot be imported or called, or returns the wrong things.
        NotImplementedError: the step uses an op the frontend cannot lower (named).
    """
    key = trace_key(framework, entrypoint, workdir, batch_size, dtype, mask_fraction, expert_capacity)
    bounds = {"mask_fraction": mask_fraction, "expert_capacity": expert_capacity}
    path = cache_dir() / "traces" / f"{key}.pkl"
    if not use_cache:
        return _trace(framework, entrypoint, workdir, batch_size, dtype, bounds)
    cached = _load_trace(path)
    if cached is not None:
        return cached
    from filelock import FileLock

    # concurrent cold runs of one model trace it once: the others wait here, then read the cache
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        cached = _load_trace(path)
        if cached is not None:
            return cached
        graph = _trace(framework, entrypoint, workdir, batch_size, dtype, bounds)
        atomic_write(path, pickle.dumps(graph))
    return graph


def _load_trace(path: Path) -> Graph | None:
    if path.exists():
        try:
            return pickle.loads(path.read_bytes())
        except Exception:  # noqa: BLE001 a stale or truncated cache entry is rebuilt, never trusted
            path.unlink(missing_ok=True)
    return None


def _trace(framework: str, entrypoint: str, workdir: str, batch_size: int, dtype: str, bounds: dict) -> Graph:
    if framework == "jax":
        from sftctl.compiler.frontends.jax import trace_entrypoint
        bounds = {}
    else:
        from sftctl.compiler.frontends.torch import trace_entrypoint
    graph = trace_entrypoint(entrypoint, workdir, batch_size=batch_size, dtype=dtype, **bounds)
    if isinstance(graph, tuple):  # frontends return (graph, meta)
        graph = graph[0]
    return graph


def compile_for(graph: Graph, target: Target, progress: Callable[[int, int], None] | None = None,
                use_cache: bool = True, matmul_precision: str = "highest",
                mma_dtype_map: dict[str, str] | None = None) -> CompiledStep:
    """Compile ``graph`` for ``target`` (cached on disk); ``matmul_precision`` and
    ``mma_dtype_map`` as :func:`sftctl.compiler.step.compile_graph` takes them. The key holds the
    whole target: hardware numbers, coefficients and the peer model."""
    key = cache_key("step", graph_signature(graph), matmul_precision, mma_dtype_map or {}, target)
    path = cache_dir() / "steps" / f"{key}.json"
    if use_cache and path.exists():
        try:
            return CompiledStep.from_dict(json.loads(path.read_text()))
        except Exception:  # noqa: BLE001 a stale or truncated cache entry is recompiled
            path.unlink(missing_ok=True)
    compiled = compile_graph(graph, target, progress=progress, matmul_precision=matmul_precision,
                             mma_dtype_map=mma_dtype_map)
    if use_cache:
        atomic_write(path, json.dumps(compiled.to_dict()).encode())
    return compiled
