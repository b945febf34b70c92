"""The JAX frontend's primitives against ``jax.lax`` itself (issue 22): each function below is
traced with ``jax.make_jaxpr``, lowered to the IR, run by the float64 interpreter and compared
with JAX's float64 result, forward and through ``jax.vjp`` (a random cotangent), at rtol 1e-7
plus 1e-9 x the largest magnitude. Inputs come from a fresh seed each run (printed in a failure;
``SFTCTL_JAX_PRIMS_SEED=N`` replays it).

Covered: control flow (``lax.scan`` unrolled, forward and reverse, ``lax.cond`` / ``lax.switch``
on a traced index), ``cumsum``, ``dynamic_slice`` / ``dynamic_update_slice`` at traced (and
out-of-range, clamped) starts, ``reduce_window`` max / sum / min with padding and strides, and
``select_and_scatter_add`` through max pooling's gradient. The coverage report
(:func:`test_primitives_of_representative_programs_are_lowered`) lists which primitives a flax
CNN, a flax RNN and an optax AdamW step emit, and asserts every one is lowered.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from sftctl.compiler import interpreter  # noqa: E402
from sftctl.compiler.frontends import jax as jax_frontend  # noqa: E402

RTOL, ATOL_REL = 1e-7, 1e-9


class _Rng:
    """numpy's Generator from a fresh (or replayed) seed, which it remembers for messages."""

    def __init__(self, seed: int):
        self.seed_value = seed
        self._gen = np.random.default_rng(seed)

    def normal(self, size):
        return self._gen.normal(size=size)


@pytest.fixture
def rng():
    return _Rng(int(os.environ.get("SFTCTL_JAX_PRIMS_SEED") or random.randrange(1 << 31)))


def run_lowered(f, *xs):
    """``f(*xs)`` through make_jaxpr, the frontend's lowering and the float64 interpreter."""
    closed = jax.make_jaxpr(f)(*xs)
    outs = jax.tree_util.tree_leaves(jax.eval_shape(f, *xs))
    graph, ids = jax_frontend._Lowering().run(closed, [("batch", f"x{i}") for i in range(len(xs))],
                                              [f"y{i}" for i in range(len(outs))])
    return interpreter.run(graph, {i: np.asarray(x) for i, x in zip(ids, xs)}, dtype="float64")


def assert_matches(f, *xs, seed, grad=True):
    want = [np.asarray(w) for w in jax.tree_util.tree_leaves(f(*xs))]
    got = run_lowered(f, *xs)
    for k, (g, w) in enumerate(zip(got, want)):
        scale = max(float(np.abs(w).max()) if w.size else 0.0, max(float(np.abs(np.asarray(x)).max()) for x in xs))
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL_REL * scale, err_msg=f"output {k} (seed {seed})")
    if not grad:
        return
    floats = [i for i, x in enumerate(xs) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]

    def vjp(*args):
        ins, cot = args[:len(xs)], args[len(xs):]

        def part(*fl):
            full = list(ins)
            for i, v in zip(floats, fl):
                full[i] = v
            return f(*full)
        _, back = jax.vjp(part, *[ins[i] for i in floats])
        return back(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(f(*xs)), list(cot)))

    cots = [np.random.default_rng(seed + 1).normal(size=np.shape(w)) for w in want]
    assert_matches(vjp, *xs, *cots, seed=seed, grad=False)


def test_scan_forward_and_reverse_with_carries_and_stacked_outputs(x64, rng):
    w = rng.normal(size=(4, 4)) * 0.5
    xs, h0 = rng.normal(size=(6, 3, 4)), rng.normal(size=(3, 4))

    def rnn(h0, xs, w):
        def cell(h, x):
            h = jnp.tanh(h @ w + x)
            return h, h.sum(-1)
        h, ys = lax.scan(cell, h0, xs)
        h2, zs = lax.scan(cell, h, xs, reverse=True)
        return h2, ys, zs

    assert_matches(rnn, h0, xs, w, seed=rng.seed_value)


def test_cond_and_switch_on_a_traced_index(x64, rng):
    x = rng.normal(size=(5,))

    def f(x, i):
        a = lax.cond(x.sum() > 0, lambda v: jnp.sin(v), lambda v: v * 2.0, x)
        return a + lax.switch(i, [lambda v: v, lambda v: v ** 2, lambda v: -v], x)

    for i in (0, 1, 2):
        assert_matches(f, x, np.int32(i), seed=rng.seed_value)


def test_cumsum_and_dynamic_slices_at_traced_clamped_starts(x64, rng):
    x = rng.normal(size=(6, 5))
    u = rng.normal(size=(2, 3))

    def f(x, u, i, j):
        c = jnp.cumsum(x, axis=0) + lax.cumsum(x, axis=1, reverse=True)
        window = lax.dynamic_slice(x, (i, j), (3, 2))
        placed = lax.dynamic_update_slice(x, u, (i, j))
        return c, window, placed

    for i, j in ((1, 2), (5, 4), (-3, 0)):  # (5, 4) and (-3, 0) are clamped into range, as XLA does
        assert_matches(f, x, u, np.int32(i), np.int32(j), seed=rng.seed_value)


