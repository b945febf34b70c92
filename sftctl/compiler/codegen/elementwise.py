"""Fused elementwise chains with broadcasting, generated into Triton source text.

A chain is a small SSA program over named inputs (:class:`Chain`)::

    Chain(inputs=("x", "b", "r"),
          ops=(("h", "add", "x", "b"),          # (destination, op, *arguments)
               ("g", "gelu_tanh", "h"),
               ("y", "add", "g", "r"),
               ("m", "gt", "h", 0.0)),
          outputs=("y", "m"))

Arguments are input names, earlier destinations, or Python constants (float/int/bool). Ops
(:data:`OPS`): ``add sub mul div maximum minimum neg abs exp log sqrt rsqrt tanh erf sigmoid relu
gelu`` (erf form) ``gelu_tanh silu``, comparisons ``lt le gt ge eq ne`` (boolean results),
``where(cond, a, b)`` and ``cast(x, dtype)`` (rounds to ``dtype``: ``("t", "cast", "x",
"bfloat16")`` reproduces an eager intermediate in bf16; a cast to an integer or ``bool`` type
converts). Floating inputs are computed in fp32; each output is stored in its dtype.

Code generation: :func:`generate_source` writes one ``@triton.jit`` kernel per (chain, rank,
broadcast pattern, input kinds); the text goes to ``<compiler cache>/codegen/src/ew_<sha>.py``
(``_runtime.generated_dir``), keyed by the SHA-256 of that description, and is imported from
there (``triton.jit`` needs a real source file). A program handles ``BLOCK`` consecutive elements
of the flattened output; each element's N-d coordinates are recovered from the (collapsed)
output shape and every operand is addressed through its own strides, stride 0 along broadcast
dims (those terms are left out of the generated source). Adjacent dims that are contiguous for
every operand are merged first, so same-shape contiguous operands run as a 1-D kernel.

Schedule: ``config = {"BLOCK": power of two, "num_warps": int}``; without one, the cost
model's best for the size and accelerator (:func:`search_config`); ``BLOCK`` is ``tl.constexpr``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Mapping, Sequence

from sftctl.compiler.codegen import _runtime as rt

__all__ = ["Chain", "OPS", "DEFAULT_CONFIG", "collapse_dims", "elementwise", "generate_source",
           "generated_kernel", "search_config"]

_UNARY = {
    "neg": "(-{0})", "abs": "tl.abs({0})", "exp": "tl.exp({0})", "log": "tl.log({0})",
    "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})", "tanh": "_tanh({0})", "erf": "tl.erf({0})",
    "sigmoid": "_sigmoid({0})", "relu": "tl.maximum({0}, 0.0)",
    "gelu": "(0.5 * {0} * (1.0 + tl.erf({0} * 0.7071067811865476)))",
    "gelu_tanh": "({0} * _sigmoid(1.5957691216057308 * ({0} + 0.044715 * {0} * {0} * {0})))",
    "silu": "({0} * _sigmoid({0}))",
}
_BINARY = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
    "maximum": "tl.maximum({0}, {1})", "minimum": "tl.minimum({0}, {1})",
    "lt": "({0} < {1})", "le": "({0} <= {1})", "gt": "({0} > {1})", "ge": "({0} >= {1})",
    "eq": "({0} == {1})", "ne": "({0} != {1})",
}
#: op name -> number of tensor/constant arguments (``cast`` also takes a dtype name).
OPS = {**{k: 1 for k in _UNARY}, **{k: 2 for k in _BINARY}, "where": 3, "cast": 1}

DEFAULT_CONFIG = {"BLOCK": 1024, "num_warps": 4}

_FLOAT_NAMES = ("float32", "float16", "bfloat16", "float64")


@dataclasses.dataclass(frozen=True)
class Chain:
    """An elementwise program: ``inputs`` (names), ``ops`` (``(dst, op, *args)`` tuples),
    ``outputs`` (names of inputs or destinations).

    Raises (on construction):
        ValueError: unknown op, wrong arity, a name used before it is defined, a redefined name,
            an undefined output, or a bad cast dtype.
    """

    inputs: tuple[str, ...]
    ops: tuple[tuple, ...]
    outputs: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "ops", tuple(tuple(op) for op in self.ops))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        defined = set()
        for name in self.inputs:
            if not isinstance(name, str) or not name.isidentifier() or name in defined:
                raise ValueError(f"chain: bad or repeated input name {name!r}")
            defined.add(name)
        for op in self.ops:
            if len(op) < 2:
                raise ValueError(f"chain: an op is (dst, op, *args), got {op!r}")
            dst, kind, *args = op
            if kind not in OPS:
                raise ValueError(f"chain: unknown op {kind!r}; known: {sorted(OPS)}")
            want = OPS[kind] + (1 if kind == "cast" else 0)
            if len(args) != want:
                raise ValueError(f"chain: {kind} takes {want} arguments, got {len(args)} in {op!r}")
            if kind == "cast":
                rt.dtype_name(args[1])
                args = args[:1]
            for a in args:
                if isinstance(a, str) and a not in defined:
                    raise ValueError(f"chain: {a!r} used before it is defined in {op!r}")
                if not isinstance(a, (str, bool, int, float)):
                    raise ValueError(f"chain: argument {a!r} must be a name or a number")
            if not isinstance(dst, str) or not dst.isidentifier() or dst in defined:
                raise ValueError(f"chain: bad or repeated destination {dst!r}")
            defined.add(dst)
        if not self.outputs:
            raise ValueError("chain: no outputs")
        for o in self.outputs:
            if o not in defined:
                raise ValueError(f"chain: output {o!r} is never defined")

    def to_json(self) -> str:
        return json.dumps({"inputs": self.inputs, "ops": self.ops, "outputs": self.outputs},
                          sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Chain":
        return cls(tuple(d["inputs"]), tuple(tuple(op) for op in d["ops"]), tuple(d["outputs"]))


def _literal(v) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, int):
        return str(v)
    f = float(v)
    if math.isnan(f):
        return 'float("nan")'
    if math.isinf(f):
        return 'float("inf")' if f > 0 else 'float("-inf")'
    return repr(f)


def _kind(dtype) -> str:
    """``float`` / ``bool`` / ``int`` of a dtype."""
    name = rt.dtype_name(dtype)
    return "float" if name in _FLOAT_NAMES else ("bool" if name == "bool" else "int")


def generate_source(chain: Chain, rank: int, zero_strides: frozenset = frozenset(),
                    input_kinds: Sequence[str] | None = None) -> str:
    """The Triton source of ``chain`` over a rank-``rank`` output.

    ``zero_strides``: ``(operand index, dim)`` pairs whose stride is 0 (broadcast); operands are
    numbered inputs first, then outputs. ``input_kinds``: ``float``/``bool``/``int`` per input
    (floats are upcast to fp32 on load). The kernel is named ``ew_kernel`` with arguments
    ``in0.., out0.., n_elements, size1..size{rank-1}, s{operand}_{dim}.., BLOCK``.
    """
    n_in, n_out = len(chain.inputs), len(chain.outputs)
    kinds = list(input_kinds) if input_kinds is not None else ["float"] * n_in
    names = [f"in{i}" for i in range(n_in)] + [f"out{j}" for j in range(n_out)]
    strides = [f"s{o}_{d}" for o in range(n_in + n_out) for d in range(rank)]
    sizes = [f"size{d}" for d in range(1, rank)]
    lines = [
        "# Generated by sftctl.compiler.codegen.elementwise; do not edit.",
        f"# chain: {chain.to_json()}",
        f"# rank: {rank}; zero strides: {sorted(zero_strides)}; input kinds: {kinds}",
        "import triton",
        "import triton.language as tl",
        "",
        "",
        "@triton.jit",
        "def _sigmoid(x):",
        "    return 1.0 / (1.0 + tl.exp(-x))",
        "",
        "",
        "@triton.jit",
        "def _tanh(x):",
        "    # tanh(|x|) = (1 - e^-2|x|) / (1 + e^-2|x|); odd Taylor series near 0 (no cancellation)",
        "    ax = tl.abs(x)",
        "    e = tl.exp(-2.0 * ax)",
        "    big = (1.0 - e) / (1.0 + e)",
        "    x2 = ax * ax",
        "    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 - x2 * 0.05396825396825397)))",
        "    t = tl.where(ax < 0.0625, small, big)",
        "    return tl.where(x < 0, -t, t)",
        "",
        "",
        "@triton.jit",
        f"def ew_kernel({', '.join(names + ['n_elements'] + sizes + strides)}, BLOCK: tl.constexpr):",
        "    pid = tl.program_id(0).to(tl.int64)",
        "    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)",
        "    mask = offs < n_elements",
    ]
    if rank == 1:
        lines.append("    c0 = offs")
    else:
        lines.append("    rem = offs")
        for d in range(rank - 1, 0, -1):
            lines.append(f"    c{d} = rem % size{d}")
            lines.append(f"    rem = rem // size{d}")
        lines.append("    c0 = rem")

    def offset(o: int) -> str:
        terms = [f"c{d} * s{o}_{d}" for d in range(rank) if (o, d) not in zero_strides or o >= n_in]
        return " + ".join(terms) if terms else "offs * 0"  # a broadcast scalar, as a block

    env = {}
    for i, name in enumerate(chain.inputs):
        var = f"v_{name}"
        load = f"tl.load(in{i} + {offset(i)}, mask=mask, other=0)"
        if kinds[i] == "float":
            load += ".to(tl.float32)"
        lines.append(f"    {var} = {load}")
        env[name] = var

    def arg(a) -> str:
        return env[a] if isinstance(a, str) else _literal(a)

    for dst, kind, *args in chain.ops:
        var = f"v_{dst}"
        if kind == "cast":
            dt = rt.dtype_name(args[1])
            ty = "tl.int1" if dt == "bool" else f"tl.{dt}"
            src = arg(args[0])
            if dt == "bool":
                expr = f"({src} != 0)"
            elif dt in ("float16", "bfloat16"):
                expr = f"{src}.to({ty}).to(tl.float32)"
            else:
                expr = f"{src}.to({ty})"
        elif kind == "where":
            expr = f"tl.where({arg(args[0])} != 0, {arg(args[1])}, {arg(args[2])})"
        elif kind in _UNARY:
            expr = _UNARY[kind].format(arg(args[0]))
        else:
            expr = _BINARY[kind].format(arg(args[0]), arg(args[1]))
        lines.append(f"    {var} = {expr}")
        env[dst] = var
    for j, name in enumerate(chain.outputs):
        o = n_in + j
        lines.append(f"    tl.store(out{j} + {offset(o)}, {env[name]}.to(out{j}.dtype.element_ty), mask=mask)")
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class GeneratedKernel:
    """A generated elementwise kernel: its source file, cache key and argument names."""

    path: str
    key: str
    rank: int
    arg_names: tuple[str, ...]

    def kernel(self, interpret: bool):
        """The ``ew_kernel`` function (JITFunction, or InterpretedFunction if ``interpret``)."""
        return rt.kernel_module(self.path, interpret).ew_kernel


def generated_kernel(chain: Chain, rank: int, zero_strides: frozenset = frozenset(),
                     input_kinds: Sequence[str] | None = None) -> GeneratedKernel:
    """Generate (or find in the cache) the source of ``chain`` and return its handle."""
    kinds = tuple(input_kinds) if input_kinds is not None else ("float",) * len(chain.inputs)
    desc = json.dumps({"chain": json.loads(chain.to_json()), "rank": rank,
                       "zero": sorted(map(list, zero_strides)), "kinds": kinds}, sort_keys=True)
    key = hashlib.sha256(desc.encode()).hexdigest()[:24]
    path = rt.generated_dir() / f"ew_{key}.py"
    rt.write_source(path, generate_source(chain, rank, frozenset(zero_strides), kinds))
    n_ops = len(chain.inputs) + len(chain.outputs)
    names = ([f"in{i}" for i in range(len(chain.inputs))] + [f"out{j}" for j in range(len(chain.outputs))]
             + ["n_elements"] + [f"size{d}" for d in range(1, rank)]
             + [f"s{o}_{d}" for o in range(n_ops) for d in range(rank)] + ["BLOCK"])
    return GeneratedKernel(str(path), key, rank, tuple(names))


def collapse_dims(shape: Sequence[int], strides: Sequence[Sequence[int]]):
    """Merge dims that every operand walks contiguously; drop size-1 dims.

    ``strides``: per operand, its strides over ``shape`` (0 on broadcast dims). Returns
    ``(shape', strides')`` of rank >= 1 addressing the same elements.
    """
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    if not dims:
        return (1,), [(0,) for _ in strides]
    new_shape = [shape[dims[0]]]
    new_strides = [[s[dims[0]]] for s in strides]
    for d in dims[1:]:
        if all(ns[-1] == s[d] * shape[d] for ns, s in zip(new_strides, strides)):
            new_shape[-1] *= shape[d]
            for ns, s in zip(new_strides, strides):
                ns[-1] = s[d]
        else:
            new_shape.append(shape[d])
            for ns, s in zip(new_strides, strides):
                ns.append(s[d])
    return tuple(new_shape), [tuple(ns) for ns in new_strides]


def search_config(chain: Chain, numel: int, bytes_per_operand: Sequence[int], like=None, target=None) -> dict:
    """The ``{"BLOCK", "num_warps"}`` the cost model predicts fastest for ``chain`` over
    ``numel`` elements (``search.stream.search_elementwise_config``) on ``target`` (a
    :class:`sftctl.compiler.target.Target`; default: the accelerator of tensor ``like``). ``bytes_per_operand``: DRAM bytes per element of each
    operand (0 for a broadcast input, read from cache). Instructions per element: 4 plus 3 per
    op of the chain (address math, loads and stores; a transcendental op counts as 3)."""
    from sftctl.compiler.search import stream

    target = target if target is not None else stream.target_for_tensor(like)
    best, _ = stream.search_elementwise_config(numel, target.hw, target.coeffs, bytes_per_element=float(max(sum(bytes_per_operand), 1)),
                                               instr_per_element=4.0 + 3.0 * len(chain.ops))
    return best


def elementwise(chain: Chain | Mapping, inputs: Mapping | Sequence, *, out_dtypes=None, out=None,
                config: dict | None = None):
    """Run ``chain`` over broadcast ``inputs`` in one kernel.

    Args:
        chain: a :class:`Chain` (or its dict form).
        inputs: tensors by input name, or a sequence in ``chain.inputs`` order; they broadcast
            (torch rules) to the output shape; any strides.
        out_dtypes: one dtype or a sequence per output; default the promoted dtype of the
            floating inputs (``torch.promote_types``), float32 when there are none.
        out: optional preallocated output tensor(s) (any strides, the broadcast shape).
        config: ``{"BLOCK", "num_warps"}`` (missing keys from :data:`DEFAULT_CONFIG`); None:
            searched with the cost model (:func:`search_config`).

    Returns:
        One tensor for a one-output chain, else a tuple in ``chain.outputs`` order.

    Raises:
        ValueError: missing/extra inputs, shapes that do not broadcast, bad ``out``, bad config,
            inputs on different devices.
        TypeError: an unsupported dtype.
    """
    import torch

    if not isinstance(chain, Chain):
        chain = Chain.from_dict(chain)
    if isinstance(inputs, Mapping):
        missing = set(chain.inputs) - set(inputs)
        extra = set(inputs) - set(chain.inputs)
        if missing or extra:
            raise ValueError(f"elementwise: missing inputs {sorted(missing)}, unexpected {sorted(extra)}")
        tensors = [inputs[n] for n in chain.inputs]
    else:
        tensors = list(inputs)
        if len(tensors) != len(chain.inputs):
            raise ValueError(f"elementwise: {len(chain.inputs)} inputs expected, got {len(tensors)}")
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    if set(cfg) != set(DEFAULT_CONFIG) or not rt.is_power_of_2(cfg["BLOCK"]) or not rt.is_power_of_2(cfg["num_warps"]):
        raise ValueError(f"elementwise: bad config {config!r} (keys BLOCK, num_warps: powers of two)")
    searched = not config
    rt.check_device(*tensors)
    try:
        shape = tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
    except RuntimeError as e:
        raise ValueError(f"elementwise: inputs do not broadcast: {e}") from None
    n_out = len(chain.outputs)
    if out_dtypes is None or not isinstance(out_dtypes, (list, tuple)):
        if out_dtypes is None:
            floats = [t.dtype for t in tensors if t.dtype.is_floating_point]
            dt = floats[0] if floats else torch.float32
            for f in floats[1:]:
                dt = torch.promote_types(dt, f)
        else:
            dt = rt.torch_dtype(out_dtypes)
        out_dtypes = [dt] * n_out
    out_dtypes = [rt.torch_dtype(d) for d in out_dtypes]
    if len(out_dtypes) != n_out:
        raise ValueError(f"elementwise: {n_out} output dtypes expected")
    device = tensors[0].device
    if out is None:
        outs = [torch.empty(shape, dtype=d, device=device) for d in out_dtypes]
    else:
        outs = [out] if not isinstance(out, (list, tuple)) else list(out)
        if len(outs) != n_out or any(tuple(o.shape) != shape for o in outs):
            raise ValueError(f"elementwise: out must be {n_out} tensor(s) of shape {shape}")
    numel = math.prod(shape)
    if numel == 0:
        return outs[0] if n_out == 1 else tuple(outs)
    operands = [t.expand(shape) for t in tensors] + outs
    for t in tensors:
        rt.dtype_name(t.dtype)
    full_strides = [tuple(t.stride()) if len(shape) else () for t in operands]
    cshape, cstrides = collapse_dims(shape if shape else (1,), full_strides if shape else [(0,)] * len(operands))
    rank = len(cshape)
    zero = frozenset((o, d) for o, s in enumerate(cstrides) for d in range(rank) if s[d] == 0 and cshape[d] != 1)
    zero |= frozenset((o, d) for o in range(len(operands)) for d in range(rank) if cshape[d] == 1)
    kinds = [_kind(t.dtype) for t in tensors]
    gk = generated_kernel(chain, rank, zero, kinds)
    kern = gk.kernel(rt.use_interpreter(*tensors))
    args = [*[t.expand(shape) for t in tensors], *outs, numel, *cshape[1:],
            *[s for st in cstrides for s in st]]
    if searched:  # no schedule given: the cost model's best for this size and accelerator
        cfg = search_config(chain, numel, [t.element_size() * (t.numel() == numel) for t in tensors]
                            + [o.element_size() for o in outs], tensors[0] if tensors else outs[0])
    grid = (math.ceil(numel / cfg["BLOCK"]),)
    kern[grid](*args, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
    return outs[0] if n_out == 1 else tuple(outs)
