"""The IR: a whole training step as one graph of tensor ops with shapes and dtypes.

A :class:`Graph` is a list of :class:`Node` in topological order. Each node produces one tensor
(``Node.type``); its operands are earlier nodes (``Node.inputs``, by id). The graph's sources are
``input`` nodes whose ``attrs["role"]`` says what they are (``param``, ``opt_state``, ``batch``,
``buffer``); its results are ``Graph.outputs`` (the loss first, then the updated parameters and
optimizer state, in the order of ``Graph.output_roles``).

Op vocabulary (``Node.op``; attribute names in brackets). Semantics follow numpy/XLA:

* sources: ``input`` [role, name], ``constant`` [value: scalar, broadcast to the node's shape],
  ``iota`` [axis]
* elementwise (numpy broadcasting of operands to the node's shape): see ``UNARY``, ``BINARY``,
  ``where``; ``cast`` converts to the node's dtype
* reductions: ``sum``, ``max``, ``min`` [axes: tuple[int], keepdim: bool]
* contraction: ``dot_general`` [lhs_batch, rhs_batch, lhs_contract, rhs_contract: tuple[int]];
  the result is batch dims, then lhs free dims, then rhs free dims (as ``jax.lax.dot_general``)
* layout (no arithmetic): ``reshape`` [shape], ``transpose`` [perm], ``broadcast_in_dim``
  [shape, dims], ``slice`` [start, limit, step], ``concatenate`` [axis], ``pad`` [low, high, value]
* data movement: ``gather`` [axis] (operand 0 indexed by integer operand 1 along ``axis``,
  i.e. ``np.take``), ``scatter_add`` [axis, size] (adds operand 0 rows into a zero tensor of the
  node's shape at indices operand 1 along ``axis``: the transpose of ``gather``)

Dtypes are the strings ``float64``, ``float32``, ``bfloat16``, ``float16``, ``int64``, ``int32``,
``bool``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

UNARY = frozenset({"neg", "exp", "log", "tanh", "rsqrt", "sqrt", "abs", "relu", "sigmoid", "erf",
                   "reciprocal", "sin", "cos", "logical_not", "cast", "sign", "log1p", "expm1"})
BINARY = frozenset({"add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le",
                    "gt", "ge", "logical_and", "logical_or"})
ELEMENTWISE = UNARY | BINARY | {"where"}
REDUCTIONS = frozenset({"sum", "max", "min"})
CONTRACTIONS = frozenset({"dot_general"})
LAYOUT = frozenset({"reshape", "transpose", "broadcast_in_dim", "slice", "concatenate", "pad"})
DATA = frozenset({"gather", "scatter_add"})
SOURCES = frozenset({"input", "constant", "iota"})
ALL_OPS = ELEMENTWISE | REDUCTIONS | CONTRACTIONS | LAYOUT | DATA | SOURCES

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1}


@dataclasses.dataclass(frozen=True)
class TensorType:
    """Shape (tuple of ints, () for a scalar) and dtype (one of ``DTYPE_BYTES``)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclasses.dataclass
class Node:
    """One op. ``id`` is its index in ``Graph.nodes``."""

    id: int
    op: str
    inputs: tuple[int, ...]
    type: TensorType
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Graph:
    """A whole step. ``outputs`` are node ids; ``output_roles`` name them (``loss``,
    ``param:<name>``, ``opt_state:<name>``)."""

    nodes: list[Node] = dataclasses.field(default_factory=list)
    outputs: list[int] = dataclasses.field(default_factory=list)
    output_roles: list[str] = dataclasses.field(default_factory=list)

    def add(self, op: str, inputs: Iterable[int], shape: Iterable[int], dtype: str, /, **attrs: Any) -> int:
        """Append a node and return its id (positional-only, so attrs may be named ``shape``).

        Raises ValueError for an unknown op or dtype, or an operand that is not an earlier node.
        """
        if op not in ALL_OPS:
            raise ValueError(f"unknown IR op {op!r}")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown IR dtype {dtype!r}")
        node = Node(len(self.nodes), op, tuple(inputs), TensorType(tuple(int(s) for s in shape), dtype), attrs)
        if any(i >= node.id or i < 0 for i in node.inputs):
            raise ValueError(f"{op}: operands must be earlier nodes")
        self.nodes.append(node)
        return node.id

    def inputs_with_role(self, role: str) -> list[Node]:
        return [n for n in self.nodes if n.op == "input" and n.attrs.get("role") == role]

    def users(self) -> list[list[int]]:
        """For each node id, the ids of the nodes that read it."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.id)
        return out

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts
