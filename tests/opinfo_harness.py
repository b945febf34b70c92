"""PyTorch's OpInfo database through sftctl's torch frontend and the float64 interpreter.

For one OpInfo sample (``torch.testing._internal.common_methods_invocations.op_db``, CPU,
float64) :func:`check_sample` traces ``op(sample.input, *sample.args, **sample.kwargs)`` with
``make_fx`` and the frontend's own decomposition table (what ``trace_step`` records: Core ATen
plus the frontend's extras), lowers the graph with the frontend's ``_Lowering`` (the op table
:data:`sftctl.compiler.frontends.torch.OPS`), runs the IR in float64 with
:mod:`sftctl.compiler.interpreter` and compares every output with torch's own float64 result:
floats within ``RTOL`` relative plus ``ATOL_REL`` times the largest finite magnitude among the
sample's float inputs and torch's output (a difference of O(1) inputs that cancels to 1e-16 is
compared at the inputs' scale, not its own) (NaN where
torch has NaN, infinities equal), integers and bools exactly. With ``backward`` the vector-Jacobian
product of the float outputs (a fixed random cotangent) with respect to every float input is
traced, run and compared the same way.

Outcomes (:class:`Outcome.status`): ``pass``; ``missing`` (the graph holds ATen ops the op table
lacks: ``ops`` names them); ``unsupported`` (the lowering refused a form of a lowered op with its
``NotImplementedError``, e.g. an integer bitwise op; ``why`` says which); ``skip`` (torch itself
cannot trace or run the sample, or it has no float64 output to check); ``mismatch`` (values
differ: a wrong lowering) and ``error`` (any other exception while lowering or interpreting: a
bug). :func:`core_aten_coverage` is the Core ATen figure (``torch.Tag.core`` packets the table
lowers, or that the frontend's decomposition table rewrites into other ops).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable

import numpy as np
import torch
import torch.utils._pytree as pytree

#: relative tolerance of a float output (the interpreter computes in float64, as torch does)
RTOL = 1e-7
#: absolute tolerance, as a fraction of the output's largest finite magnitude (cancellation in a
#: sum ordered differently than torch's)
ATOL_REL = 1e-9

#: OpInfos whose outputs are random, uninitialized or depend on torch's RNG stream: their values
#: cannot be compared with the interpreter's (the IR fixes distributions, not bits)
NONDETERMINISTIC = frozenset({
    "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted",
    "bernoulli", "normal", "normal.number_mean", "normal.in_place", "multinomial", "rand_like", "randn_like",
    "randint", "randint_like", "uniform", "exponential", "geometric", "cauchy", "log_normal",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.feature_alpha_dropout.without_train",
    "nn.functional.rrelu", "torch._C._nn._test_ambiguous_defaults", "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d", "randn", "rand", "randperm", "nn.functional.multi_head_attention_forward",
    "nn.functional.scaled_dot_product_attention",  # dropout_p > 0 samples draw from torch's stream
    "pca_lowrank", "svd_lowrank",  # randomized range finders: torch.randn inside
})

#: OpInfos whose outputs hold eigen- or singular vectors, defined up to sign: compared (forward and
#: backward) through the sample's own ``output_process_fn_grad`` (``abs`` of the vectors, as
#: torch's gradcheck of them does)
GAUGE = frozenset({"linalg.eigh", "linalg.svd", "svd", "linalg.eig"})


def op_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


@dataclasses.dataclass
class Outcome:
    """One sample's result (see the module docstring for ``status``)."""

    status: str
    ops: tuple[str, ...] = ()
    why: str = ""


def _packet(target) -> str | None:
    if not isinstance(target, torch._ops.OpOverload):
        return None
    name = target._schema.name
    if not name.startswith("aten::"):
        return None
    packet = name.split("::")[-1]
    if packet.endswith("_") and not packet.startswith("_") and target._schema.is_mutable:
        packet = packet[:-1]
    return packet


def graph_packets(gm) -> set[str]:
    """The ATen op packets (in-place ones as their functional packet) a traced graph calls."""
    return {p for n in gm.graph.nodes if n.op == "call_function" and (p := _packet(n.target))}


