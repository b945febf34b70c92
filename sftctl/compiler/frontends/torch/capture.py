"""Capture of one training step (forward, loss, backward, AdamW) as an ATen FX graph, and its lowering.

:func:`trace_step` runs the step under ``make_fx`` with :func:`decomposition_table` and hands the
graph to :class:`~.lowering._Lowering`; :func:`trace_entrypoint` does so for a spec's entrypoint.
See the package docstring (:mod:`sftctl.compiler.frontends.torch`) for the graph's inputs, outputs,
mixed precision and the model errors raised.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from sftctl.compiler.ir import Graph
from sftctl.compiler.frontends.torch.attention import _DecomposeSDPA
from sftctl.compiler.frontends.torch.lowering import _Lowering

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
        sq = [torch.sum(g.to(torch.float32) * g.to(torch.float32)) if g.dtype in (torch.bfloat16, torch.float16)
              else torch.sum(g * g) for g in grads]
        total = torch.sqrt(sum(sq[1:], sq[0]))
        coef = torch.clamp(grad_clip / (total + 1e-6), max=1.0)
        grads = [g * coef.to(g.dtype) for g in grads]
    bias1 = 1 - torch.pow(b1, step)
    bias2_sqrt = torch.sqrt(1 - torch.pow(b2, step))
    step_size = lr / bias1
    new_p, new_m, new_v = [], [], []
    for p, g, m, v, wd in zip(params, grads, ms, vs, decays):
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
    for n in gm.graph.nodes:
        if n.op == "call_function" and not n.meta.get("autograd_backward") and "seq_nr" in n.meta:
            if n.meta.get("nn_module_stack"):
                fwd.setdefault(n.meta["seq_nr"], n.meta["nn_module_stack"])
    for n in gm.graph.nodes:
        if n.meta.get("autograd_backward") and n.meta.get("seq_nr") in fwd:
            n.meta["fwd_nn_module_stack"] = fwd[n.meta["seq_nr"]]


class _ReentrantCheckpoint(RuntimeError):
    """Raised where the traced model calls reentrant activation checkpointing."""


@contextlib.contextmanager
def _refuse_reentrant_checkpoint():
    """``torch.utils.checkpoint``'s reentrant form (``CheckpointFunction``) raises
    :class:`_ReentrantCheckpoint` while the step is traced: it would run a backward of its own
    inside the forward on inputs that do not require grad, and fail later in the backward with
    autograd's "element 0 of tensors does not require grad", which blames nothing."""
    import torch.utils.checkpoint as ck

    def refuse(*args, **kwargs):
        raise _ReentrantCheckpoint("checkpoint(use_reentrant=True)")

    own = "apply" in ck.CheckpointFunction.__dict__
    saved = ck.CheckpointFunction.__dict__.get("apply")
    ck.CheckpointFunction.apply = refuse
    try:
        yield
    finally:
        if own:
            ck.CheckpointFunction.apply = saved
        else:
            del ck.CheckpointFunction.apply


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
        if isinstance(e, _ReentrantCheckpoint):
            raise NotImplementedError(
                f"torch frontend: torch.utils.checkpoint(..., use_reentrant=True) at {_model_frame(e.__traceback__)} "
                "cannot be traced: the reentrant form runs a backward of its own inside the forward, which "
                "the traced step's autograd cannot see; use checkpoint(..., use_reentrant=False) "
                "(what torch recommends; the same recomputation and memory)") from e
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
    x_in = [to_input(leaves[i]) for i in tpos]

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
        route = _DecomposeSDPA()
        with _reparametrized(wrapper, state), route.patched():
            with torch.enable_grad(), ctx, route, fx_traceback.annotate({"phase": "forward"}):
                loss = wrapper(b)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                 + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
            _tag_backward(loss)
            with fx_traceback.annotate({"phase": "backward"}):
                grads = list(torch.autograd.grad(loss, list(params), allow_unused=True)) if params else []
                grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        with torch.no_grad(), fx_traceback.annotate({"phase": "optimizer"}):
            new_p, new_m, new_v = _adamw([p.detach() for p in params], grads, ms, vs, step, lr=lr, betas=betas,
                                         eps=eps, decays=decays, grad_clip=grad_clip)
        return loss.detach(), new_p, new_m, new_v, list(bufs)

    frames: dict = {}
    t0 = time.perf_counter()
    # torch.backends.mkldnn off: nn.LSTM / GRU / RNN trace through ATen's native RNN (one input
    # projection GEMM over the sequence, then a recurrent GEMM and the gates per step: what cuDNN
    # runs on a GPU), not the CPU's fused oneDNN op
    with (sdpa_kernel(SDPBackend.MATH), _onednn_off(), _model_errors(),
          _refuse_reentrant_checkpoint(),
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
    t2 = time.perf_counter()
    ids = dict(zip(range(len(roles)), input_ids))
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
        "fx_nodes": len(gm.graph.nodes),
        "trace_s": t1 - t0,
        "lower_s": t2 - t1,
    }
    return graph, meta


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
                             **step_kwargs)
    meta.update(entrypoint=entrypoint, dtype=dtype, built_on=built_on,
                precision=f"autocast {dtype}, float32 master weights" if amp else dtype)
    return graph, meta
