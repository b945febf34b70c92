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
  ``where``; ``cast`` converts to the node's dtype, ``bitcast`` reinterprets an integer's bits as
  the node's dtype of the same width (``jax.random.uniform``'s mantissa trick); the bitwise ops
  and shifts are on unsigned or non-negative integers
* reductions: ``sum``, ``max``, ``min``, ``prod`` [axes: tuple[int], keepdim: bool]
* contraction: ``dot_general`` [lhs_batch, rhs_batch, lhs_contract, rhs_contract: tuple[int]];
  the result is batch dims, then lhs free dims, then rhs free dims (as ``jax.lax.dot_general``)
* convolution: ``conv`` [stride, padding: tuple of (low, high), lhs_dilation, rhs_dilation:
  one int per spatial dim; feature_group_count, batch_group_count] is XLA's
  ``conv_general_dilated`` in one fixed layout: lhs ``[N, C, *spatial]``, rhs
  ``[O, C / feature_group_count, *kernel]``, result ``[N / batch_group_count, O, *out]`` with
  ``out = (dilated_in + low + high - dilated_kernel) // stride + 1`` per spatial dim
  (``dilated_in = (in - 1) * lhs_dilation + 1``, ``dilated_kernel = (k - 1) * rhs_dilation + 1``);
  padding may be negative (cropping). ``feature_group_count = G`` splits C and O into G groups
  (grouped / depthwise convolution); ``batch_group_count = B`` splits the lhs's first dim and O
  into B groups (the weight gradient of a grouped convolution). At most one of them exceeds 1.
  Forward convolution, its input gradient (``lhs_dilation`` = the stride, flipped kernel) and
  its weight gradient (activations as lhs, output gradient as kernel) are all ``conv`` nodes.
* layout (no arithmetic): ``reshape`` [shape], ``transpose`` [perm], ``broadcast_in_dim``
  [shape, dims], ``slice`` [start, limit, step], ``concatenate`` [axis], ``pad`` [low, high, value],
  ``reverse`` [axes] (``np.flip`` over ``axes``)
