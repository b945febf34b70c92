"""Capture of one training step (forward, loss, backward, AdamW) as an ATen FX graph, and its lowering.

:func:`trace_step` runs the step under ``make_fx`` with :func:`decomposition_table` and hands the
graph to :class:`~.lowering._Lowering`; :func:`trace_entrypoint` does so for a spec's entrypoint.
See the package docstring (:mod:`sftctl.compiler.frontends.torch`) for the graph's inputs, outputs,
mixed precision and the model errors raised.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from sftctl.compiler.ir import Graph
from sftctl.compiler.frontends.torch.attention import _DecomposeSDPA
from sftctl.compiler.frontends.torch.branches import Representative, branch_value, values_read
from sftctl.compiler.frontends.torch.rnn import tagged_rnns
from sftctl.compiler.frontends.torch.lowering import _Lowering
from sftctl.compiler.frontends import user_prints_to_stderr
from sftctl.compiler.frontends.torch.decomps import grid_sample_decomposed

aten = torch.ops.aten

# extra decompositions on top of core_aten_decompositions(): ops core ATen keeps but the IR spells out
_EXTRA_DECOMPS = (
    "native_layer_norm", "native_group_norm", "gelu", "_softmax", "_log_softmax", "addcmul", "addcdiv", "lerp", "logsumexp", "softplus", "hardtanh",
    "leaky_relu", "elu", "hardswish", "hardsigmoid", "mish", "log_sigmoid_forward", "rsub",
    "masked_fill", "linalg_vector_norm", "norm", "glu", "huber_loss", "smooth_l1_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "xlogy", "logit", "stack", "repeat",
    "tril", "triu", "_unsafe_index", "index_add",
    "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d", "unfold", "grid_sampler_2d",
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training",
)


def decomposition_table() -> dict:
    """``core_aten_decompositions()`` plus the extras the lowering relies on, less the ops the
    lowering keeps whole (``native_dropout`` and its backward: a bool keep-mask, as torch saves
    it, instead of the decomposition's float mask)."""
    from torch._decomp import core_aten_decompositions, get_decompositions

    table = dict(core_aten_decompositions())
    table.update(get_decompositions([getattr(aten, n) for n in _EXTRA_DECOMPS if hasattr(aten, n)]))
    from sftctl.compiler.frontends.torch.moe import decompositions as moe_decompositions

    table.update(moe_decompositions())  # aten._grouped_mm -> sftctl::grouped_mm (any float dtype)
    from sftctl.compiler.frontends.torch.ctc import decompositions as ctc_decompositions

    table.update(ctc_decompositions())  # aten._ctc_loss.Tensor -> sftctl::ctc_loss (a static log_alpha)
    from sftctl.compiler.frontends.torch.decomps import decompositions as extra_decompositions

    table.update(extra_decompositions())  # lgamma/digamma/trigamma, adaptive_max_pool2d (+ backward)
    from sftctl.compiler.frontends.torch.solvers import decompositions as solver_decompositions

    table.update(solver_decompositions())  # eigh, svd, qr, LU, solve, inv, det (tagged for cuSOLVER)
    for op in _KEEP_WHOLE:
        for overload in op.overloads():
            table.pop(getattr(op, overload), None)
    return table


_KEEP_WHOLE = (aten.native_dropout, aten.native_dropout_backward)


@contextlib.contextmanager
def _onednn_off():
    """``torch.backends.mkldnn`` disabled, nothing else touched (its ``flags()`` also resets
    oneDNN's TF32 switch, which warns on every trace on a CPU without an Intel GPU)."""
    before = torch.backends.mkldnn.set_flags(_enabled=False, _fp32_precision=None)[0]
    try:
        yield
    finally:
        torch.backends.mkldnn.set_flags(_enabled=before, _fp32_precision=None)


class _LossModule(torch.nn.Module):
    """Holds the model so ``functional_call`` can swap its parameters around ``loss_fn``."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable) -> None:
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn

    def forward(self, batch):
        return self._loss_fn(self.model, batch)


def _adamw(params, grads, ms, vs, step, *, lr, betas, eps, decays, grad_clip):
    b1, b2 = betas
    if grad_clip is not None:
        reals = [torch.view_as_real(g) if g.is_complex() else g for g in grads]  # |g|^2 of a complex one
        sq = [torch.sum(g.to(torch.float32) * g.to(torch.float32)) if g.dtype in (torch.bfloat16, torch.float16)
              else torch.sum(g * g) for g in reals]
        total = torch.sqrt(sum(sq[1:], sq[0]))
        coef = torch.clamp(grad_clip / (total + 1e-6), max=1.0)
        grads = [g * coef.to(g.real.dtype if g.is_complex() else g.dtype) for g in grads]
    bias1 = 1 - torch.pow(b1, step)
    bias2_sqrt = torch.sqrt(1 - torch.pow(b2, step))
    step_size = lr / bias1
    new_p, new_m, new_v = [], [], []
    for p, g, m, v, wd in zip(params, grads, ms, vs, decays):
        if p.is_complex():  # torch's AdamW steps a complex parameter as its real view
            p2, m2, v2 = _adamw([torch.view_as_real(p)], [torch.view_as_real(g.to(p.dtype))], [torch.view_as_real(m)],
                                [torch.view_as_real(v)], step, lr=lr, betas=betas, eps=eps, decays=[wd], grad_clip=None)
            new_p.append(torch.view_as_complex(p2[0]))
            new_m.append(torch.view_as_complex(m2[0]))
            new_v.append(torch.view_as_complex(v2[0]))
            continue
        g = g.to(p.dtype)
        m2 = m + (g - m) * (1 - b1)  # exp_avg.lerp_(grad, 1 - beta1)
        v2 = v * b2 + g * g * (1 - b2)  # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
        p2 = p * (1 - lr * wd) if wd else p
        denom = torch.sqrt(v2) / bias2_sqrt.to(v2.dtype) + eps
        p2 = p2 - step_size.to(p.dtype) * (m2 / denom)
        new_p.append(p2)
        new_m.append(m2)
        new_v.append(v2)
    return new_p, new_m, new_v


def _reparametrized(module: torch.nn.Module, state: dict):
    """``module`` with its parameters and buffers swapped for ``state`` (tied names follow), as
    ``torch.func.functional_call`` does, for as long as the context lasts."""
    try:
        from torch.nn.utils.stateless import _reparametrize_module
    except ImportError:  # pragma: no cover - private API moved
        return _reparametrize_fallback(module, state)
    return _reparametrize_module(module, state, tie_weights=True)


@contextlib.contextmanager
def _reparametrize_fallback(module, state):  # pragma: no cover - used only if torch moves the API
    saved = {}
    for name, t in state.items():
        mod_path, _, attr = name.rpartition(".")
        mod = module.get_submodule(mod_path)
        saved[name] = (mod, attr, mod._parameters.get(attr, mod._buffers.get(attr)))
        store = mod._parameters if attr in mod._parameters else mod._buffers
        store[attr] = t
    try:
        yield
    finally:
        for mod, attr, t in saved.values():
            store = mod._parameters if attr in mod._parameters else mod._buffers
            store[attr] = t


def _mutated_inputs(gm: fx.GraphModule, first: int, count: int) -> list[int]:
    """Indices ``0..count-1`` of the placeholders ``first..first+count-1`` that an op of ``gm``
    writes in place (an argument its schema marks as written: ``copy_``, ``add_``, ...). A
    decomposition's ``copy_`` into a running statistic is seen here, where autograd's version
    counter is not (``native_batch_norm`` does not declare its running stats as written)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][first:first + count]
    index = {n: i for i, n in enumerate(placeholders)}
    out: set[int] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        for k, arg in enumerate(n.target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            val = n.args[k] if k < len(n.args) else n.kwargs.get(arg.name)
            if isinstance(val, fx.Node) and val in index:
                out.add(index[val])
    return sorted(out)


def _model_frame(tb) -> str:
    """``file:line (function)`` of the innermost traceback frame in the model's code: the first
    frame, from the inside out, that is not in torch, in this compiler or in the standard library."""
    import os
    import sysconfig
    import traceback

    skip = tuple(os.path.dirname(m) + os.sep for m in (torch.__file__, __file__))
    skip += (os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)
    frames = traceback.extract_tb(tb)
    for f in reversed(frames):
        if not os.path.abspath(f.filename).startswith(skip):
            return f"{f.filename}:{f.lineno} ({f.name})"
    return "an unknown place (no frame outside torch)"


@contextlib.contextmanager
def _module_stack_meta(root: torch.nn.Module):
    """Record each traced node's module path, as ``node.meta["nn_module_stack"]`` (an ordered dict
    ``path -> (path, "module.QualName")``, outermost first, paths relative to ``root``; the
    convention of torch.export), through global module hooks and FX's preserved node meta (much
    cheaper than make_fx's ``record_module_stack`` tracer). Backward nodes get their forward
    node's stack as ``meta["fwd_nn_module_stack"]`` (:func:`_backward_module_stacks`)."""
    from torch.fx import traceback as fx_traceback
    from torch.nn.modules import module as nn_module

    paths: dict[int, str] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), name)
    saved: list = []

    def pre(mod, args):
        path = paths.get(id(mod))
        if path is None:
            return
        stack = fx_traceback.current_meta.get("nn_module_stack")
        saved.append(stack)
        new = dict(stack or {})
        new[path] = (path, f"{type(mod).__module__}.{type(mod).__qualname__}")
        fx_traceback.current_meta["nn_module_stack"] = new

    def post(mod, args, out):
        if id(mod) not in paths or not saved:
            return
        prev = saved.pop()
        if prev is None:
            fx_traceback.current_meta.pop("nn_module_stack", None)
        else:
            fx_traceback.current_meta["nn_module_stack"] = prev

    with fx_traceback.preserve_node_meta():
        h1 = nn_module.register_module_forward_pre_hook(pre)
        h2 = nn_module.register_module_forward_hook(post, always_call=True)
        try:
            yield
        finally:
            h1.remove()
            h2.remove()