def _flat(sample) -> tuple[list, Any]:
    return pytree.tree_flatten((sample.input, list(sample.args), dict(sample.kwargs)))


def _tensor_outputs(out) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _scale(tensors) -> float:
    """The largest finite magnitude among float ``tensors`` (0.0 without one)."""
    best = 0.0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.numel():
            a = t.detach().abs().to(torch.float64)
            a = a[torch.isfinite(a)]
            if a.numel():
                best = max(best, float(a.max()))
    return best


def _compare(got: np.ndarray, ref: torch.Tensor, what: str, in_scale: float = 0.0) -> str | None:
    ref = ref.detach()
    ref_np = (ref.to(torch.float64) if ref.dtype.is_floating_point
              else ref.to(torch.int64) if ref.dtype in (torch.uint16, torch.uint32, torch.uint64) else ref).numpy()
    if tuple(got.shape) != tuple(ref_np.shape):
        return f"{what}: shape {tuple(got.shape)} != torch's {tuple(ref_np.shape)}"
    if ref.dtype.is_floating_point:
        finite = np.abs(ref_np[np.isfinite(ref_np)])
        scale = max(float(finite.max()) if finite.size else 0.0, in_scale)
        try:
            np.testing.assert_allclose(got.astype(np.float64), ref_np, rtol=RTOL, atol=ATOL_REL * scale,
                                       equal_nan=True)
        except AssertionError as e:
            return f"{what}: " + " ".join(str(e).split())[:300]
        return None
    if not np.array_equal(got.astype(ref_np.dtype), ref_np):
        bad = int(np.sum(got.astype(ref_np.dtype) != ref_np))
        return f"{what}: {bad} of {ref_np.size} {ref.dtype} elements differ"
    return None


@functools.lru_cache(maxsize=1)
def _decompositions() -> dict:
    from sftctl.compiler.frontends.torch import decomposition_table

    return decomposition_table()


def _trace(fn, args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, decomposition_table=_decompositions(), tracing_mode="real")(*args)


def _lower_and_run(gm, args: list[torch.Tensor], n_out: int) -> list[np.ndarray]:
    from sftctl.compiler import interpreter
    from sftctl.compiler.frontends.torch import _Lowering

    gm.graph.eliminate_dead_code()
    roles = [("batch", f"arg{i}") for i in range(len(args))]
    graph, ids = _Lowering(gm).run(roles, [f"out{i}" for i in range(n_out)])
    feed = {i: (a.detach().to(torch.float32) if a.dtype == torch.bfloat16 else a.detach()).numpy()
            for i, a in zip(ids, args)}
    # float64 nodes in float64; a float32/bfloat16/float16 node (a cast the op makes) in its dtype
    return interpreter.run(graph, feed, dtype=None)


def _vjp_outputs(call, tensors, diff):
    """(float outputs that depend on the inputs ``diff``, those inputs) of one eager call."""
    xs = [t.clone().requires_grad_(True) if k in diff else t for k, t in enumerate(tensors)]
    with torch.enable_grad():
        outs = [t for t in _tensor_outputs(call(*xs)) if t.dtype.is_floating_point and t.requires_grad]
        if outs:  # torch refuses here what it cannot differentiate
            torch.autograd.grad(outs, [xs[k] for k in diff], [torch.ones_like(t) for t in outs],
                                allow_unused=True)
    return [t.detach() for t in outs], [xs[k] for k in diff]