* scan: ``cumsum`` [axis]: inclusive prefix sum along ``axis`` (``np.cumsum``)
* data movement: ``gather`` [axis] (operand 0 indexed by integer operand 1 along ``axis``,
  i.e. ``np.take``), ``scatter_add`` [axis, size] (adds operand 0 rows into a zero tensor of the
  node's shape at indices operand 1 along ``axis``: the transpose of ``gather``)
* attention (one fused kernel, as flash attention runs it; the S x S scores are never stored):

  - ``attention`` [causal, scale, dropout_p, rng]: operands ``q`` [B, Hq, L, D], ``k``
    [B, Hkv, S, D], ``v`` [B, Hkv, S, Dv] and optionally ``mask`` (4-D, broadcastable to
    [B, Hq, L, S]; bool: True attends, float: added to the scores). ``Hq`` is a multiple of
    ``Hkv`` (grouped-query attention: query head h reads kv head ``h // (Hq // Hkv)``). Result
    ``O = dropout(softmax(scale * q k^T + mask)) v``, [B, Hq, L, Dv]. ``causal`` keeps key j
    for query i when ``j <= i`` (top-left aligned, as ``is_causal`` in PyTorch). A row with no
    key kept gives 0. Dropout (``dropout_p`` > 0) drops probabilities with a keep-mask drawn
    from stream ``rng`` (see ``rng_bernoulli``) and scales the kept ones by ``1/(1-p)``.
  - ``attention_lse``: same operands and attributes; the row log-sum-exp of the masked, scaled
    scores (float32 [B, Hq, L]; ``+inf`` for a row with no key kept), which backward reads.
  - ``attention_grad`` [wrt: ``q`` | ``k`` | ``v``, and the forward's attributes]: operands
    ``q, k, v, o, do, lse`` and the forward's ``mask`` if it had one; the gradient of the
    forward's ``O`` with respect to ``wrt`` given ``dO`` (shape of that operand; ``dk``/``dv``
    sum over the query heads of a group).
* random: ``rng_bernoulli`` [p, rng]: a bool tensor of the node's shape, True with probability
  ``p`` independently per element, from random stream ``rng`` (an int unique in the graph) of
  the step's seed. Values are defined by the reference interpreter's generator (the IR fixes
  the distribution, not the bits a GPU's Philox would draw). ``rng_uniform`` [rng]: floats of the
  node's dtype, uniform on [0, 1), from stream ``rng`` (normal samples are built from two of them
  by the Box-Muller transform, integers by scaling and truncation).

Dtypes are the strings ``float64``, ``float32``, ``bfloat16``, ``float16``, ``int64``, ``int32``,
``int16``, ``int8``, ``uint8``, ``uint32`` (``torch.eye``'s index ranges, JAX's PRNG key words) and
``bool``. Integer arithmetic wraps as numpy's does in that dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

UNARY = frozenset({"neg", "exp", "log", "tanh", "rsqrt", "sqrt", "abs", "relu", "sigmoid", "erf",
                   "reciprocal", "sin", "cos", "logical_not", "cast", "sign", "log1p", "expm1", "floor",
                   "ceil", "round", "trunc", "atan", "bitcast"})
BINARY = frozenset({"add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le",
                    "gt", "ge", "logical_and", "logical_or", "bitwise_and", "bitwise_or", "bitwise_xor",
                    "shift_left", "shift_right_logical"})
ELEMENTWISE = UNARY | BINARY | {"where"}
REDUCTIONS = frozenset({"sum", "max", "min", "prod"})
CONTRACTIONS = frozenset({"dot_general", "conv"})
LAYOUT = frozenset({"reshape", "transpose", "broadcast_in_dim", "slice", "concatenate", "pad", "reverse"})
DATA = frozenset({"gather", "scatter_add"})
SOURCES = frozenset({"input", "constant", "iota"})
ATTENTION = frozenset({"attention", "attention_lse", "attention_grad"})
RANDOM = frozenset({"rng_bernoulli", "rng_uniform"})
SCANS = frozenset({"cumsum"})
ALL_OPS = ELEMENTWISE | REDUCTIONS | CONTRACTIONS | LAYOUT | DATA | SOURCES | ATTENTION | RANDOM | SCANS

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "uint32": 4, "bool": 1}


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

    def compact(self, keep_inputs: list[int]) -> tuple["Graph", list[int]]:
        """A copy without the nodes no output needs (``keep_inputs`` stay), renumbered.

        Returns the new graph and the new ids of ``keep_inputs``.
        """
        live = set(self.outputs) | set(keep_inputs)
        for node in reversed(self.nodes):
            if node.id in live:
                live.update(node.inputs)
        new = Graph()
        remap: dict[int, int] = {}
        for node in self.nodes:
            if node.id in live:
                remap[node.id] = new.add(node.op, [remap[i] for i in node.inputs], node.type.shape,
                                         node.type.dtype, **node.attrs)
        new.outputs = [remap[i] for i in self.outputs]
        new.output_roles = list(self.output_roles)
        return new, [remap[i] for i in keep_inputs]


FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")


def conv_output_spatial(in_spatial, kernel, stride, padding, lhs_dilation, rhs_dilation) -> tuple[int, ...]:
    """Output spatial sizes of a ``conv`` node (see the module docstring); all per spatial dim,
    ``padding`` as (low, high) pairs. Raises ValueError when a size would be below 1."""
    out = []
    for i, k, s, (lo, hi), ld, rd in zip(in_spatial, kernel, stride, padding, lhs_dilation, rhs_dilation):
        size = ((i - 1) * ld + 1 + lo + hi - ((k - 1) * rd + 1)) // s + 1
        if size < 1:
            raise ValueError(f"conv: output size {size} < 1 (input {i}, kernel {k}, stride {s}, padding {lo, hi})")
        out.append(size)
    return tuple(out)


def conv_lhs_touched(lhs_shape, rhs_shape, out_shape, attrs) -> int:
    """Elements of a ``conv`` node's lhs that some output reads: all of them unless the stride
    skips positions (a 1x1 convolution of stride 2 reads a quarter of its input)."""
    count = lhs_shape[0] * lhs_shape[1]
    for d, (size, k, o) in enumerate(zip(lhs_shape[2:], rhs_shape[2:], out_shape[2:])):
        st, rd, ld = attrs["stride"][d], attrs["rhs_dilation"][d], attrs["lhs_dilation"][d]
        lo = attrs["padding"][d][0]
        if st <= rd * (k - 1) + 1 and ld == 1:  # windows overlap or touch: every row is read
            count *= size
            continue
        hit = {(i * st + t * rd - lo) // ld for i in range(o) for t in range(k)
               if (i * st + t * rd - lo) % ld == 0 and 0 <= (i * st + t * rd - lo) // ld < size}
        count *= len(hit)
    return count


def conv_gemm_dims(lhs_shape, rhs_shape, out_shape, attrs) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of the implicit GEMM a ``conv`` node is: per group (batch = feature
    groups x batch groups), M = output rows x output positions, N = output features per group,
    K = input features per group x kernel taps. With ``lhs_dilation`` s > 1 (the input gradient
    of a strided convolution) only every s-th output position per dim receives a given tap, so
    M counts ``ceil(out / s)`` positions per dim: the work equals the forward convolution's, as
    cuDNN's strided dgrad does it, not the zeros a literal dilation would multiply."""
    g = int(attrs.get("feature_group_count", 1)) * int(attrs.get("batch_group_count", 1))
    m = out_shape[0] * math.prod(-(-o // ld) for o, ld in zip(out_shape[2:], attrs["lhs_dilation"]))
    n = out_shape[1] // g
    k = rhs_shape[1] * math.prod(rhs_shape[2:])
    return g, m, n, k


def row_major_strides(shape) -> list[int]:
    """Element strides of a contiguous row-major tensor of ``shape``."""
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return out[::-1]


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """numpy's broadcasting of shapes (trailing-aligned). Raises ValueError if incompatible."""
    ndim = max((len(s) for s in shapes), default=0)
    out = []
    for axis in range(-ndim, 0):
        sizes = {s[axis] for s in shapes if len(s) >= -axis} - {1}
        if len(sizes) > 1:
            raise ValueError(f"shapes {shapes} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


class GraphBuilder:
    """Builds a :class:`Graph` for a frontend: deduplicated constants, and no-op casts,
    reshapes and transposes elided (constants are re-made rather than reshaped or cast)."""

    def __init__(self) -> None:
        self.g = Graph()
        self._consts: dict[tuple, int] = {}

    def add(self, op: str, inputs, shape, dtype: str, /, **attrs: Any) -> int:
        return self.g.add(op, inputs, tuple(int(s) for s in shape), dtype, **attrs)

    def shape(self, i: int) -> tuple[int, ...]:
        return self.g.nodes[i].type.shape

    def dtype(self, i: int) -> str:
        return self.g.nodes[i].type.dtype

    def const(self, value, shape=(), dtype: str = "float32") -> int:
        """A scalar ``value`` broadcast to ``shape``. Raises NotImplementedError for a fractional
        value of an integer dtype."""
        if dtype == "bool":
            value = bool(value)
        elif dtype in FLOAT_DTYPES:
            value = float(value)
        else:
            if isinstance(value, float) and not value.is_integer():
                raise NotImplementedError(f"constant {value} for dtype {dtype}")
            value = int(value)
        key = (repr(value), tuple(shape), dtype)
        if key not in self._consts:
            self._consts[key] = self.add("constant", [], shape, dtype, value=value)
        return self._consts[key]

    def is_const(self, i: int, value) -> bool:
        n = self.g.nodes[i]
        return n.op == "constant" and n.attrs["value"] == value

    def cast(self, i: int, dtype: str) -> int:
        if self.dtype(i) == dtype:
            return i
        n = self.g.nodes[i]
        if n.op == "constant":
            return self.const(n.attrs["value"], n.type.shape, dtype)
        return self.add("cast", [i], self.shape(i), dtype)

    def reshape(self, i: int, shape) -> int:
        shape = tuple(int(s) for s in shape)
        if self.shape(i) == shape:
            return i
        n = self.g.nodes[i]
        if n.op == "constant":
            return self.const(n.attrs["value"], shape, n.type.dtype)
        return self.add("reshape", [i], shape, self.dtype(i), shape=shape)

    def transpose(self, i: int, perm) -> int:
        perm = tuple(int(p) for p in perm)
        if perm == tuple(range(len(perm))):
            return i
        return self.add("transpose", [i], tuple(self.shape(i)[p] for p in perm), self.dtype(i), perm=perm)

    def binary(self, op: str, a: int, b: int, dtype: str | None = None) -> int:
        return self.add(op, [a, b], broadcast_shapes(self.shape(a), self.shape(b)), dtype or self.dtype(a))

    def cumprod(self, x: int, axis: int, reverse: bool = False) -> int:
        """Inclusive cumulative product along ``axis`` from the IR's ``cumsum``:
        ``exp(cumsum(log|x|))`` times the parity of the negatives so far, 0 from the first 0 on
        (three scans and elementwise ops; relative error about n x 1e-16 x |log|x|| in float64).
        Raises NotImplementedError for a non-float ``x``."""
        shape, dtype = self.shape(x), self.dtype(x)
        if dtype not in FLOAT_DTYPES:
            raise NotImplementedError(f"cumprod of {dtype}")
        axis %= max(len(shape), 1)

        def scan(v):
            if reverse:
                v = self.add("reverse", [v], shape, dtype, axes=(axis,))
            v = self.add("cumsum", [v], shape, dtype, axis=axis)
            return self.add("reverse", [v], shape, dtype, axes=(axis,)) if reverse else v

        def c(v):
            return self.const(v, (), dtype)
        mag = self.add("exp", [scan(self.add("log", [self.add("abs", [x], shape, dtype)], shape, dtype))], shape, dtype)
        negs = scan(self.cast(self.add("lt", [x, c(0.0)], shape, "bool"), dtype))
        odd = self.add("sub", [negs, self.add("mul", [self.add("floor", [self.add("mul", [negs, c(0.5)], shape, dtype)],
                                                                shape, dtype), c(2.0)], shape, dtype)], shape, dtype)
        sign = self.add("sub", [c(1.0), self.add("mul", [odd, c(2.0)], shape, dtype)], shape, dtype)
        zeros = scan(self.cast(self.add("eq", [x, c(0.0)], shape, "bool"), dtype))
        seen = self.add("gt", [zeros, c(0.0)], shape, "bool")
        return self.add("where", [seen, c(0.0), self.add("mul", [sign, mag], shape, dtype)], shape, dtype)


#: the format name a serialized graph carries (:func:`to_json`)
JSON_FORMAT = "sftctl-ir/1"
#: how deep an attribute's lists may nest in a serialized graph (``padding``: a tuple of pairs)
MAX_ATTR_DEPTH = 4


def to_json(graph: Graph) -> str:
    """``graph`` as one JSON document: ``{"format", "nodes": [[op, inputs, shape, dtype, attrs]],
    "outputs", "output_roles"}`` (tuples as lists; floats as Python's json writes them, ``inf``
    as ``Infinity``). :func:`from_json` reads it back. A trace made in another process (a
    server's sandboxed trace of a user's model) travels this way: unlike pickle, reading it runs
    no code."""
    import json

    return json.dumps({"format": JSON_FORMAT,
                       "nodes": [[n.op, list(n.inputs), list(n.type.shape), n.type.dtype, n.attrs] for n in graph.nodes],
                       "outputs": list(graph.outputs), "output_roles": list(graph.output_roles)},
                      separators=(",", ":"))


def _attr(value: Any, where: str, depth: int = 0) -> Any:
    """An attribute value read back: a bool, int, float or string, or a list of them (nested at
    most :data:`MAX_ATTR_DEPTH` deep) as a tuple. Raises ValueError naming ``where``."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list) and depth < MAX_ATTR_DEPTH:
        return tuple(_attr(v, where, depth + 1) for v in value)
    raise ValueError(f"{where}: {type(value).__name__} is not an attribute value (a number, a string, or a list of them)")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def from_json(text: str | bytes) -> Graph:
    """The :class:`Graph` that :func:`to_json` wrote, checked as it is built: every op and dtype
    known, operands earlier nodes, shapes non-negative ints, attributes plain values (lists
    become tuples), outputs existing nodes with one role each.

    Raises:
        ValueError: the text is not such a document; the message names the first bad part
            (``node 12: unknown IR op 'foo'``).
    """
    import json

    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not a serialized graph: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != JSON_FORMAT:
        raise ValueError(f"not a serialized graph: format is not {JSON_FORMAT!r}")
    nodes, outputs, roles = doc.get("nodes"), doc.get("outputs"), doc.get("output_roles")
    if not isinstance(nodes, list) or not isinstance(outputs, list) or not isinstance(roles, list):
        raise ValueError("not a serialized graph: nodes, outputs and output_roles must be lists")
    graph = Graph()
    for i, node in enumerate(nodes):
        if not (isinstance(node, list) and len(node) == 5):
            raise ValueError(f"node {i}: not [op, inputs, shape, dtype, attrs]")
        op, inputs, shape, dtype, attrs = node
        if not isinstance(op, str) or not isinstance(dtype, str):
            raise ValueError(f"node {i}: op and dtype must be strings")
        if not (isinstance(inputs, list) and all(_int(x) for x in inputs)):
            raise ValueError(f"node {i} ({op}): inputs must be a list of node ids")
        if not (isinstance(shape, list) and all(_int(x) and x >= 0 for x in shape)):
            raise ValueError(f"node {i} ({op}): shape must be a list of non-negative integers")
        if not (isinstance(attrs, dict) and all(isinstance(k, str) for k in attrs)):
            raise ValueError(f"node {i} ({op}): attrs must be an object")
        values = {k: _attr(v, f"node {i} ({op}) attribute {k}") for k, v in attrs.items()}
        try:
            graph.add(op, inputs, shape, dtype, **values)
        except ValueError as e:
            raise ValueError(f"node {i}: {e}") from None
    if not all(_int(x) and 0 <= x < len(graph.nodes) for x in outputs):
        raise ValueError("outputs must be ids of the graph's nodes")
    if len(roles) != len(outputs) or not all(isinstance(r, str) for r in roles):
        raise ValueError("output_roles must be one string per output")
    graph.outputs, graph.output_roles = list(outputs), list(roles)
    return graph