def _tag_backward(loss: torch.Tensor) -> None:
    """Let backward nodes carry their forward op's autograd sequence number (AOTAutograd's hooks)."""
    try:
        from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks
    except ImportError:  # private API moved: backward nodes go without module paths
        return
    if loss.grad_fn is not None:
        setup_stacktrace_preservation_hooks([loss.grad_fn])


def _backward_module_stacks(gm: fx.GraphModule) -> None:
    """Give each backward node (``meta["autograd_backward"]``) the ``nn_module_stack`` of the
    forward node with its autograd ``seq_nr``, as ``meta["fwd_nn_module_stack"]`` (what
    AOTAutograd's ``copy_fwd_metadata_to_bw_nodes`` does for its joint graphs)."""
    fwd: dict[int, dict] = {}
    rnn: dict[int, dict] = {}  # the forward's RNN call tag (.rnn), for its backward too
    for n in gm.graph.nodes:
        if n.op == "call_function" and not n.meta.get("autograd_backward") and "seq_nr" in n.meta:
            if n.meta.get("nn_module_stack"):
                fwd.setdefault(n.meta["seq_nr"], n.meta["nn_module_stack"])
            if (n.meta.get("custom") or {}).get("rnn"):
                rnn.setdefault(n.meta["seq_nr"], n.meta["custom"]["rnn"])
    for n in gm.graph.nodes:
        if n.meta.get("autograd_backward") and n.meta.get("seq_nr") in fwd:
            n.meta["fwd_nn_module_stack"] = fwd[n.meta["seq_nr"]]
        tag = rnn.get(n.meta.get("seq_nr"))
        if tag is None and n.meta.get("autograd_backward") and n.op == "call_function":
            # a backward op on the RNN's tensors alone (autograd's accumulation of a weight's
            # per-step gradients: cuDNN's weight GEMM over the sequence; a decomposed gate's)
            tags = [(a.meta.get("custom") or {}).get("rnn") for a in n.all_input_nodes if a.op != "get_attr"]
            tag = tags[0] if tags and all(tags) else None
        if n.meta.get("autograd_backward") and tag is not None:
            n.meta["custom"] = {**(n.meta.get("custom") or {}), "rnn": tag}


