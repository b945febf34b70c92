"""The torch frontend's lowering driver: an ATen FX graph (from :mod:`.capture`) -> the IR.

:class:`_Lowering` walks the graph in order and looks each ``call_function`` node's ATen op packet
up in :data:`OPS`, the one op table (``"add"``, ``"convolution_backward"``, ...; the custom
attention ops as ``"sftctl::attention"``): an in-place packet (``add_``) uses its functional
packet's lowering and rebinds the mutated operand. The lowerings live by kind in
:mod:`sftctl.compiler.frontends.torch.lowerings` (elementwise, sources, reductions, linalg,
pooling, layout, indexing, random, attention), each a plain function
``fn(lowering, node, *node.args, **node.kwargs)`` registered with :func:`lowers`; it returns an IR
node id (an ``int``) or a list of them for a tuple-valued op. An op with no entry raises
``NotImplementedError`` naming the op, the module path and the model's file:line.
"""

from __future__ import annotations

import contextlib
import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from sftctl.compiler.ir import CONTRACTIONS, ELEMENTWISE, FLOAT_DTYPES, REDUCTIONS, Graph, GraphBuilder

_COMPUTE = CONTRACTIONS | ELEMENTWISE | REDUCTIONS

#: ATen op packet (``"sftctl::<name>"`` for the custom ops) -> lowering ``fn(lowering, node, *args, **kwargs)``
OPS: dict[str, Callable] = {}
#: view packet -> ``fn(lowering, view_node, base, new_view_value) -> new base value`` (IR ids):
#: how an in-place write into that view reaches its base (``copy_`` into a ``slice`` of an
#: ``empty``, as circular padding and autograd's strided backward write)
VIEW_WRITEBACK: dict[str, Callable] = {}


def lowers(fn_or_packet: Callable | str | None = None, *aliases: str):
    """Register a lowering in :data:`OPS`: ``@lowers`` under the function's name less ``op_``,
    ``@lowers("sftctl::attention")`` or ``@lowers("a", "b")`` under the packets named. Raises
    ``ValueError`` for a packet registered twice."""
    def register(fn: Callable, packets: tuple[str, ...]) -> Callable:
        for p in packets or (fn.__name__.removeprefix("op_"),):
            if p in OPS:
                raise ValueError(f"torch frontend: two lowerings for {p}")
            OPS[p] = fn
        return fn
    if callable(fn_or_packet):
        return register(fn_or_packet, ())
    packets = tuple(p for p in (fn_or_packet, *aliases) if p)
    return lambda fn: register(fn, packets)


_IR_DTYPES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
              torch.float16: "float16", torch.int64: "int64", torch.int32: "int32", torch.int16: "int16",
              torch.int8: "int8", torch.uint8: "uint8", torch.uint32: "uint32", torch.bool: "bool"}


#: a complex tensor is two real IR tensors of its shape (:class:`_Cplx`), of this dtype each
_COMPLEX_PARTS = {torch.complex64: "float32", torch.complex128: "float64"}


def ir_dtype(dtype: torch.dtype) -> str:
    """The IR dtype of a torch dtype; a complex dtype's is that of its real and imaginary parts."""
    try:
        return _IR_DTYPES[dtype] if dtype not in _COMPLEX_PARTS else _COMPLEX_PARTS[dtype]
    except KeyError:
        raise NotImplementedError(f"torch frontend: dtype {dtype} has no IR dtype") from None


def _norm_dims(dims, rank: int) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return tuple(range(rank))
    return tuple(sorted(d % rank if rank else 0 for d in dims))


def _stack_frame(stack_trace: str | None) -> str | None:
    """The innermost ``file:line`` of an fx node's recorded ``stack_trace`` outside torch."""
    import os
    import re

    if not stack_trace:
        return None
    tdir = os.path.dirname(torch.__file__) + os.sep
    found = None
    for m in re.finditer(r'File "([^"]+)", line (\d+), in (\S+)', stack_trace):
        if not m.group(1).startswith(tdir) and "sftctl/compiler/" not in m.group(1):
            found = f"{m.group(1)}:{m.group(2)} ({m.group(3)})"
    return found


class _Id(int):
    """An IR id passed where an fx node is expected (an operand already lowered)."""


