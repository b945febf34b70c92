"""The long tail of ATen ops models use (issue 22): rounding, ``fmod``/``remainder``, ``div``
rounding modes, ``argmax``/``argmin``, ``max``/``min`` with indices and ``topk`` (MoE routers),
each traced with real tensors and run by the float64 interpreter against torch in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sftctl.compiler import interpreter
from sftctl.compiler.frontends import torch as torch_frontend
from tests.stepcheck import assert_step_matches


class _Rounding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(6, 8)

    def forward(self, x):
        h = self.w(x) * 3.7
        parts = [torch.floor(h), torch.ceil(h), torch.round(h), torch.round(h, decimals=1), torch.trunc(h),
                 torch.fmod(h, 1.3), torch.remainder(h, 1.3), torch.div(h, 1.7, rounding_mode="floor"),
                 torch.div(h, 1.7, rounding_mode="trunc")]
        return sum((k + 1) * p * h for k, p in enumerate(parts)).sum()


class _Router(torch.nn.Module):
    """A top-2 mixture-of-experts router as Mixtral's writes it (softmax, topk, renormalize)."""

    def __init__(self, d=8, experts=4):
        super().__init__()
        self.gate = torch.nn.Linear(d, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):
        probs = torch.softmax(self.gate(x), dim=-1)
        top, idx = torch.topk(probs, 2, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        outs = torch.stack([e(x) for e in self.experts], dim=-2)          # tokens, experts, d
        picked = torch.gather(outs, -2, idx[..., None].expand(*idx.shape, outs.shape[-1]))
        y = (picked * top[..., None]).sum(-2)
        best = probs.argmax(-1)
        worst = probs.argmin(-1)
        vmax, imax = probs.max(-1)
        return (y ** 2).sum() + (best + 2 * worst + 3 * imax).double().sum() * 1e-3 + vmax.sum()


@pytest.mark.parametrize("model, batch", [
    (_Rounding(), torch.randn(5, 6, generator=torch.Generator().manual_seed(1))),
    (_Router(), torch.randn(7, 8, generator=torch.Generator().manual_seed(2))),
], ids=["rounding", "router"])
def test_tail_ops_match_torch_in_float64(model, batch):
    torch.manual_seed(0)
    graph, _ = assert_step_matches(model, batch, lambda m, x: m(x))
    ops = graph.op_counts()
    assert ops.get("floor", 0) + ops.get("concatenate", 0) > 0


def test_integer_division_modes_match_torch():
    """Integer ``div`` (floor, trunc), ``fmod`` and ``remainder`` on negative operands."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4, 7))

        def forward(self, i):
            q = (torch.div(i, 3, rounding_mode="floor") * 1000 + torch.div(i, 3, rounding_mode="trunc") * 100
                 + torch.fmod(i, 3) * 10 + torch.remainder(i, 3))
            return (self.w * q.to(self.w.dtype)).sum()

    i = torch.arange(-14, 14).reshape(4, 7)
    model = M().double()
    graph, meta = torch_frontend.trace_step(model, i, lambda m, x: m(x), fake=False, weight_decay=0.0)
    feed = {meta["params"]["w"]: np.ones((4, 7)), meta["step"]: np.float64(1.0), meta["batch"][0]: i.numpy()}
    for _, k in meta["opt_state"].items():
        feed[k] = np.zeros((4, 7))
    loss = dict(zip(graph.output_roles, interpreter.run(graph, feed, dtype="float64")))["loss"]
    assert float(loss) == float(model(i).detach())


_UNLOWERED = '''import torch


class Ranker(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x)
        return torch.linalg.matrix_exp(h.T @ h).sum()  # an op with no lowering


def build(batch_size=2, dtype="float32"):
    return Ranker(), torch.randn(batch_size, 4), lambda m, x: m(x)
'''


def test_a_model_the_tracer_cannot_take_has_its_own_exit_code_and_still_runs(tmp_path, home):
    """Issue 22: an op without a lowering is not a spec error (exit 2): UntraceableModelError
    (exit 5) names the op and the module; planning for ``run``
    (``strict=False``) ranks by price with a warning instead of stopping."""
    import warnings

    from sftctl import api
    from sftctl.errors import ExitCode, SftctlWarning, UntraceableModelError

    (tmp_path / "model.py").write_text(_UNLOWERED)
    spec = tmp_path / "job.yaml"
    spec.write_text("name: ranker\nmodel: {entrypoint: model.py:build, batch_size: 2}\nrun: echo hi\n")
    with pytest.raises(UntraceableModelError) as e:
        api.plan(str(spec))
    assert e.value.exit_code == ExitCode.UNTRACEABLE == 5
    msg = e.value.message
    assert "aten.linalg_matrix_exp" in msg and "in the model's own forward (Ranker)" in msg, msg
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = api.plan(str(spec), strict=False)
    assert chosen.chosen is not None
    said = [str(w.message) for w in caught if issubclass(w.category, SftctlWarning)]
    assert any("aten.linalg_matrix_exp" in s and "ranking by price only" in s for s in said), said


def test_reentrant_checkpoint_names_the_line_and_the_fix():
    """Issue 22: ``checkpoint(use_reentrant=True)`` failed with torch's "element 0 of tensors does
    not require grad", which blames the user's code; now one line names the call and the fix."""
    import inspect

    import torch.utils.checkpoint as ck

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return ck.checkpoint(self.lin, x, use_reentrant=True).sum()

    line = inspect.getsourcelines(M.forward)[1] + 1
    with pytest.raises(NotImplementedError) as e:
        torch_frontend.trace_step(M(), torch.randn(2, 4), lambda m, x: m(x))
    msg = str(e.value)
    assert "use_reentrant=False" in msg and f"test_lowerings_tail.py:{line} (forward)" in msg, msg


def test_jax_rounding_rem_and_argmax_match_jax_in_float64():
    """Issue 22 (JAX side): ``floor``, ``ceil``, ``round`` (both methods), ``rem`` and ``argmax``
    / ``argmin`` through the jax frontend and the float64 interpreter, against JAX."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from sftctl.compiler.frontends import jax as jax_frontend

    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        rng = np.random.default_rng(3)

        def loss_fn(p, x):
            h = x @ p["w"] * 3.7
            i = jnp.argmax(h, axis=-1)[:, None]
            j = jnp.argmin(h, axis=-1)[:, None]
            terms = (jnp.floor(h) + 2 * jnp.ceil(h) + 3 * jnp.round(h) + 4 * jax.lax.round(h)
                     + 5 * jnp.fmod(h, 1.3))
            picked = jnp.take_along_axis(h, i, axis=1) - jnp.take_along_axis(h, j, axis=1)
            return jnp.sum(terms * h) + jnp.sum(picked)

        params = {"w": jnp.asarray(rng.normal(size=(6, 5)))}
        x = jnp.asarray(rng.normal(size=(4, 6)))
        graph, meta = jax_frontend.trace_step(loss_fn, params, x, weight_decay=0.0)
        assert {"floor", "ceil", "round", "trunc"} <= set(graph.op_counts())
        feed = {meta["params"]["w"]: np.asarray(params["w"]), meta["step"]: 1.0, meta["batch"][0]: np.asarray(x)}
        for i in meta["opt_state"].values():
            feed[i] = np.zeros(graph.nodes[i].type.shape)
        loss = dict(zip(graph.output_roles, interpreter.run(graph, feed, dtype="float64")))["loss"]
        np.testing.assert_allclose(float(loss), float(loss_fn(params, x)), rtol=1e-12)
    finally:
        jax.config.update("jax_enable_x64", previous)


def test_sort_and_histc_match_torch():
    """``sort`` (stable, both directions, ties) and ``histc`` (transformers' grouped experts path
    sorts expert ids and counts tokens per expert), in float64 against torch."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.linspace(-1, 1, 12).reshape(3, 4))

        def forward(self, ids):
            up, i_up = torch.sort(self.w.round(decimals=1), dim=-1)
            down, i_down = torch.sort(self.w, dim=0, descending=True)
            ranked, perm = torch.sort(ids.reshape(-1), stable=True)
            counts = torch.histc(ids.to(self.w.dtype), bins=4, min=0, max=3)
            return ((up * i_up).sum() + (down * (i_down + 1)).sum() + (perm * ranked).sum() * 1e-2
                    + (counts * torch.arange(4)).sum() * self.w.sum())

    ids = torch.tensor([[3, 1, 1, 0], [2, 3, 3, 1]])
    assert_step_matches(M(), ids, lambda m, x: m(x), fake=True)
