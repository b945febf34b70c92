"""Control flow: ``lax.scan`` unrolled over its length, ``lax.cond`` / ``lax.switch`` with every
branch lowered and the outputs selected by the index. Both have many outputs (PRNG keys among
them), so :meth:`~sftctl.compiler.frontends.jax.lowering._Lowering.lower_eqn` passes their rules
no shape."""

from __future__ import annotations

from sftctl.compiler.frontends.jax.lowering import _prim, ir_dtype


def _spread(self, scalar: int, shape) -> int:
    """A 0-d value broadcast to ``shape``."""
    shape = tuple(shape)
    if not shape:
        return scalar
    return self.add("broadcast_in_dim", [scalar], shape, self.dtype(scalar), shape=shape, dims=())


def _scan(self, p, args) -> list[int]:
    """``lax.scan`` (flax ``nn.RNN`` / ``nn.scan``, a hand-written recurrence) unrolled over
    its static ``length``: the body inlined once per step, each step's slice of ``xs`` in, its
    ``ys`` stacked along a new leading axis (``reverse``: steps from the end)."""
    body = p["jaxpr"]
    n_consts, n_carry, length = int(p["num_consts"]), int(p["num_carry"]), int(p["length"])
    consts, carry, xs = args[:n_consts], list(args[n_consts:n_consts + n_carry]), args[n_consts + n_carry:]
    y_avals = [v.aval for v in body.jaxpr.outvars[n_carry:]]
    ys: list[list[int]] = [[None] * length for _ in y_avals]
    steps = range(length - 1, -1, -1) if p.get("reverse") else range(length)
    for i in steps:
        x_i = []
        for x in xs:
            xs_shape = self.shape(x)
            sl = self.add("slice", [x], (1,) + xs_shape[1:], self.dtype(x), start=(i,) + (0,) * (len(xs_shape) - 1),
                          limit=(i + 1,) + xs_shape[1:], step=(1,) * len(xs_shape))
            x_i.append(self.reshape(sl, xs_shape[1:]))
        out = self.inline(body, list(consts) + carry + x_i)
        carry = list(out[:n_carry])
        for k, y in enumerate(out[n_carry:]):
            ys[k][i] = y
    stacked = []
    for k, aval in enumerate(y_avals):
        full = (length,) + tuple(aval.shape)
        if str(aval.dtype).startswith("key<"):
            stacked.append(None)
            continue
        dt = ir_dtype(aval.dtype)
        if length == 0:
            stacked.append(self.const(0, full, dt))
            continue
        if any(y is None for y in ys[k]):  # a PRNG key per step: no value (see _KEY_OPS)
            stacked.append(None)
            continue
        parts = [self.reshape(self.cast(y, dt), (1,) + tuple(aval.shape)) for y in ys[k]]
        stacked.append(parts[0] if length == 1 else self.add("concatenate", parts, full, dt, axis=0))
    return carry + stacked


def _cond(self, p, args) -> list[int]:
    """``lax.cond`` / ``lax.switch`` on a traced index: every branch lowered and the outputs
    selected elementwise by the index (both branches are priced, as a GPU running
    ``jnp.where`` would run them; XLA runs one)."""
    index, ops = args[0], args[1:]
    branches = [self.inline(b, list(ops)) for b in p["branches"]]
    idx = self.cast(index, "int64")
    outs = list(branches[0])
    for k, br in enumerate(branches[1:], start=1):
        pick = self.add("eq", [idx, self.const(k, (), "int64")], (), "bool")
        outs = [self.add("where", [_spread(self, pick, self.shape(a)), self.cast(b, self.dtype(a)), a],
                         self.shape(a), self.dtype(a)) for a, b in zip(outs, br)]
    return outs


@_prim("scan")
def _scan_rule(self, args, p, shape, dtype):
    return _scan(self, p, args)


@_prim("cond")
def _cond_rule(self, args, p, shape, dtype):
    return _cond(self, p, args)