class _Cplx(tuple):
    """A complex tensor's value: ``(real, imag)``, two IR ids of real tensors of its shape (the IR
    has no complex dtype; a GPU stores them interleaved, the same bytes). Lowerings of complex
    ops are in :data:`COMPLEX_OPS`; the ops in :data:`PARTWISE` apply to each part alone."""

    def __new__(cls, re: int, im: int):
        return super().__new__(cls, (int(re), int(im)))


#: ATen packet -> lowering ``fn(lowering, node, *args, **kwargs)`` used when an operand or the
#: result is complex (operands' values are :class:`_Cplx`; it returns one, or a real IR id)
COMPLEX_OPS: dict[str, Callable] = {}
#: ATen packets that are R-linear in their complex operands and take no other floating tensor
#: (layout, slicing, sums, scatters of complex into complex, scaling by a real scalar): the real
#: lowering applies to the real parts, then to the imaginary parts
PARTWISE: set[str] = set()


class _Lowering(GraphBuilder):
    """Lowers a make_fx ATen graph to an IR :class:`Graph`, one :data:`OPS` entry per ATen op packet."""

    def __init__(self, gm: fx.GraphModule, *, mask_fraction: float = 1.0, expert_capacity: float = 1.0,
                 frames: dict | None = None) -> None:
        super().__init__()
        self.gm = gm
        self.frames = frames or {}
        self.mask_fraction = mask_fraction
        self.expert_capacity = expert_capacity
        self.bounds: Any = None  # :class:`.dynamic.Bounds` once ``run`` starts
        self._sym_values: dict = {}
        self.env: dict[fx.Node, Any] = {}
        self._node: fx.Node | None = None
        self._rng = 1 << 20  # random streams of dropout ops (attention dropout uses its call number)
        self._solver_leads: set[int] = set()  # solver calls whose first compute node is tagged

    def bcast(self, i: int, shape) -> int:
        """numpy-style (trailing-aligned) explicit broadcast."""
        shape = tuple(int(s) for s in shape)
        src = self.shape(i)
        if src == shape:
            return i
        n = self.g.nodes[i]
        if n.op == "constant":
            return self.const(n.attrs["value"], shape, n.type.dtype)
        dims = tuple(range(len(shape) - len(src), len(shape)))
        return self.add("broadcast_in_dim", [i], shape, self.dtype(i), shape=shape, dims=dims)

    def iota(self, shape, axis: int, dtype: str = "int64") -> int:
        return self.add("iota", [], shape, dtype, axis=axis)

    def slice_dim(self, i: int, dim: int, start: int, stop: int, step: int = 1) -> int:
        shape = self.shape(i)
        if start == 0 and stop == shape[dim] and step == 1:
            return i
        starts = [0] * len(shape)
        limits = list(shape)
        steps = [1] * len(shape)
        starts[dim], limits[dim], steps[dim] = start, stop, step
        out = list(shape)
        out[dim] = len(range(start, stop, step))
        return self.add("slice", [i], out, self.dtype(i), start=tuple(starts), limit=tuple(limits),
                        step=tuple(steps))

    # --- fx helpers -------------------------------------------------------------------------------
    @staticmethod
    def val(n: fx.Node):
        v = n.meta.get("val")
        if v is None:
            raise NotImplementedError(f"torch frontend: fx node {n.name} has no meta['val']")
        return v

    def out(self) -> tuple[tuple[int, ...], str]:
        v = self.val(self._node)
        return tuple(int(s) for s in v.shape), ir_dtype(v.dtype)

    def arg(self, a, dtype: str | None = None) -> int:
        """An operand as an IR id: an fx node (cast to ``dtype``) or a Python scalar constant."""
        if isinstance(a, _Id):
            return self.cast(int(a), dtype) if dtype else int(a)
        if isinstance(a, fx.Node):
            i = self.env[a]
            if isinstance(i, _Cplx):
                raise NotImplementedError(f"torch frontend: complex value {a.name} used as a real tensor by "
                                          f"{getattr(self._node, 'target', '?')}")
            if not isinstance(i, int):
                raise NotImplementedError(f"torch frontend: tuple value {a.name} used as a tensor")
            return self.cast(i, dtype) if dtype else i
        if isinstance(a, (bool, int, float)):
            return self.const(a, (), dtype or ("bool" if isinstance(a, bool) else
                                               "int64" if isinstance(a, int) else "float32"))
        raise NotImplementedError(f"torch frontend: operand {a!r} of {self._node.target}")

    def _meta_of(self, a):
        if isinstance(a, _Id):
            return torch.empty((1,), dtype=getattr(torch, self.dtype(int(a))), device="meta")
        if isinstance(a, fx.Node):
            v = a.meta["val"]
            if isinstance(v, (torch.SymFloat, torch.SymInt, torch.SymBool)):  # a Python scalar's weak type
                return {torch.SymFloat: 1.0, torch.SymInt: 1, torch.SymBool: True}[type(v)]
            return torch.empty(() if v.dim() == 0 else (1,), dtype=v.dtype, device="meta")
        return a

    def promote(self, a, b) -> str:
        return ir_dtype(torch.result_type(self._meta_of(a), self._meta_of(b)))

    # --- driver -----------------------------------------------------------------------------------
    def run(self, roles: list[tuple[str, str]], out_roles: list[str],
            keep_outputs: list[int] | None = None) -> tuple[Graph, list[int]]:
        """Lower the graph; ``keep_outputs`` selects (by flat index) the outputs that ``out_roles``
        names (all of them by default)."""
        from sftctl.compiler.frontends.torch.dynamic import Bounds

        self.bounds = Bounds(self.gm, self.mask_fraction, self.expert_capacity, where=self.where, frames=self.frames)
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(roles):
            raise RuntimeError(f"traced graph has {len(placeholders)} inputs, expected {len(roles)}")
        input_ids = []
        for n, (role, name) in zip(placeholders, roles):
            v = self.val(n)
            shape = tuple(v.shape) + ((2,) if v.is_complex() else ())  # complex: view_as_real's layout
            i = self.add("input", [], shape, ir_dtype(v.dtype), role=role, name=name)
            self.env[n] = self.complex_split(i) if v.is_complex() else i
            input_ids.append(i)
        outputs: list[int] = []
        for n in self.gm.graph.nodes:
            self._node = n
            if n.op == "placeholder":
                continue
            if n.op == "get_attr":
                self.env[n] = self._tensor_constant(n)
            elif n.op == "call_function":
                first = len(self.g.nodes)
                self.env[n] = self._call(n)
                self._tag(n, first)
                if "sftctl_assumption" in n.meta and isinstance(self.env[n], int):
                    # a bounded data-dependent size: the compile report states what it was priced at
                    self.g.nodes[self.env[n]].attrs["assumption"] = n.meta["sftctl_assumption"]
            elif n.op == "output":
                flat = pytree.tree_leaves(n.args[0])
                if keep_outputs is not None:
                    flat = [flat[i] for i in keep_outputs]
                outputs = [self.complex_join(self.env[a]) if isinstance(self.env.get(a), _Cplx) else self.arg(a)
                           for a in flat]
            else:
                raise NotImplementedError(f"torch frontend: fx node kind {n.op} ({n.name})")
        if len(outputs) != len(out_roles):
            raise RuntimeError(f"traced step has {len(outputs)} outputs, expected {len(out_roles)}")
        self.g.outputs = outputs
        self.g.output_roles = list(out_roles)
        return self.g.compact(input_ids)

    def _tag(self, n: fx.Node, first: int) -> None:
        """Tag the IR nodes lowered from FX node ``n`` (ids ``first``..) with where they came from:
        ``aten`` (the ATen op eager PyTorch dispatches, before decomposition: ``native_layer_norm``,
        not its parts), ``call`` (one number per dispatched op instance: the FX nodes of one
        decomposed call share it), ``phase`` (forward, backward, optimizer) and ``module`` (the
        nn.Module path inside the model, from ``nn_module_stack``; a backward op has its forward
        op's; ``""`` for the root module and outside the model) and ``in_model`` (whether the op ran
        inside the model's forward, the root module's own ops included, or is the backward of one:
        what ``torch.compile(model)`` compiles). Untagged FX nodes (no preserved meta) leave the IR
        nodes untagged."""
        if first == len(self.g.nodes):
            return
        orig = n.meta.get("original_aten")
        custom = n.meta.get("custom") or {}
        if orig is None and not custom:
            return
        phase = "backward" if n.meta.get("autograd_backward") else custom.get("phase", "")
        stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack") or {}
        module = list(stack.values())[-1][0] if stack else ""
        module = "" if module == "model" else module.removeprefix("model.")
        target = orig if orig is not None else n.target
        aten = getattr(target, "_schema", None)
        aten = aten.name.split("::")[-1] if aten is not None else str(target)
        key = (aten, n.meta.get("seq_nr")) if orig is not None and orig is not n.target else n.name
        if key != getattr(self, "_call_key", None):
            self._call_key = key
            self._calls = getattr(self, "_calls", 0) + 1
        tags = {"aten": aten, "call": self._calls, "phase": phase, "module": module,
                "in_model": any(p == "model" or p.startswith("model.") for p in stack)}
        if custom.get("rnn"):  # a cuDNN RNN layer's op (.rnn): eager mode prices it fused
            tags["rnn"] = custom["rnn"]["id"]
        solver = custom.get("solver")
        if solver is not None:  # a dense linear algebra call (.solvers): priced as one cuSOLVER routine
            tags["solver"] = dict(solver)
        for i in range(first, len(self.g.nodes)):
            attrs = self.g.nodes[i].attrs
            for k, v in tags.items():
                attrs.setdefault(k, v)
            if solver is not None and solver["id"] not in self._solver_leads and self.g.nodes[i].op in _COMPUTE:
                # the call's first compute node carries its whole time (sftctl.compiler.linalg)
                self._solver_leads.add(solver["id"])
                attrs["solver"] = {**solver, "lead": True}

    def _tensor_constant(self, n: fx.Node) -> int:
        t = getattr(self.gm, n.target)
        if not isinstance(t, torch.Tensor):
            raise NotImplementedError(f"torch frontend: non-tensor attribute {n.target}")
        from torch._subclasses.fake_tensor import is_fake

        dtype = ir_dtype(t.dtype)
        if is_fake(t) and getattr(t, "constant", None) is not None:
            t = t.constant  # a fake tensor made from a real constant keeps it
        if is_fake(t) or t.device.type == "meta":
            # a plain tensor attribute of a model built on the meta device (a diffusion scheduler's
            # alphas_cumprod): priced as a constant input; the interpreter needs it fed
            return self.add("input", [], tuple(t.shape), dtype, role="constant", name=str(n.target))
        flat = t.detach().reshape(-1)
        if flat.numel() == 0 or bool((flat == flat[0]).all()):
            return self.const(flat[0].item() if flat.numel() else 0, tuple(t.shape), dtype)
        value = t.detach().cpu().to(torch.float64 if dtype in FLOAT_DTYPES else t.dtype).numpy()
        return self.add("input", [], tuple(t.shape), dtype, role="constant", name=str(n.target), value=value)

    def _call(self, n: fx.Node):
        target = n.target
        if target is operator.getitem:
            seq = self.env[n.args[0]]
            item = seq[n.args[1]]
            if item is None:
                raise NotImplementedError(f"torch frontend: output {n.args[1]} of {n.args[0].target} is not supported")
            return item
        if target is torch.ops.aten._local_scalar_dense.default:  # ``.item()``: the 0-d tensor, a value
            return self.reshape(self.arg(n.args[0]), ())
        if isinstance(n.meta.get("val"), torch.SymFloat):
            return self._scalar_op(n)
        if "sym_expr" in n.meta or isinstance(n.meta.get("val"), (torch.SymInt, torch.SymBool)):
            return self._sym_node(n)
        if not isinstance(target, torch._ops.OpOverload):
            raise NotImplementedError(f"torch frontend: unsupported call {target} ({n.name})")
        packet = target._schema.name.split("::")[-1]
        inplace = packet.endswith("_") and not packet.startswith("_") and target._schema.is_mutable
        handler = None
        if target.namespace == "aten":
            handler = OPS.get(packet[:-1] if inplace else packet)
            if handler is None and (packet[:-1] if inplace else packet) in COMPLEX_OPS:
                handler = COMPLEX_OPS[packet[:-1] if inplace else packet]
        elif target.namespace == "sftctl":
            handler = OPS.get("sftctl::" + packet)
        if handler is None:
            raise NotImplementedError(
                f"torch frontend: ATen op {target} has no IR lowering{self.where(n)}; try an equivalent "
                "written with supported ops, a different module or attn_implementation, or add a "
                "lowering op_" + packet + " (@lowers) to a module of sftctl/compiler/frontends/torch/lowerings/")
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        try:
            kwargs = dict(n.kwargs)
            dest = kwargs.pop("out", None) if target._overloadname.startswith("out") else None
            with self._padding_masked(n, packet[:-1] if inplace else packet):
                if self._complex_involved(n):
                    out = self._complex_call(n, packet[:-1] if inplace else packet, handler, kwargs)
                else:
                    out = handler(self, n, *n.args, **kwargs)
            if packet == "mean" and self.bounds and self.bounds.bound:
                out = self._mean_over_padding(n, out)
        except GuardOnDataDependentSymNode as e:
            import re

            frames = sorted({str(self.frames[s]) for s in self.frames if re.search(rf"\b{s}\b", str(e))})
            made = f", a size made at {', '.join(frames)}" if frames else ""
            raise NotImplementedError(
                f"torch frontend: ATen op {target} has a data-dependent size ({str(e).splitlines()[0]})"
                f"{self.where(n)}{made}; make the size static (torch.where / masked_fill instead of a "
                "boolean-mask select, a fixed expert capacity)") from None
        if isinstance(dest, fx.Node):  # an ``out=`` overload: the result lands in ``dest``
            self.env[dest] = out
            self._write_back(dest, out)
        if inplace and isinstance(n.args[0], fx.Node):
            # in-place op: later readers of the mutated tensor see the new value (views of it
            # taken before the mutation are not updated; make_fx graphs rarely have them), and
            # so does the base of a view in VIEW_WRITEBACK
            self.env[n.args[0]] = out
            self._write_back(n.args[0], out)
        return out

    def _write_back(self, view: fx.Node, new) -> None:
        """Carry an in-place write of ``new`` into ``view`` up its chain of aliases to their
        bases: a view in :data:`VIEW_WRITEBACK`, the result of an in-place op (its first
        operand) or of an ``out=`` overload (its ``out``), which are the tensor they wrote; a
        piece of ``split`` / ``chunk`` / ``unbind`` writes back into its slice of the base."""
        while new is not None and view.target is operator.getitem and isinstance(view.args[0], fx.Node) \
                and isinstance(self.env.get(view.args[0]), (list, tuple)) and not isinstance(new, _Cplx):
            src = view.args[0]
            new = self._write_back_piece(src, view.args[1], int(new))
            if new is None:
                return
            self.env[src.args[0]] = new
            view = src.args[0]
        while new is not None and isinstance(view.target, torch._ops.OpOverload) and view.target.namespace == "aten":
            packet = view.target._schema.name.split("::")[-1]
            if isinstance(view.kwargs.get("out"), fx.Node) and view.target._overloadname.startswith("out"):
                base = view.kwargs["out"]
            elif packet.endswith("_") and view.target._schema.is_mutable and view.args and isinstance(view.args[0], fx.Node):
                base = view.args[0]
            elif packet in VIEW_WRITEBACK and view.args and isinstance(view.args[0], fx.Node):
                base = view.args[0]
                old = self.env[base]
                if isinstance(new, _Cplx) or isinstance(old, _Cplx):  # each part through the view
                    old = old if isinstance(old, _Cplx) else _Cplx(old, self.const(0, self.shape(old), self.dtype(old)))
                    new = new if isinstance(new, _Cplx) else _Cplx(new, self.const(0, self.shape(new), self.dtype(new)))
                    new = _Cplx(*(VIEW_WRITEBACK[packet](self, view, old[p], new[p]) for p in (0, 1)))
                else:
                    new = _Id(VIEW_WRITEBACK[packet](self, view, self.arg(base), int(new)))
            else:
                returns = view.target._schema.returns
                if returns and returns[0].alias_info is not None and view.args and isinstance(view.args[0], fx.Node):
                    # a view whose base the write cannot reach: refused, never silently lost
                    self.unsupported(self._node, f"writing in place into a {packet} view of {view.args[0].name} "
                                                 "(no write-back through that view)")
                return
            self.env[base] = new
            view = base

    def _write_back_piece(self, src: fx.Node, k: int, new: int) -> int | None:
        """The base of ``split`` / ``split_with_sizes`` / ``unbind`` node ``src`` after an
        in-place write of ``new`` into its piece ``k`` (None for another op)."""
        if not isinstance(src.target, torch._ops.OpOverload) or not isinstance(src.args[0], fx.Node):
            return None
        packet = src.target._schema.name.split("::")[-1]
        base = self.env[src.args[0]]
        if not isinstance(base, int) or packet not in ("split", "split_with_sizes", "unbind"):
            return None
        shape = self.shape(base)
        dim = (src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", 0)) if packet != "unbind" else \
            (src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0))
        dim %= len(shape)
        if packet == "unbind":
            start, size = k, 1
            new = self.reshape(new, shape[:dim] + (1,) + shape[dim + 1:])
        elif packet == "split":
            start, size = k * int(src.args[1]), min(int(src.args[1]), shape[dim] - k * int(src.args[1]))
        else:
            sizes = [int(v) for v in src.args[1]]
            start, size = sum(sizes[:k]), sizes[k]
        low, high = [0] * len(shape), [0] * len(shape)
        low[dim], high[dim] = start, shape[dim] - start - size
        dt = self.dtype(base)
        padded = self.add("pad", [self.cast(new, dt)], shape, dt, low=tuple(low), high=tuple(high),
                          value=False if dt == "bool" else 0.0 if dt in FLOAT_DTYPES else 0)
        pos = self.iota(tuple(shape[d] if d == dim else 1 for d in range(len(shape))), dim, "int64")
        inside = self.binary("logical_and", self.binary("ge", pos, self.const(start, (), "int64"), "bool"),
                             self.binary("lt", pos, self.const(start + size, (), "int64"), "bool"), "bool")
        return self.add("where", [inside, padded, base], shape, dt)

    # --- complex tensors: (real, imag) pairs -------------------------------------------------------
    def complex_split(self, i: int) -> _Cplx:
        """A real IR tensor ``[..., 2]`` (``view_as_real``'s layout) as a complex value."""
        shape = self.shape(i)[:-1]
        parts = [self.reshape(self.slice_dim(i, len(shape), p, p + 1), shape) for p in (0, 1)]
        return _Cplx(*parts)

    def complex_join(self, c: _Cplx) -> int:
        """A complex value as one real IR tensor ``[..., 2]`` (``view_as_real``'s layout)."""
        shape = self.shape(c[0])
        parts = [self.reshape(p, shape + (1,)) for p in c]
        return self.add("concatenate", parts, shape + (2,), self.dtype(c[0]), axis=len(shape))

    def _complex_involved(self, n: fx.Node) -> bool:
        v = n.meta.get("val")
        vals = v if isinstance(v, (tuple, list)) else [v]
        if any(isinstance(t, torch.Tensor) and t.is_complex() for t in vals):
            return True
        return any(isinstance(self.env.get(a), _Cplx) for a in pytree.tree_leaves((n.args, n.kwargs))
                   if isinstance(a, fx.Node))

    def _complex_call(self, n: fx.Node, packet: str, handler: Callable, kwargs: dict):
        """Lower op ``n`` whose operands or result are complex: its :data:`COMPLEX_OPS` lowering, or
        for a :data:`PARTWISE` op the real lowering on the real parts, then on the imaginary ones
        (a real operand with a complex result is the real part, its imaginary part zero)."""
        if packet in COMPLEX_OPS:
            return COMPLEX_OPS[packet](self, n, *n.args, **kwargs)
        if packet not in PARTWISE:
            self.unsupported(n, "on complex tensors (no complex lowering; the IR holds a complex tensor as its "
                                "real and imaginary parts)")
        nodes = [a for a in pytree.tree_leaves((n.args, kwargs)) if isinstance(a, fx.Node)]
        saved = {a: self.env[a] for a in nodes if a in self.env}
        outs = []
        try:
            for p in (0, 1):
                for a in nodes:
                    c = saved.get(a)
                    if isinstance(c, _Cplx):
                        self.env[a] = c[p]
                    elif p == 1 and isinstance(c, int) and self.dtype(c) in FLOAT_DTYPES:
                        self.env[a] = self.const(0, self.shape(c), self.dtype(c))  # a real operand's imag
                outs.append(handler(self, n, *n.args, **kwargs))
        finally:
            self.env.update(saved)
        if isinstance(outs[0], (list, tuple)):
            return [None if r is None else _Cplx(r, i) for r, i in zip(*outs)]
        return _Cplx(*outs)

    # --- bounded data-dependent sizes (see .dynamic) --------------------------------------------
    def _sym_node(self, n: fx.Node):
        """A size-valued FX node (``sym_size``, arithmetic on sizes, a runtime assert): its
        runtime value as an int64 IR scalar; asserts and range constraints lower to nothing."""
        expr = n.meta.get("sym_expr")
        if expr is None:
            v = n.meta.get("val")
            if isinstance(v, torch.SymBool) or v is None:
                return None
            expr = v.node.expr
        return self.sym_value(expr)

    #: Python scalar arithmetic make_fx records on ``.item()`` values -> IR op
    _SCALAR_OPS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
                   operator.pow: "pow", operator.neg: "neg", math.sqrt: "sqrt", math.exp: "exp", math.log: "log"}

    def _scalar_op(self, n: fx.Node) -> int:
        """A float-valued scalar FX node (arithmetic on an ``.item()`` value: ``m + 1.0``,
        ``sym_float(n)``) as a float64 0-d IR tensor. Raises NotImplementedError for other calls."""
        target = n.target
        sqrt = getattr(torch, "_sym_sqrt", None)
        if target is torch.sym_float or getattr(target, "__name__", "") == "sym_float":
            return self.cast(self._scalar(n.args[0]), "float64")
        irop = self._SCALAR_OPS.get(target) or ("sqrt" if sqrt is not None and target is sqrt else None)
        if irop is None:
            raise NotImplementedError(f"torch frontend: scalar operation {target} on a value read with "
                                      f".item(){self.where(n)}; keep the value a tensor")
        return self.add(irop, [self.cast(self._scalar(a), "float64") for a in n.args], (), "float64")

    def _scalar(self, a) -> int:
        """An operand of a scalar FX node as a 0-d IR tensor."""
        if isinstance(a, fx.Node):
            i = self.env[a]
            return self.reshape(i, ()) if isinstance(i, int) else self.sym_value(a.meta["val"].node.expr)
        return self.const(a, (), "float64" if isinstance(a, float) else "int64")

    def sym_value(self, expr) -> int:
        """The runtime value of a size expression (ints, unbacked symbols, + and *) as an int64
        IR scalar: a symbol's value is the count of its mask's true elements, capped at its bound."""
        import sympy

        if isinstance(expr, int) or getattr(expr, "is_Integer", False):
            return self.const(int(expr), (), "int64")
        if expr in self._sym_values:
            return self._sym_values[expr]
        if isinstance(expr, sympy.Symbol):
            if self.bounds is None or expr not in self.bounds.source:
                raise NotImplementedError(f"torch frontend: size {expr} has no known origin")
            kind, mask = self.bounds.source[expr]
            if kind == "item":  # an integer read with ``.item()``: its value
                out = self.cast(self.reshape(self.env[mask], ()), "int64")
                self._sym_values[expr] = out
                return out
            m = self.env[mask]
            nz = self.cast(m, "bool") if self.dtype(m) != "bool" else m
            cnt = self.add("sum", [self.cast(nz, "int64")], (), "int64", axes=tuple(range(len(self.shape(m)))),
                           keepdim=False)
            out = self.binary("minimum", cnt, self.const(self.bounds.bound[expr], (), "int64"))
        elif isinstance(expr, (sympy.Add, sympy.Mul)):
            parts = [self.sym_value(a) for a in expr.args]
            out = parts[0]
            for p in parts[1:]:
                out = self.binary("add" if isinstance(expr, sympy.Add) else "mul", out, p)
        else:
            raise NotImplementedError(f"torch frontend: size expression {expr} is not supported")
        self._sym_values[expr] = out
        return out

    def valid_mask(self, node: fx.Node) -> int | None:
        """A bool IR tensor (broadcastable to ``node``'s bounded shape) that is True on the valid
        entries of a tensor whose shape holds data-dependent sizes (each such dim's first
        ``value`` entries), or None for a static shape."""
        sym = node.meta.get("sym_shape") if isinstance(node, fx.Node) else None
        if not sym or not all(isinstance(e, int) or hasattr(e, "free_symbols") for e in sym):
            return None
        shape = tuple(int(s) for s in self.val(node).shape)
        ok = None
        for d, e in enumerate(sym):
            if isinstance(e, int) or not e.free_symbols:
                continue
            ishape = tuple(shape[k] if k == d else 1 for k in range(len(shape)))
            lt = self.binary("lt", self.iota(ishape, d, "int64"), self.sym_value(e), "bool")
            ok = lt if ok is None else self.binary("logical_and", ok, lt, "bool")
        return ok

    def pad_fill(self, node: fx.Node, kind: str) -> int:
        """``node``'s IR value with its padding replaced by ``kind``'s neutral element."""
        from sftctl.compiler.ir import FLOAT_DTYPES

        i = self.env[node]
        ok = self.valid_mask(node)
        if ok is None:
            return i
        dt = self.dtype(i)
        value: bool | int | float
        if dt == "bool":
            value = kind in ("one",)
        elif kind == "zero":
            value = 0
        elif kind == "one":
            value = 1
        elif dt in FLOAT_DTYPES:
            value = float("-inf") if kind == "low" else float("inf")
        else:
            value = -(2 ** 62) if kind == "low" else 2 ** 62
        return self.add("where", [ok, i, self.const(value, (), dt)], self.shape(i), dt)

    def _mean_over_padding(self, n: fx.Node, out: int) -> int:
        """A ``mean`` over dims with padding summed the valid entries and divided by the bound's
        count: rescaled to divide by the runtime count."""
        x = n.args[0]
        sym = x.meta.get("sym_shape") if isinstance(x, fx.Node) else None
        if not sym:
            return out
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        axes = _norm_dims(dims, len(sym))
        static = [int(self.val(x).shape[d]) for d in axes]
        runtime = None
        for d in axes:
            v = self.sym_value(sym[d])
            runtime = v if runtime is None else self.binary("mul", runtime, v)
        dt = self.dtype(out)
        scale = self.binary("div", self.const(float(math.prod(static)), (), dt),
                            self.binary("maximum", self.cast(runtime, dt), self.const(1.0, (), dt)))
        return self.binary("mul", out, scale)

    @contextlib.contextmanager
    def _padding_masked(self, n: fx.Node, packet: str):
        """While op ``packet`` lowers: its tensor operands with padding (data-dependent sizes)
        are seen with the padding set to the op's neutral element (:data:`.dynamic.MASK_FILL`);
        a ``mean`` over padded dims is rescaled from the bound to the runtime count."""
        from sftctl.compiler.frontends.torch.dynamic import MASK_FILL

        kind = MASK_FILL.get(packet)
        if kind is None or not self.bounds or not self.bounds.bound:
            yield
            return
        saved = {}
        for a in list(n.args) + list(n.kwargs.values()):
            if isinstance(a, fx.Node) and a not in saved and a.meta.get("sym_shape") and isinstance(self.env.get(a), int):
                saved[a] = self.env[a]
                self.env[a] = self.pad_fill(a, kind)
        try:
            yield
        finally:
            self.env.update(saved)

    def unsupported(self, n: fx.Node, why: str = ""):
        raise NotImplementedError(f"torch frontend: ATen op {n.target} {why}".rstrip() + self.where(n))

    @staticmethod
    def where(n: fx.Node) -> str:
        """`` (in module <path> (<type>), at <file:line>)`` for an fx node, from make_fx's
        ``nn_module_stack`` and ``stack_trace``; empty when neither was recorded."""
        parts = []
        stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack") or {}
        if stack:
            path, typ = list(stack.values())[-1]
            typ = getattr(typ, "__name__", str(typ).rsplit(".", 1)[-1].rstrip("'>"))
            path = "" if path == "model" else path.removeprefix("model.")  # as model.named_modules() names it
            parts.append(f"in module {path} ({typ})" if path else f"in the model's own forward ({typ})")
        frame = _stack_frame(n.meta.get("stack_trace"))
        if frame:
            parts.append(f"at {frame}")
        return f" ({', '.join(parts)})" if parts else ""

    def out_at(self, k: int) -> tuple[tuple[int, ...], str]:
        v = self.val(self._node)
        v = v[k] if isinstance(v, (tuple, list)) else v
        return tuple(int(s) for s in v.shape), ir_dtype(v.dtype)
