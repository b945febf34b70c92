"""Random numbers: ``random_bits`` drawn from the IR's ``rng_uniform`` stream (PRNG key
primitives lower to no value: ``lowering._KEY_OPS``)."""

from __future__ import annotations

from sftctl.compiler.frontends.jax.lowering import _prim


@_prim("random_bits")
def _random_bits(self, args, p, shape, dtype):
    """``jax.random.bits`` (under ``uniform``, ``bernoulli``, flax dropout): uniform random
    integers of the output's width from the IR's ``rng_uniform`` stream, as the torch frontend
    prices dropout (the distribution, not threefry's exact bits)."""
    width = int(p.get("bit_width", 32))
    if width > 32:
        raise NotImplementedError(f"jax frontend: random_bits of {width} bits")
    self._rng = getattr(self, "_rng", 1 << 21) + 1
    u = self.add("rng_uniform", [], shape, "float64", rng=self._rng)
    scaled = self.add("floor", [self.add("mul", [u, self.const(float(2 ** width), (), "float64")], shape, "float64")],
                      shape, "float64")
    return [self.cast(self.cast(scaled, "int64"), dtype)]