def check_sample(op, sample, *, backward: bool = False) -> Outcome:
    """Trace, lower and interpret one sample of OpInfo ``op``; compare with torch (float64, CPU)."""
    from sftctl.compiler.frontends.torch import OPS

    leaves, spec = _flat(sample)
    pos = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    tensors = [leaves[i].detach() for i in pos]

    def call(*ts):
        vals = list(leaves)
        for i, t in zip(pos, ts):
            vals[i] = t
        inp, args, kwargs = pytree.tree_unflatten(vals, spec)
        out = op.op(inp, *args, **kwargs)
        return sample.output_process_fn_grad(out) if op_name(op) in GAUGE else out

    if op.name.startswith("as_strided") and isinstance(sample.input, torch.Tensor) and sample.input._base is not None:
        # as_strided indexes the view's base storage, which a traced graph's input does not carry
        return Outcome("skip", why="as_strided of a view reaches into its base's storage")
    try:
        ref = _tensor_outputs(call(*tensors))
    except Exception as e:  # noqa: BLE001 - a sample torch itself refuses
        return Outcome("skip", why=f"torch: {type(e).__name__}: {str(e)[:120]}")
    if any(t.dtype.is_complex for t in ref + tensors) or not ref:
        return Outcome("skip", why="complex or no tensor output")
    if backward:
        if not op.supports_autograd:
            return Outcome("skip", why="not differentiable")
        floats = [k for k, t in enumerate(tensors) if t.dtype.is_floating_point]
        # every float tensor, else (torch refuses some: running statistics) the sample's input alone
        tries = [floats] + ([[0]] if isinstance(sample.input, torch.Tensor) and floats[:1] == [0] else [])
        for diff in tries:
            try:
                ref_out, wrt_ref = _vjp_outputs(call, tensors, diff)
            except RuntimeError:
                continue
            break
        else:
            return Outcome("skip", why="torch cannot differentiate the sample")
        if not ref_out:
            return Outcome("skip", why="no float output depends on a float input")
        gen = torch.Generator().manual_seed(7)
        cots = [torch.randn(t.shape, dtype=t.dtype, generator=gen) for t in ref_out]
        keep = [k for k, t in enumerate(_tensor_outputs(call(*tensors))) if t.dtype.is_floating_point]

        def vjp(*ts):
            xs = list(ts[:len(tensors)])
            for k in diff:
                xs[k] = xs[k].requires_grad_(True)
            with torch.enable_grad():
                outs = _tensor_outputs(call(*xs))
                fouts = [outs[k] for k in keep if outs[k].requires_grad]
                wrt = [xs[k] for k in diff]
                grads = torch.autograd.grad(fouts, wrt, list(ts[len(tensors):]), allow_unused=True)
            return [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]

        args = [t.clone() for t in tensors] + cots
        try:
            ref = [r.detach() for r in vjp(*[t.clone() for t in args])]
            gm = _trace(vjp, [t.clone() for t in args])
        except Exception as e:  # noqa: BLE001
            return Outcome("skip", why=f"torch backward: {type(e).__name__}: {str(e)[:120]}")
    else:
        args = tensors
        try:
            gm = _trace(lambda *ts: _tensor_outputs(call(*ts)), [t.clone() for t in tensors])
        except Exception as e:  # noqa: BLE001
            return Outcome("skip", why=f"make_fx: {type(e).__name__}: {str(e)[:120]}")
    missing = tuple(sorted(p for p in graph_packets(gm) if p not in OPS))
    if missing:
        return Outcome("missing", ops=missing)
    try:
        got = _lower_and_run(gm, args, len(ref))
    except NotImplementedError as e:
        return Outcome("unsupported", why=str(e).split(" (in module")[0][:200])
    except Exception as e:  # noqa: BLE001 - a lowering or interpreter bug
        return Outcome("error", why=f"{type(e).__name__}: {str(e)[:240]}")
    if len(got) != len(ref):
        return Outcome("error", why=f"{len(got)} outputs, torch has {len(ref)}")
    for k, (g, r) in enumerate(zip(got, ref)):
        bad = _compare(np.asarray(g), r, f"{'grad' if backward else 'output'} {k}", _scale(args))
        if bad:
            return Outcome("mismatch", why=bad)
    return Outcome("pass")


def selected_ops(names: Iterable[str] | None = None):
    """The OpInfos checked: those of ``op_db`` that run in float64 on the CPU, less
    :data:`NONDETERMINISTIC`, in ``op_db``'s order (``names`` narrows to those ``op_name``s)."""
    from torch.testing._internal.common_methods_invocations import op_db

    wanted = set(names) if names is not None else None
    for op in op_db:
        name = op_name(op)
        if name in NONDETERMINISTIC or op.name in NONDETERMINISTIC:
            continue
        if wanted is not None and name not in wanted:
            continue
        if torch.float64 not in op.supported_dtypes("cpu"):
            continue
        yield op


