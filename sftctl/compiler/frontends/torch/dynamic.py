"""Data-dependent sizes in a traced step, bounded: ``logits[mask]``, PyG's ``out[train_mask]``,
``torch.nonzero`` / ``torch.where(mask)`` (MoE dispatch in the eager experts loop).

Under fake tensors such an op's size is an *unbacked* symbol (``u0``: make_fx's ShapeEnv). The IR
has static shapes, so each symbol gets a **bound**, the size the step is priced at:

* a boolean-mask select or ``nonzero`` of a mask with N elements: ``ceil(mask_fraction * N)``
  (``mask_fraction`` 1.0 by default: every element could be selected; a spec sets it with
  ``model.mask_fraction``);
* an MoE dispatch, a ``nonzero`` of one expert's slice ``expert_mask[e]`` of a one-hot routing
  tensor ``[E, k, T]`` (Mixtral's eager experts loop): ``ceil(k * T / E * expert_capacity)``,
  the uniform top-k load (``expert_capacity`` 1.0 by default; ``E`` makes it exact for any
  routing).

Every tensor whose shape holds a symbol is lowered at the bound with its valid entries first
(a select compacts the chosen rows to the front, by a prefix sum of the mask and a scatter of
positions) and padding after. Values stay exact: the symbol's runtime value (the mask's count, an
IR scalar) masks the padding out wherever entries of a tensor meet one another: reductions (sum
with 0, max with -inf, ...; ``mean`` divides by the count), contractions, prefix sums and
accumulating scatters; elementwise ops work row by row and never see another row. When the
count exceeds the bound (a ``mask_fraction`` or ``expert_capacity`` below what the data needs),
rows past the bound are dropped (as a capacity-factor MoE drops tokens): priced as assumed.

:class:`Bounds` finds the symbols and their bounds in an FX graph and rewrites each node's
``meta["val"]`` to its bounded static shape, keeping the symbolic one as ``meta["sym_shape"]``
(a tuple of ints and sympy expressions) for the masking.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

#: ATen packets whose result mixes entries of an operand: the operand's padding is replaced by
#: this fill first ("neutral": 0/False for sums, -inf for max, +inf for min, 1 for products)
MASK_FILL: dict[str, str] = {
    **dict.fromkeys(("sum", "mean", "any", "count_nonzero", "nansum", "mm", "bmm", "addmm", "baddbmm",
                     "dot", "mv", "addmv", "cumsum", "index_add", "scatter_add", "index_put", "_grouped_mm",
                     "var", "var_mean", "native_layer_norm", "std"), "zero"),
    **dict.fromkeys(("amax", "max", "argmax"), "low"),
    **dict.fromkeys(("amin", "min", "argmin"), "high"),
    **dict.fromkeys(("prod", "all"), "one"),
}


def _is_sym(s) -> bool:
    return isinstance(s, torch.SymInt) and not isinstance(s.node.maybe_as_int(), int)


def _expr(s):
    return s.node.expr if isinstance(s, torch.SymInt) else int(s)


class Bounds:
    """The unbacked symbols of an FX graph, their bounds, and where their values come from.

    ``bound[sym]``: the static size (int) the symbol is priced at; ``source[sym]``: ``(kind,
    mask node)`` with kind ``"mask"`` (the count of true / nonzero elements of the mask node's
    value). Raises ``NotImplementedError`` naming the op for a symbol of any other origin (a
    value read with ``.item()``)."""

    def __init__(self, gm: fx.GraphModule, mask_fraction: float = 1.0, expert_capacity: float = 1.0,
                 where=lambda n: "", frames: dict | None = None) -> None:
        self.frames = frames or {}
        self.bound: dict[Any, int] = {}
        self.source: dict[Any, tuple[str, fx.Node]] = {}
        self.assumptions: list[str] = []
        self.mask_fraction = float(mask_fraction)
        self.expert_capacity = float(expert_capacity)
        for n in gm.graph.nodes:
            for sym in (n.meta.get("unbacked_bindings") or {}):
                self._bind(n, sym, where)
        if not self.bound:
            for n in gm.graph.nodes:
                v = n.meta.get("val")
                if isinstance(v, torch.Tensor) and any(_is_sym(s) for s in v.shape):
                    self.static(v.shape)  # a size made from ``.item()``: refused, naming its line
            return
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                if any(_is_sym(s) for s in v.shape):
                    n.meta["sym_shape"] = tuple(_expr(s) for s in v.shape)
                    n.meta["val"] = torch.empty(self.static(v.shape), dtype=v.dtype, device="meta")
            elif isinstance(v, (tuple, list)) and any(isinstance(t, torch.Tensor) and any(_is_sym(s) for s in t.shape)
                                                      for t in v):
                n.meta["sym_shape"] = tuple(tuple(_expr(s) for s in t.shape) if isinstance(t, torch.Tensor) else None
                                            for t in v)
                n.meta["val"] = type(v)(torch.empty(self.static(t.shape), dtype=t.dtype, device="meta")
                                        if isinstance(t, torch.Tensor) else t for t in v)
            elif isinstance(v, torch.SymInt) and _is_sym(v):
                n.meta["sym_expr"] = _expr(v)
                if not (_expr(v).free_symbols & set(self.items())):  # an ``.item()`` value stays a value
                    n.meta["val"] = self.static_expr(_expr(v))

    def _bind(self, n: fx.Node, sym, where) -> None:
        if n.target is aten._local_scalar_dense.default:
            # ``.item()``: a value, not a size. It flows on as a 0-d IR tensor (``x / h.max().item()``,
            # a loss divided by ``mask.sum().item()``); used as a size, :meth:`static_expr` refuses it
            self.source[sym] = ("item", n)
            return
        mask = None
        if n.target is aten.nonzero.default or n.target is aten.nonzero_static.default:
            mask = n.args[0]
        elif n.target is aten.index.Tensor:
            bools = [t for t in n.args[1] if isinstance(t, fx.Node) and t.meta["val"].dtype == torch.bool]
            mask = bools[0] if len(bools) == 1 else None
        elif n.target is aten.masked_select.default:
            mask = n.args[1]
        at = self.frames.get(sym)
        at = f" at {at}" if at else ""
        if mask is None:
            raise NotImplementedError(
                f"torch frontend: ATen op {n.target}{at} has a size that depends on tensor values{where(n)}, "
                "which the tracer can bound only for a boolean-mask select or nonzero; compute it from "
                "the batch's shape, or use torch.where / masked_fill to keep the shape static")
        numel = math.prod(int(s) for s in mask.meta["val"].shape)
        experts = _expert_slices(mask)
        if experts:
            bound = max(1, math.ceil(numel / experts * self.expert_capacity))
            self.assumptions.append(
                f"MoE dispatch{at}: {bound} of {numel} routed slots per expert (uniform top-k load over "
                f"{experts} experts x expert_capacity {self.expert_capacity:g})")
        else:
            bound = max(1, math.ceil(numel * self.mask_fraction))
            self.assumptions.append(
                f"boolean-mask select{at}: {bound} of {numel} elements selected (mask_fraction "
                f"{self.mask_fraction:g})")
        self.bound[sym] = min(bound, numel)
        self.source[sym] = ("mask", mask)
        n.meta["sftctl_assumption"] = self.assumptions[-1]

    def items(self) -> list:
        """The symbols that are values read with ``.item()`` (no bound: values, not sizes)."""
        return [s for s, (kind, _) in self.source.items() if kind == "item"]

    def static_expr(self, expr) -> int:
        if isinstance(expr, int):
            return expr
        free = expr.free_symbols - set(self.bound)
        made = [str(self.frames[s]) for s in free & set(self.items()) if s in self.frames]
        if free & set(self.items()):
            at = f" at {', '.join(sorted(set(made)))}" if made else ""
            raise NotImplementedError(
                f"torch frontend: a tensor's size is computed from a value read with .item(){at}; the "
                "step's shapes cannot depend on tensor values: compute the size from the batch's shape, "
                "or keep the value a tensor (torch.where / masked_fill instead of slicing by it)")
        if free:
            raise NotImplementedError(f"torch frontend: size {expr} has symbols the tracer did not bound: {free}")
        return int(expr.xreplace({s: b for s, b in self.bound.items()}))

    def static(self, shape) -> tuple[int, ...]:
        return tuple(self.static_expr(_expr(s)) for s in shape)


def _expert_slices(mask: fx.Node) -> int:
    """E when ``mask`` is one expert's slice ``expert_mask[e]`` of a one-hot routing tensor (a
    ``select`` of dim 0 of an ``[E, ...]`` tensor made by comparing expert ids with a range, the
    decomposition of ``F.one_hot``, possibly permuted and squeezed); else 0."""
    node = mask
    for _ in range(6):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return 0
        if node.target in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.view.default,
                           aten.reshape.default, aten.clone.default, aten.alias.default):
            node = node.args[0]
            continue
        if node.target is aten.select.int and node.args[1] == 0:
            base = node.args[0]
            experts = int(base.meta["val"].shape[0])
            return experts if experts > 1 and _one_hot_origin(base) else 0
        return 0
    return 0


def _one_hot_origin(node: fx.Node) -> bool:
    for _ in range(8):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return False
        if node.target in (aten.eq.Tensor, aten.eq.Scalar):
            return True
        if node.target in (aten.permute.default, aten.transpose.int, aten._to_copy.default, aten.view.default,
                           aten.reshape.default, aten.clone.default, aten.alias.default, aten.unsqueeze.default,
                           aten.convert_element_type.default if hasattr(aten, "convert_element_type") else aten.alias.default):
            node = node.args[0]
            continue
        return False
    return False