@contextlib.contextmanager
def _reentrant_checkpoint_as_non_reentrant(no_grad_calls: list):
    """``torch.utils.checkpoint``'s reentrant form (``CheckpointFunction``, ``use_reentrant=True``,
    the default of much research code and of transformers before 4.35) traced as the
    non-reentrant form: the same recomputation in the backward and the same gradients, seen by
    the traced step's autograd (the reentrant form runs a backward of its own inside the
    backward, on inputs it detached, which ``make_fx`` cannot record). As torch does, a call none
    of whose tensor inputs requires grad runs under ``no_grad``: its outputs carry no gradient and
    the parameters inside it get none; its ``file:line`` is appended to ``no_grad_calls``."""
    import torch.utils.checkpoint as ck

    def as_non_reentrant(function, preserve_rng_state, *args):
        if not torch.is_grad_enabled():
            return function(*args)
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            import sys
            import traceback

            no_grad_calls.append(_model_frame_of(traceback.extract_stack(sys._getframe(1))) or "an unknown place")
            with torch.no_grad():
                return function(*args)
        return ck.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)

    own = "apply" in ck.CheckpointFunction.__dict__
    saved = ck.CheckpointFunction.__dict__.get("apply")
    ck.CheckpointFunction.apply = as_non_reentrant
    try:
        yield
    finally:
        if own:
            ck.CheckpointFunction.apply = saved
        else:
            del ck.CheckpointFunction.apply


#: ATen packets of a finiteness test and the value each has on finite data
_FINITE_TESTS = {"isnan": False, "isinf": False, "isposinf": False, "isneginf": False, "isfinite": True}