def samples(op, limit: int, seed: int = 0):
    """The first ``limit`` float64 CPU samples of ``op``, drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    out = []
    try:
        for s in op.sample_inputs("cpu", torch.float64, requires_grad=False):
            out.append(s)
            if len(out) >= limit:
                break
    except Exception:  # noqa: BLE001 - a sample generator needing what this machine lacks
        pass
    return out


def check_op(op, *, limit: int = 3, backward_limit: int = 1, seed: int = 0) -> dict[str, Any]:
    """Every outcome of ``op``'s first ``limit`` samples (seed ``seed``) forward and
    ``backward_limit`` backward: ``{"name", "forward": [Outcome], "backward": [Outcome]}``."""
    ss = samples(op, limit, seed)
    fwd = [check_sample(op, s) for s in ss]
    bwd = [check_sample(op, s, backward=True) for s in ss[:backward_limit]] if op.supports_autograd else []
    return {"name": op_name(op), "forward": fwd, "backward": bwd}


def core_aten_packets() -> set[str]:
    """Core ATen: the ``torch.ops.aten`` overload packets with an overload tagged ``torch.Tag.core``."""
    out = set()
    # every registered aten schema (``dir(torch.ops.aten)`` lists only the packets loaded so far)
    names = {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::")}
    for name in sorted(names):
        try:
            packet = getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            continue
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        if any(torch.Tag.core in getattr(packet, ov).tags for ov in packet.overloads()):
            out.add(packet._qualified_op_name.split("::")[-1])
    return out


def core_aten_coverage() -> dict[str, Any]:
    """``{"total", "lowered", "lowered_directly", "decomposed", "missing", "percent"}`` over
    :func:`core_aten_packets`: ``lowered_directly`` have an op-table entry; ``decomposed`` never
    reach the table (the frontend's decomposition table rewrites them into other ops, which the
    OpInfo check then runs); ``missing`` are neither."""
    from sftctl.compiler.frontends.torch import OPS, decomposition_table

    core = core_aten_packets()
    decomposed = {k._schema.name.split("::")[-1] for k in decomposition_table()}
    direct = sorted(p for p in core if p in OPS)
    via = sorted(p for p in core if p not in OPS and p in decomposed)
    missing = sorted(core - set(direct) - set(via))
    lowered = len(direct) + len(via)
    return {"total": len(core), "lowered": lowered, "lowered_directly": len(direct), "decomposed": via,
            "missing": missing, "percent": round(100.0 * lowered / len(core), 1)}


def sweep(limit: int = 3, backward_limit: int = 1, names: Iterable[str] | None = None,
          seed: int = 0, shard: tuple[int, int] = (0, 1)) -> list[dict[str, Any]]:
    """:func:`check_op` over :func:`selected_ops`; ``shard=(k, n)``: only the OpInfos whose
    index in that order is ``k`` modulo ``n`` (the suite runs the sweep as ``n`` tests, which
    pytest-xdist spreads over its workers)."""
    k, n = shard
    return [check_op(op, limit=limit, backward_limit=backward_limit, seed=seed)
            for i, op in enumerate(selected_ops(names)) if i % n == k]


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts of outcomes over a sweep's samples; per missing ATen op the OpInfos it blocks
    (most first); each mismatch and error."""
    counts: dict[str, int] = {}
    blocks: dict[str, set[str]] = {}
    bad = []
    for r in results:
        for kind in ("forward", "backward"):
            for o in r[kind]:
                counts[f"{kind}_{o.status}"] = counts.get(f"{kind}_{o.status}", 0) + 1
                for p in o.ops:
                    blocks.setdefault(p, set()).add(r["name"])
                if o.status in ("mismatch", "error"):
                    bad.append(f"{r['name']} {kind}: {o.status}: {o.why}")
    fully = sum(1 for r in results if r["forward"] and all(o.status == "pass" for o in r["forward"] + r["backward"]))
    return {"opinfos": len(results), "opinfos_all_samples_pass": fully, "samples": dict(sorted(counts.items())),
            "missing_ops_by_opinfos_blocked": {p: sorted(v) for p, v in sorted(blocks.items(), key=lambda kv: (-len(kv[1]), kv[0]))},
            "failures": bad}