def test_reduce_window_max_sum_min_and_max_pooling_gradient(x64, rng):
    x = rng.normal(size=(2, 7, 6, 3))

    def pools(x):
        mx = lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 0), (0, 0)))
        sm = lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 1, 1), "VALID")
        mn = lax.reduce_window(x, jnp.inf, lax.min, (1, 2, 3, 1), (1, 1, 2, 1), "SAME")
        return mx, sm, mn

    assert_matches(pools, x, seed=rng.seed_value)


def _prims(closed) -> set[str]:
    out = set()

    def walk(jaxpr):
        for e in jaxpr.eqns:
            out.add(e.primitive.name)
            for v in e.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)
                    elif hasattr(sub, "eqns"):
                        walk(sub)
    walk(closed.jaxpr)
    return out


def test_primitives_of_representative_programs_are_lowered():
    """Coverage: the primitives a flax.linen CNN (conv, pooling, batch norm, dropout off), a flax
    LSTM over ``nn.RNN`` (a scan) and an optax AdamW step emit, forward and backward; each one has
    a lowering (or is inlined: calls, scan, cond; key-making ones carry no value)."""
    pytest.importorskip("flax")
    optax = pytest.importorskip("optax", reason="optax is flax's optimizer library")
    from flax import linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Conv(4, (3, 3))(x)))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
            x = nn.avg_pool(nn.Dropout(0.1, deterministic=True)(x), (2, 2), strides=(2, 2))
            return nn.Dense(3)(x.reshape(x.shape[0], -1))

    class LSTM(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.RNN(nn.OptimizedLSTMCell(8))(x)[:, -1])

    programs = {}
    for name, model, x in (("flax CNN", CNN(), jnp.ones((2, 8, 8, 3))), ("flax LSTM", LSTM(), jnp.ones((2, 5, 3)))):
        variables = model.init(jax.random.PRNGKey(0), x)
        params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}
        tx = optax.adamw(1e-3)

        def step(p, s, x, model=model, rest=rest, tx=tx):
            loss, g = jax.value_and_grad(lambda p: model.apply({"params": p, **rest}, x).sum())(p)
            upd, s = tx.update(g, s, p)
            return loss, optax.apply_updates(p, upd), s

        programs[name] = _prims(jax.make_jaxpr(step)(params, tx.init(params), x))
    seen = set().union(*programs.values())
    handled = set(jax_frontend._PRIMS) | jax_frontend._CALLS | jax_frontend._KEY_OPS | {"scan", "cond"} | {
        p for p in seen if p.endswith("_call")}
    missing = sorted(seen - handled)
    print(f"\nJAX primitives in {', '.join(programs)}: {len(seen)}, lowered {len(seen) - len(missing)}; "
          f"missing: {missing}")
    assert not missing, {n: sorted(ps - handled) for n, ps in programs.items()}


def test_sort_argsort_and_cumprod(x64, rng):
    x = rng.normal(size=(4, 6))
    x[1, 2] = x[1, 4]  # a tie: the stable order keeps the earlier first
    x[2, 3] = 0.0      # cumprod is 0 from there on

    def f(x):
        return jnp.sort(x, axis=1), jnp.argsort(x, axis=0), lax.cumprod(x, axis=1), lax.cumprod(x, axis=0, reverse=True)

    assert_matches(f, x, seed=rng.seed_value, grad=False)
    assert_matches(lambda x: (jnp.sort(x, axis=1) * jnp.arange(6.0)).sum(), x, seed=rng.seed_value)


def test_bit_ops_and_bitcast_match_jax_and_random_bits_draw_uniformly(rng):
    """``jax.random.uniform``'s mantissa trick on given bits (shift, or, and, xor, bitcast)
    equals JAX's exactly; ``random_bits`` from the IR's stream gives uniforms with mean 1/2 and
    Bernoulli draws at their rate (20,000 each, 5 standard deviations)."""
    bits = np.asarray(rng._gen.integers(0, 2**32, size=(64,), dtype=np.uint64), dtype=np.uint32)

    def trick(b):
        m = lax.shift_right_logical(b, np.uint32(9)) | np.uint32(0x3F800000)
        return lax.bitcast_convert_type(m, jnp.float32) - 1.0, (b & np.uint32(0xFF)) ^ np.uint32(0x0F)

    assert_matches(trick, bits, seed=rng.seed_value, grad=False)

    def draws(key):
        return jax.random.uniform(key, (20000,)), jax.random.bernoulli(key, 0.3, (20000,))

    u, b = run_lowered(draws, jax.random.PRNGKey(0))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.011
    assert abs(float(b.astype(float).mean()) - 0.3) < 0.017