def _finite_check_verdict(node, depth: int = 0) -> bool | None:
    """The value a finiteness check (``torch.isnan(h).any()``, ``torch.isfinite(loss).all()``,
    ``~``/``not`` of one, ``x != x``, as decomposed: ``x == x``, ``|x| != inf``, their product)
    has on finite data, from the FX node that computed it; None for any other tensor."""
    if node is None or getattr(node, "op", None) != "call_function" or depth > 12:
        return None
    packet = getattr(getattr(node.target, "_schema", None), "name", "").split("::")[-1]
    args = node.args
    if packet in ("any", "all", "_to_copy", "clone", "alias", "view", "squeeze", "reshape", "expand"):
        return _finite_check_verdict(args[0], depth + 1)
    if packet in ("logical_not", "bitwise_not"):
        v = _finite_check_verdict(args[0], depth + 1)
        return None if v is None else not v
    if packet in _FINITE_TESTS:
        return _FINITE_TESTS[packet]
    if packet in ("eq", "ne") and len(args) == 2:
        if args[0] is args[1]:  # x == x: not NaN
            return packet == "eq"
        if isinstance(args[1], float) and math.isinf(args[1]):  # |x| == inf, x != -inf
            return packet == "ne"
        return None
    if packet in ("mul", "logical_and", "bitwise_and", "logical_or", "bitwise_or", "add") and len(args) == 2:
        a, b = (_finite_check_verdict(x, depth + 1) for x in args)
        if a is None or b is None:
            return None
        return (a and b) if packet in ("mul", "logical_and", "bitwise_and") else (a or b)
    return None


#: the largest model (bytes of parameters) rebuilt for real to read a value a meta build lacks
REAL_REBUILD_MAX_BYTES = 4 << 30


def _set_model_frame_of() -> None:
    import sftctl.compiler.frontends.torch.branches as branches_module

    branches_module.model_frame_of = _model_frame_of


def _representative(params: list, buffers: list, batch: list, rebuild: Callable[[], tuple] | None = None,
                    names: tuple[list, list] = ([], [])) -> Representative:
    """The step's real inputs, in ``make_fx``'s placeholder order (parameters, AdamW's zero
    moments twice, buffers, the step, the batch), for :class:`.branches.Representative`. A tensor
    with no value (on ``meta``, or fake) takes its counterpart from ``rebuild()`` (the
    entrypoint built for real: ``(model, batch, loss_fn)``, called once, when first needed and
    when the parameters fit :data:`REAL_REBUILD_MAX_BYTES`), else None."""
    from torch._subclasses.fake_tensor import is_fake

    built: dict = {}

    def rebuilt():
        if "v" not in built:
            size = sum(p.numel() * p.element_size() for p in params)
            built["v"] = None
            if rebuild is not None and size <= REAL_REBUILD_MAX_BYTES:
                model, b, _ = rebuild()
                state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
                leaves = [x for x in pytree.tree_leaves(b) if isinstance(x, torch.Tensor)]
                built["v"] = (state, leaves)
        return built["v"]

    def missing(kind: str, key):
        def get():
            got = rebuilt()
            if got is None:
                return None
            state, leaves = got
            if kind == "batch":
                return leaves[key].detach() if key < len(leaves) else None
            t = state.get(key)
            return None if t is None else t.detach()
        return get

    def real(t, kind: str = "", key=None):
        if not isinstance(t, torch.Tensor) or is_fake(t) or t.device.type == "meta":
            return missing(kind, key) if kind else (lambda: None)
        return lambda: t.detach()

    def zeros(t):
        return lambda: torch.zeros(t.shape, dtype=t.dtype)

    pnames, bnames = names
    _set_model_frame_of()
    thunks = ([real(p, "state", n) for p, n in zip(params, pnames)] + [zeros(p) for p in params]
              + [zeros(p) for p in params] + [real(b, "state", n) for b, n in zip(buffers, bnames)]
              + [lambda: torch.ones((), dtype=torch.float32)] + [real(x, "batch", i) for i, x in enumerate(batch)])
    return Representative(thunks)


@contextlib.contextmanager
def _finite_checks_assumed(assumptions: list, rep: Representative | None = None):
    """A model's NaN / inf check (``if torch.isnan(h).any(): raise``, ``assert torch.isfinite(loss)``)
    asks for a tensor's value while tracing; the step is priced as it runs on finite data, so
    such a check takes the value it has there (no NaN, no inf) and the assumption, with the
    model's ``file:line``, is appended to ``assumptions``. Any other data-dependent ``bool`` takes
    its value on the representative batch (:func:`.branches.branch_value`, also recorded), and
    raises (named by :func:`_model_errors`) where it has none."""
    import sys
    import traceback

    from torch.fx.experimental.proxy_tensor import get_innermost_proxy_mode, get_proxy_slot

    orig = torch.Tensor.__bool__

    def as_bool(self):
        mode = get_innermost_proxy_mode()
        if mode is not None and self.numel() == 1:
            try:
                node = get_proxy_slot(self, mode.tracer).proxy.node
            except Exception:  # noqa: BLE001 - not a traced tensor: torch decides
                node = None
            verdict = _finite_check_verdict(node)
            if verdict is not None:
                at = _model_frame_of(traceback.extract_stack(sys._getframe(1))) or "the model"
                assumptions.append(f"finiteness check at {at}: taken as {verdict} (the step's values are finite)")
                return verdict
            if node is not None:
                taken = branch_value(rep, self, assumptions)
                if taken is not None:
                    return taken
        return orig(self)

    torch.Tensor.__bool__ = as_bool
    try:
        yield
    finally:
        torch.Tensor.__bool__ = orig


