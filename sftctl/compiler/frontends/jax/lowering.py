"""The JAX frontend's lowering driver: a jaxpr (``jax.make_jaxpr``'s) to the IR, equation by
equation through :data:`_PRIMS`, the one primitive table of this frontend (as
``frontends/torch/lowering.py``'s ``OPS`` is the torch frontend's). The rules live by kind in
:mod:`sftctl.compiler.frontends.jax.lowerings` (elementwise, reductions, layout, linalg,
pooling, indexing, control_flow, random) and register with ``@_prim``; call-like primitives
(inlined) and the attention primitives are handled by :meth:`_Lowering.lower_eqn` itself.

jax is imported lazily, inside the functions of this module.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from sftctl.compiler.ir import FLOAT_DTYPES, Graph, GraphBuilder


_DTYPES = {"float64", "float32", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8", "uint32", "bool"}


_PRNG_REFUSAL = ("jax frontend: the step draws random numbers from a PRNG key (flax dropout in train mode, "
                 "or jax.random in the loss); random ops are not lowered: trace with deterministic=True "
                 "(model.eval() in flax.nnx) or set the dropout rate to 0")
#: primitives that only make, split or hash PRNG keys: lowered to no value (flax's lifted transforms
#: split keys nobody draws from); ``random_bits`` draws from the IR's random stream instead, and any
#: other use of a key's value refuses with _PRNG_REFUSAL
_KEY_OPS = frozenset({"random_seed", "random_split", "random_fold_in", "random_wrap", "random_clone",
                      "random_unwrap", "threefry2x32"})


def ir_dtype(dtype) -> str:
    """The IR dtype of a jax dtype. Raises NotImplementedError for one the IR lacks, and for a
    typed PRNG key (``key<fry>``: flax dropout in train mode, ``jax.random`` in the step) with
    what to do instead."""
    try:
        name = np.dtype(dtype).name
    except TypeError:  # an extended dtype numpy does not know
        name = str(dtype)
    if name.startswith("key<"):
        raise NotImplementedError(_PRNG_REFUSAL)
    if name not in _DTYPES:
        raise NotImplementedError(f"jax frontend: dtype {name} has no IR dtype")
    return name


def _user_line(eqn) -> str | None:
    """``file:line (function)`` of the user's code that emitted a jaxpr equation (the innermost
    frame outside jax, flax, optax and sftctl), or None."""
    try:
        from jax._src import source_info_util
    except ImportError:  # pragma: no cover - jax moved it
        return None
    skip = ("/jax/", "/jaxlib/", "/flax/", "/optax/", "/sftctl/compiler/")
    found = None
    try:
        frames = source_info_util.user_frames(eqn.source_info.traceback) if eqn.source_info.traceback else []
    except Exception:  # noqa: BLE001 - a traceback jax cannot read: no line to name
        return None
    for frame in frames:
        if not any(s in frame.file_name for s in skip):
            found = found or f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
    return found


def _jcore():
    try:
        from jax.extend import core  # jax >= 0.4.30
    except ImportError:  # pragma: no cover
        from jax import core
    return core


_CALLS = {"jit", "pjit", "closed_call", "core_call", "remat", "checkpoint", "remat2", "custom_jvp_call",
          "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}

#: primitives with many outputs (PRNG keys among them): their rules get ``shape = dtype = None``
_MANY_OUTPUTS = ("scan", "cond")

#: jaxpr primitive name -> lowering ``rule(lowering, args, params, shape, dtype) -> [IR ids]`` (``args``:
#: the equation's operands as IR ids; ``shape``/``dtype``: its first output's). The one op table of
#: this frontend, as ``frontends/torch/lowering.py``'s ``OPS`` is the torch frontend's; call-like
#: primitives (inlined) and the attention primitives are handled by ``_Lowering.lower_eqn`` itself.
_PRIMS: dict[str, Callable] = {}


def _prim(*names: str):
    def register(fn: Callable) -> Callable:
        for name in names:
            _PRIMS[name] = fn
        return fn
    return register


class _Lowering(GraphBuilder):
    """One jaxpr lowered to one IR graph: inputs by role, consts, then equation by equation
    through :data:`_PRIMS` (call-like primitives inlined, the attention primitives here)."""

    def __init__(self) -> None:
        super().__init__()
        self.core = _jcore()

    # --- driver -------------------------------------------------------------------------------
    def run(self, closed, roles, out_roles) -> tuple[Graph, list[int]]:
        jaxpr = closed.jaxpr
        if len(jaxpr.invars) != len(roles):
            raise RuntimeError(f"jaxpr has {len(jaxpr.invars)} inputs, expected {len(roles)}")
        env: dict[Any, int] = {}
        ids = []
        for var, (role, name) in zip(jaxpr.invars, roles):
            i = self.add("input", [], var.aval.shape, ir_dtype(var.aval.dtype), role=role, name=name)
            env[var] = i
            ids.append(i)
        for var, value in zip(jaxpr.constvars, closed.consts):
            env[var] = self.array_const(value, str(var))
        outs = self.lower_jaxpr(jaxpr, env)
        if len(outs) != len(out_roles):
            raise RuntimeError(f"jaxpr has {len(outs)} outputs, expected {len(out_roles)}")
        self.g.outputs = outs
        self.g.output_roles = list(out_roles)
        return self.g.compact(ids)

    def array_const(self, value, name: str) -> int:
        arr = np.asarray(value)
        dtype = ir_dtype(arr.dtype)
        flat = arr.reshape(-1)
        if flat.size == 0 or bool(np.all(flat == flat[0])):
            return self.const(flat[0].item() if flat.size else 0, arr.shape, dtype)
        return self.add("input", [], arr.shape, dtype, role="constant", name=name,
                        value=arr.astype(np.float64) if dtype in FLOAT_DTYPES else arr)

    def read(self, env, atom) -> int:
        if isinstance(atom, self.core.Literal):
            val = np.asarray(atom.val)
            return self.array_const(val, "literal") if val.ndim else self.const(
                val.item(), tuple(atom.aval.shape), ir_dtype(atom.aval.dtype))
        return env[atom]

    def lower_jaxpr(self, jaxpr, env) -> list[int]:
        for eqn in jaxpr.eqns:
            args = [self.read(env, a) for a in eqn.invars]
            try:
                outs = self.lower_eqn(eqn, args)
            except NotImplementedError as e:
                where = _user_line(eqn)
                if where and " at " not in str(e).rsplit(")", 1)[-1] and "(at " not in str(e):
                    raise NotImplementedError(f"{e} (at {where})") from None
                raise
            for var, i in zip(eqn.outvars, outs):
                if not isinstance(var, self.core.DropVar):
                    env[var] = i
        return [self.read(env, a) for a in jaxpr.outvars]

    def inline(self, sub, args) -> list[int]:
        if isinstance(sub, self.core.ClosedJaxpr):
            env = {v: self.array_const(c, str(v)) for v, c in zip(sub.jaxpr.constvars, sub.consts)}
            sub = sub.jaxpr
        else:
            env = {}
            if sub.constvars:
                raise NotImplementedError("jax frontend: open sub-jaxpr with constvars")
        env.update(zip(sub.invars, args))
        return self.lower_jaxpr(sub, env)

    def lower_eqn(self, eqn, args: list[int]) -> list[int]:
        name = eqn.primitive.name
        p = eqn.params
        outs = eqn.outvars
        if name in _KEY_OPS:
            return [None] * len(outs)  # a PRNG key: no IR value (see _KEY_OPS)
        if any(a is None for a in args) and name not in ("scan", "cond", "random_bits") and not (
                name in _CALLS or name.endswith("_call")):
            if all(str(v.aval.dtype).startswith("key<") for v in outs):
                return [None] * len(outs)  # a slice or reshape of keys is keys
            raise NotImplementedError(_PRNG_REFUSAL + f" (primitive {name})")
        if name in ("sftctl_attention", "sftctl_attention_bwd"):
            attrs = dict(causal=bool(p["causal"]), scale=float(p["scale"]), dropout_p=0.0, rng=0)
            types = [(tuple(v.aval.shape), ir_dtype(v.aval.dtype)) for v in outs]
            if name == "sftctl_attention":
                return [self.add("attention", args, *types[0], **attrs), self.add("attention_lse", args, *types[1], **attrs)]
            return [self.add("attention_grad", args, *t, wrt=w, **attrs) for t, w in zip(types, "qkv")]
        if name in _CALLS or name.endswith("_call"):
            for key in ("call_jaxpr", "jaxpr", "fun_jaxpr"):
                sub = p.get(key)
                if isinstance(sub, (self.core.ClosedJaxpr, self.core.Jaxpr)):
                    return self.inline(sub, args[len(args) - len(getattr(sub, "jaxpr", sub).invars):])
            raise NotImplementedError(f"jax frontend: primitive {name} (no inlinable jaxpr)")
        if name in _MANY_OUTPUTS:  # no one output shape (PRNG keys among them): rules get None
            return _PRIMS[name](self, args, p, None, None)
        aval = outs[0].aval
        shape, dtype = tuple(aval.shape), ir_dtype(aval.dtype)
        rule = _PRIMS.get(name)
        if rule is None:
            raise NotImplementedError(f"jax frontend: primitive {name} has no IR lowering")
        return rule(self, args, p, shape, dtype)