@contextlib.contextmanager
def _model_errors():
    """Turn a data-dependent branch met while tracing into a NotImplementedError that names the
    model's line that took it and what to try."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode,
            RuntimeError) as e:
        data_dependent = isinstance(e, (DataDependentOutputException, DynamicOutputShapeException,
                                        GuardOnDataDependentSymNode))
        if not data_dependent and "_local_scalar_dense" not in str(e):
            raise  # only real-mode make_fx's "value out of a tracing tensor" is a data-dependent branch
        what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        at = _model_frame(e.__traceback__)
        if "transformers" in at and ("moe" in at.lower() or "mixtral" in at.lower() or "expert" in at.lower()):
            raise NotImplementedError(
                f"torch frontend: the experts loop at {at} iterates over the experts the batch routes to "
                f"({type(e).__name__}: {what}), a count the trace cannot know; use transformers' grouped "
                "experts: config._experts_implementation = 'grouped_mm' (transformers 5's default) or "
                "'batched_mm', or from_pretrained(..., experts_implementation='grouped_mm')") from e
        raise NotImplementedError(
            f"torch frontend: the model's code at {_model_frame(e.__traceback__)} needs a tensor's value "
            f"while tracing ({type(e).__name__}: {what}); the step is traced without data, so Python "
            "control flow or shapes cannot depend on tensor values: compute it from the batch's shape, "
            "use torch.where instead of an if, or move it out of the step"
            + ("; with fake=False the model sees real tensors, so libraries that take another path when "
               "traced (transformers' masks) do not: trace with fake=True" if not data_dependent else "")
        ) from e


@contextlib.contextmanager
def _unbacked_frames(frames: dict):
    """Record, for each data-dependent size the trace creates (an unbacked symbol: a boolean-mask
    select, ``nonzero``, ``.item()``), the model's ``file:line`` that asked for it, in ``frames``
    (symbol -> line), so a bound or a refusal names it."""
    import sys
    import traceback

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    saved = {}

    def wrap(name):
        orig = getattr(ShapeEnv, name)

        def create(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            try:
                frame = _model_frame_of(traceback.extract_stack(sys._getframe(1)))
                frames[out.node.expr] = frame
            except Exception:  # noqa: BLE001 - a missing line never stops the trace
                pass
            return out
        saved[name] = orig
        setattr(ShapeEnv, name, create)

    for name in ("create_unbacked_symint", "create_unbacked_symfloat", "create_unbacked_symbool"):
        if hasattr(ShapeEnv, name):
            wrap(name)
    try:
        yield
    finally:
        for name, orig in saved.items():
            setattr(ShapeEnv, name, orig)


def _model_frame_of(frames) -> str | None:
    import os
    import sysconfig

    skip = tuple(os.path.dirname(m) + os.sep for m in (torch.__file__, __file__))
    skip += (os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)
    for f in reversed(frames):
        if not os.path.abspath(f.filename).startswith(skip):
            return f"{f.filename}:{f.lineno} ({f.name})"
    return None


@contextlib.contextmanager
def _plain_tensor_attributes(model: torch.nn.Module, to_input: Callable | None):
    """A model's plain tensor attributes (neither parameter nor buffer: a diffusion scheduler's
    ``alphas_cumprod``) are constants of the step. A real one is captured with its value; one on
    the ``meta`` device (the model was built there) is swapped for a fake CPU tensor of its shape
    and dtype while the step is traced (a constant input without a value), then put back."""
    saved = []
    if to_input is not None:
        for mod in model.modules():
            for name, t in list(vars(mod).items()):
                if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.device.type == "meta":
                    saved.append((mod, name, t))
                    object.__setattr__(mod, name, to_input(t))
    try:
        yield
    finally:
        for mod, name, t in saved:
            object.__setattr__(mod, name, t)


def trace_step(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    *,
    optimizer: str = "adamw",
    lr: float = 3e-4,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float | Callable[[str, torch.Tensor], float] = 0.01,
    grad_clip: float | None = None,
    fake: bool = True,
    autocast_dtype: str | torch.dtype | None = None,
    mask_fraction: float = 1.0,
    expert_capacity: float = 1.0,
    representative: Callable[[], tuple] | None = None,
) -> tuple[Graph, dict[str, Any]]:
    """Trace one training step of ``model`` on ``batch`` into an IR graph.

    Args:
        model: the module; its parameters may be real, fake or on the ``meta`` device (``meta``
            needs ``fake=True``).
        batch: any pytree of tensors (and constants) that ``loss_fn`` takes.
        loss_fn: ``loss_fn(model, batch) -> scalar``.
        optimizer: only ``"adamw"``.
        lr, betas, eps, weight_decay, grad_clip: AdamW hyperparameters (see the module docstring).
        fake: trace with fake tensors (no memory, no compute); False runs the step for real while
            tracing (small models; needed for tensor constants whose values the graph must hold).
        autocast_dtype: None, or ``bfloat16``/``float16`` to run the loss under ``torch.autocast``.
        mask_fraction: the fraction of a boolean mask's elements a data-dependent select
            (``x[mask]``, ``nonzero``) is priced at (1.0: all of them; see :mod:`.dynamic`).
        expert_capacity: an MoE dispatch's rows per expert as a multiple of the uniform top-k
            load (1.0; the number of experts makes any routing exact).
        representative: ``() -> (model, batch, loss_fn)`` built for real, for the values a
            data-dependent branch reads when ``model`` / ``batch`` are on ``meta``
            (:mod:`.branches`; ``trace_entrypoint`` passes its entrypoint).

    Returns:
        ``(graph, meta)``: ``meta`` has ``params`` / ``opt_state`` / ``buffers`` (name -> input node
        id), ``step`` (id), ``batch`` (ids, pytree order), ``batch_names``, ``param_names``,
        ``outputs`` (role -> index into ``graph.outputs``), ``n_params``, ``hyper``, ``fx_nodes``,
        ``trace_s``, ``lower_s``.

    Raises:
        NotImplementedError: an ATen op, dtype or form the lowering does not support (named).
        ValueError: an unknown optimizer, or meta tensors with ``fake=False``.
    """
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if optimizer != "adamw":
        raise ValueError(f"optimizer must be 'adamw', got {optimizer!r}")
    if isinstance(autocast_dtype, str):
        autocast_dtype = None if autocast_dtype == "float32" else getattr(torch, autocast_dtype)
    wrapper = _LossModule(model, loss_fn)
    named = list(wrapper.named_parameters())  # tied parameters once
    trainable = [(n, p) for n, p in named if p.requires_grad]
    frozen = [(n, p) for n, p in named if not p.requires_grad] + list(wrapper.named_buffers())
    pnames = [n[len("model."):] for n, _ in trainable]
    bnames = [n[len("model."):] for n, _ in frozen]
    decays = [float(weight_decay(n, p) if callable(weight_decay) else weight_decay)
              for n, (_, p) in zip(pnames, trainable)]
    leaves, spec = pytree.tree_flatten(batch)
    tpos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    batch_paths = [pytree.keystr(k) for k, _ in pytree.tree_flatten_with_path(batch)[0]]
    batch_names = ["batch" + batch_paths[i] for i in tpos]

    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        # allow_non_fake_inputs: a plain tensor attribute of the model (not a buffer: a diffusion
        # scheduler's alphas_cumprod) is a constant of the step; shape_env: data-dependent sizes
        # (nonzero, a boolean-mask select) become unbacked symbols, bounded in the lowering
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)

        def to_input(t: torch.Tensor) -> torch.Tensor:
            if is_fake(t) or t.device.type == "meta":
                with mode:
                    dev = "cpu" if t.device.type == "meta" else t.device
                    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev)
            return mode.from_tensor(t.detach())

        def zeros_like(t: torch.Tensor) -> torch.Tensor:
            return to_input(t)
    else:
        def to_input(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "meta":
                raise ValueError("meta tensors need fake=True")
            return t.detach().clone()

        def zeros_like(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(t.detach())

    p_in = [to_input(p).requires_grad_(True) for _, p in trainable]
    m_in = [zeros_like(p) for _, p in trainable]
    v_in = [zeros_like(p) for _, p in trainable]
    b_in = [to_input(b) for _, b in frozen]
    s_in = to_input(torch.ones((), dtype=torch.float32)) if fake else torch.ones((), dtype=torch.float32)
    # a batch leaf that requires grad keeps it (a physics-informed loss differentiates the model
    # with respect to its input coordinates: torch.autograd.grad(u, x, create_graph=True))
    x_in = [to_input(leaves[i]).requires_grad_(True) if leaves[i].requires_grad else to_input(leaves[i])
            for i in tpos]

    routes: list[_DecomposeSDPA] = []  # step_fn's attention router (the model's own calls, per call)
    rep = _representative([p for _, p in trainable], [b for _, b in frozen], [leaves[i] for i in tpos],
                          representative, (pnames, bnames))

    def step_fn(params, ms, vs, bufs, step, xs):
        # The joint graph, as AOTAutograd builds it: the forward runs under autograd on tensors
        # that require grad, torch.autograd.grad runs its backward, and make_fx records the ATen
        # ops of both below autograd. The model sees plain (fake) tensors, not functorch wrappers.
        vals = list(leaves)
        for i, x in zip(tpos, xs):
            vals[i] = x
        b = pytree.tree_unflatten(vals, spec)
        state = {**{"model." + n: t for n, t in zip(pnames, params)},
                 **{"model." + n: t for n, t in zip(bnames, bufs)}}
        ctx = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
        # The module holds the traced parameters through forward AND backward (functional_call's
        # swap would end with the forward), so activation checkpointing's recomputation in
        # backward (torch.utils.checkpoint, transformers' gradient_checkpointing) runs on them too.
        # Phases for the execution-mode predictions (sftctl.compiler.modes), as node.meta["custom"].
        route = _DecomposeSDPA(rep)
        routes.append(route)
        with _reparametrized(wrapper, state), route.patched():
            with torch.enable_grad(), ctx, route, fx_traceback.annotate({"phase": "forward"}):
                loss = wrapper(b)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                 + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
            if not loss.requires_grad and no_grad_checkpoints and params:
                raise NotImplementedError(
                    f"torch frontend: the loss has no gradient: torch.utils.checkpoint(..., use_reentrant=True) at "
                    f"{', '.join(dict.fromkeys(no_grad_checkpoints))} gets no input that requires grad, so torch runs "
                    "it without autograd (its parameters get no gradient; torch warns \"None of the inputs have "
                    "requires_grad=True\"); use checkpoint(..., use_reentrant=False), or checkpoint only "
                    "blocks whose input comes from a trainable layer")
            _tag_backward(loss)
            with fx_traceback.annotate({"phase": "backward"}):
                grads = list(torch.autograd.grad(loss, list(params), allow_unused=True)) if params else []
                grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        with torch.no_grad(), fx_traceback.annotate({"phase": "optimizer"}):
            new_p, new_m, new_v = _adamw([p.detach() for p in params], grads, ms, vs, step, lr=lr, betas=betas,
                                         eps=eps, decays=decays, grad_clip=grad_clip)
        return loss.detach(), new_p, new_m, new_v, list(bufs)

    frames: dict = {}
    no_grad_checkpoints: list[str] = []  # reentrant checkpoint calls with no input requiring grad
    assumptions: list[str] = []  # what the trace assumed where the model read a tensor's value
    t0 = time.perf_counter()
    # torch.backends.mkldnn off: nn.LSTM / GRU / RNN trace through ATen's native RNN (one input
    # projection GEMM over the sequence, then a recurrent GEMM and the gates per step: what cuDNN
    # runs on a GPU), not the CPU's fused oneDNN op
    with (sdpa_kernel(SDPBackend.MATH), _onednn_off(), tagged_rnns(), _model_errors(),
          _reentrant_checkpoint_as_non_reentrant(no_grad_checkpoints), grid_sample_decomposed(),
          _finite_checks_assumed(assumptions, rep), values_read(rep, assumptions),
          _module_stack_meta(wrapper), _plain_tensor_attributes(model, to_input if fake else None),
          _unbacked_frames(frames)):
        gm = make_fx(step_fn, decomposition_table=decomposition_table(),
                     tracing_mode="fake" if fake else "real")(p_in, m_in, v_in, b_in, s_in, x_in)
    _backward_module_stacks(gm)
    t1 = time.perf_counter()
    gm.graph.eliminate_dead_code()
    mutated = _mutated_inputs(gm, first=3 * len(pnames), count=len(bnames))
    n = len(pnames)
    roles = (
        [("param", nm) for nm in pnames] + [("opt_state", nm + ".exp_avg") for nm in pnames]
        + [("opt_state", nm + ".exp_avg_sq") for nm in pnames] + [("buffer", nm) for nm in bnames]
        + [("step", "step")] + [("batch", nm) for nm in batch_names]
    )
    out_roles = (["loss"] + [f"param:{nm}" for nm in pnames] + [f"opt_state:{nm}.exp_avg" for nm in pnames]
                 + [f"opt_state:{nm}.exp_avg_sq" for nm in pnames] + [f"buffer:{bnames[i]}" for i in mutated])
    keep = list(range(1 + 3 * len(pnames))) + [1 + 3 * len(pnames) + i for i in mutated]
    graph, input_ids = _Lowering(gm, mask_fraction=mask_fraction, expert_capacity=expert_capacity,
                                 frames=frames).run(roles, out_roles, keep_outputs=keep)
    hf_impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if isinstance(hf_impl, str):  # HF's attn_implementation: the kernel its attention calls run
        from sftctl.compiler.attention import HF_IMPLEMENTATIONS, with_implementation

        graph = with_implementation(graph, HF_IMPLEMENTATIONS.get(hf_impl, "auto"))
    if routes and routes[-1].impls:  # the model's own calls (flash_attn_func, xformers, flex_attention)
        from sftctl.compiler.attention import with_call_implementations

        graph = with_call_implementations(graph, routes[-1].impls)
    if routes and routes[-1].padding:  # SDPA calls given a boolean mask: does the batch pad?
        from sftctl.compiler.attention import PADDING_UNKNOWN, with_padding

        graph = with_padding(graph, routes[-1].padding)
        if "unknown" in routes[-1].padding.values():
            assumptions.append(PADDING_UNKNOWN)
    t2 = time.perf_counter()
    ids = dict(zip(range(len(roles)), input_ids))
    if assumptions:  # carried by the graph (traces are cached as graphs): sftctl compile's notes
        graph.nodes[ids[3 * n + len(bnames)]].attrs["trace_assumptions"] = tuple(dict.fromkeys(assumptions))
    meta: dict[str, Any] = {
        "params": {nm: ids[i] for i, nm in enumerate(pnames)},
        "opt_state": {**{nm + ".exp_avg": ids[n + i] for i, nm in enumerate(pnames)},
                      **{nm + ".exp_avg_sq": ids[2 * n + i] for i, nm in enumerate(pnames)}},
        "buffers": {nm: ids[3 * n + i] for i, nm in enumerate(bnames)},
        "step": ids[3 * n + len(bnames)],
        "batch": [ids[3 * n + len(bnames) + 1 + i] for i in range(len(batch_names))],
        "batch_names": batch_names,
        "param_names": pnames,
        "outputs": {r: i for i, r in enumerate(out_roles)},
        "n_params": sum(p.numel() for _, p in trainable),
        "hyper": {"optimizer": optimizer, "lr": lr, "betas": tuple(betas), "eps": eps,
                  "weight_decay": dict(zip(pnames, decays)), "grad_clip": grad_clip,
                  "autocast_dtype": str(autocast_dtype).replace("torch.", "") if autocast_dtype else None},
        "assumptions": list(dict.fromkeys(assumptions)),  # also on the step input: compile's notes
        "fx_nodes": len(gm.graph.nodes),
        "trace_s": t1 - t0,
        "lower_s": t2 - t1,
    }
    return graph, meta


@user_prints_to_stderr
def trace_entrypoint(entrypoint: str, workdir: str, batch_size: int, dtype: str = "float32", *,
                     fake: bool = True, mixed_precision: bool = True, **step_kwargs: Any) -> tuple[Graph, dict]:
    """Import ``file.py:function`` (relative to ``workdir``), build and trace its training step.

    ``function(batch_size=..., dtype=...)`` must return ``(model, example_batch, loss_fn)``. With
    ``mixed_precision`` (the default) and a ``dtype`` of bfloat16/float16 the model is built in
    float32 (master weights, as examples/gpt/train.py trains) and the loss traced under autocast to
    ``dtype``; with ``mixed_precision=False`` it is built in ``dtype`` and traced as is. With
    ``fake`` the build runs under ``torch.device("meta")`` (no parameter memory; falls back to a
    real build if the function cannot build on meta). ``step_kwargs`` go to :func:`trace_step`.
    """
    from sftctl.compiler.frontends import load_entrypoint

    fn = load_entrypoint(entrypoint, workdir)
    amp = mixed_precision and dtype != "float32"
    build_dtype = "float32" if amp else dtype
    built_on = "real"
    if fake:
        try:
            with torch.device("meta"):
                model, batch, loss_fn = fn(batch_size=batch_size, dtype=build_dtype)
            built_on = "meta"
        except Exception:  # noqa: BLE001 - any failure on meta: build for real
            model, batch, loss_fn = fn(batch_size=batch_size, dtype=build_dtype)
    else:
        model, batch, loss_fn = fn(batch_size=batch_size, dtype=build_dtype)
    graph, meta = trace_step(model, batch, loss_fn, fake=fake, autocast_dtype=dtype if amp else None,
                             representative=lambda: fn(batch_size=batch_size, dtype=build_dtype), **step_kwargs)
    meta.update(entrypoint=entrypoint, dtype=dtype, built_on=built_on,
                precision=f"autocast {dtype}, float32 master weights" if amp else dtype)
    return graph, meta
