"""Random ops: dropout and SDPA's dropout become IR ops with a seeded keep-mask, counted in FLOPs,
bytes and memory, and run by the interpreter from a seed (so numerics stay checkable)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from stepcheck import assert_step_matches  # noqa: E402

from sftctl.compiler import interpreter  # noqa: E402
from sftctl.compiler.frontends import torch as torch_frontend  # noqa: E402
from sftctl.compiler.fusion import fuse  # noqa: E402
from sftctl.compiler.memory import peak_memory  # noqa: E402


class Block(nn.Module):
    """Linear, dropout, attention with dropout, linear."""

    def __init__(self, d=8, heads=2, p=0.3, attn_p=0.2):
        super().__init__()
        self.h, self.attn_p = heads, attn_p
        self.inp = nn.Linear(d, 3 * d)
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.drop(self.inp(x)).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.attn_p if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


def _loss(m, b):
    return (m(b["x"]) ** 2).mean()


def _trace64(model, x):
    model = copy.deepcopy(model).double()
    graph, meta = torch_frontend.trace_step(model, {"x": x.double()}, _loss, fake=False, betas=(0.5, 0.999),
                                            weight_decay=0.0)
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return graph, meta, params


def _feed(graph, meta, params, x):
    feed = {meta["params"][n]: v for n, v in params.items()}
    feed.update({i: np.zeros(graph.nodes[i].type.shape) for i in meta["opt_state"].values()})
    feed[meta["step"]] = 1.0
    feed[meta["batch"][0]] = x.double().numpy()
    return feed


def test_dropout_p0_matches_torch_and_has_no_random_op():
    torch.manual_seed(0)
    model = Block(p=0.0, attn_p=0.0).train()
    graph, _ = assert_step_matches(model, {"x": torch.randn(2, 5, 8)}, _loss)
    assert "rng_bernoulli" not in graph.op_counts()
    assert all(n.attrs["dropout_p"] == 0 for n in graph.nodes if n.op == "attention")


def test_keep_mask_statistics_and_seed():
    """The keep-mask keeps 1 - p of the elements (within 5 sigma), depends only on the seed, and
    the dropout output is the input times mask / (1 - p)."""
    p = 0.3

    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 512)

        def forward(self, x):
            return F.dropout(self.lin(x), p, self.training).sum()

    x = torch.randn(64, 16)
    graph, meta = torch_frontend.trace_step(Drop().double(), {"x": x.double()}, lambda m, b: m(b["x"]), fake=False)
    rng = [n for n in graph.nodes if n.op == "rng_bernoulli"]
    assert len(rng) == 1 and rng[0].type.dtype == "bool" and rng[0].attrs["p"] == pytest.approx(1 - p)
    drop = next(n for n in graph.nodes if n.op == "where" and n.inputs[0] == rng[0].id)
    graph.outputs += [rng[0].id, drop.id, graph.nodes[drop.inputs[1]].inputs[0]]
    graph.output_roles += ["mask", "dropped", "pre"]
    model = Drop().double()
    params = {n: p_.detach().numpy() for n, p_ in model.named_parameters()}
    feed = {meta["params"][n]: v for n, v in params.items()}
    feed.update({i: np.zeros(graph.nodes[i].type.shape) for i in meta["opt_state"].values()})
    feed[meta["step"]] = 1.0
    feed[meta["batch"][0]] = x.double().numpy()
    runs = {s: interpreter.run(graph, feed, seed=s)[-3:] for s in (1, 1, 2)}
    mask, dropped, pre = runs[1]
    n = mask.size
    assert abs(mask.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)
    np.testing.assert_allclose(dropped, np.where(mask, pre / (1 - p), 0.0), rtol=1e-15)
    again = interpreter.run(graph, feed, seed=1)[-3]
    assert (again == mask).all()
    assert (runs[2][0] != mask).mean() > 0.3  # another seed, another mask


def test_dropout_gradients_consistent_with_the_seeded_forward():
    """With dropout on (nn.Dropout and SDPA's dropout_p), the interpreted gradient equals a central
    finite difference of the interpreted loss under the same seed (float64)."""
    torch.manual_seed(1)
    model = Block(p=0.3, attn_p=0.25).train()
    x = torch.randn(2, 6, 8)
    graph, meta, params = _trace64(model, x)
    assert graph.op_counts()["rng_bernoulli"] == 1
    assert [n.attrs["dropout_p"] for n in graph.nodes if n.op == "attention"] == [0.25]
    seed = 7
    out = dict(zip(graph.output_roles, interpreter.run(graph, _feed(graph, meta, params, x), seed=seed)))
    loss = float(out["loss"])
    rng = np.random.default_rng(0)
    checked = 0
    for name in ("inp.weight", "out.weight"):
        grad = 2.0 * out[f"opt_state:{name}.exp_avg"]
        for _ in range(4):
            idx = tuple(int(rng.integers(0, s)) for s in grad.shape)
            h = 1e-6
            vals = []
            for sign in (1, -1):
                pp = {k: v.copy() for k, v in params.items()}
                pp[name][idx] += sign * h
                vals.append(float(interpreter.run(graph, _feed(graph, meta, pp, x), seed=seed)[0]))
            fd = (vals[0] - vals[1]) / (2 * h)
            assert fd == pytest.approx(grad[idx], rel=1e-5, abs=1e-9), (name, idx)
            checked += 1
    assert checked == 8 and loss > 0
    # and the dropout really drops: a different seed gives a different loss
    other = float(interpreter.run(graph, _feed(graph, meta, params, x), seed=seed + 1)[0])
    assert other != pytest.approx(loss, rel=1e-6)


def test_dropout_mask_costs_bytes_memory_and_flops():
    """A dropout on a [B, T, 1024] activation (activations dominate the weights): the keep-mask is generated in a kernel (FLOPs), written
    once as bool (1 byte per element) and kept until backward reads it."""
    B, T, D = 16, 1024, 1024

    class M(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.a, self.b, self.p = nn.Linear(D, D), nn.Linear(D, 8), p

        def forward(self, x):
            return self.b(F.dropout(torch.relu(self.a(x)), self.p, self.training)).square().mean()

    x = torch.empty(B, T, D, device="meta")
    peaks, flops = {}, {}
    for p in (0.0, 0.1):
        with torch.device("meta"):
            model = M(p).train()
        graph, _ = torch_frontend.trace_step(model, {"x": x}, lambda m, b: m(b["x"]))
        kernels = fuse(graph)
        peaks[p] = peak_memory(graph, kernels).transient_peak_bytes
        flops[p] = sum(k.flops for k in kernels)
        if p:
            rng = next(n for n in graph.nodes if n.op == "rng_bernoulli")
            writer = next(k for k in kernels if rng.id in k.writes)
            assert graph.nodes[rng.id].type.nbytes == B * T * D  # bool
            readers = [k for k in kernels if rng.id in k.reads]
            assert readers and kernels.index(readers[-1]) > kernels.index(writer)  # backward reads it
    assert peaks[0.1] - peaks[0.0] >= B * T * D  # the saved mask
    assert flops[0.1] > flops[0.0] + B * T * D  # generating and applying the mask


@pytest.mark.parametrize("kind", ["rand", "randn_like", "randint", "normal_", "uniform_"])
def test_sampling_ops_have_their_distributions_moments(kind):
    """Sampling inside the step (a diffusion model's noise and timesteps) lowers to rng_uniform
    draws (normal by Box-Muller, integers by truncation): the interpreted sample's mean and
    second moment are the distribution's within 6 standard errors."""
    n = 40000
    draw, mean, var = {
        "rand": (lambda x: torch.rand(n), 0.5, 1 / 12),
        "randn_like": (lambda x: torch.randn_like(x), 0.0, 1.0),
        "randint": (lambda x: torch.randint(3, 13, (n,)).float(), 7.5, (10 ** 2 - 1) / 12),
        "normal_": (lambda x: torch.empty(n).normal_(2.0, 3.0), 2.0, 9.0),
        "uniform_": (lambda x: torch.empty(n).uniform_(-1.0, 3.0), 1.0, 16 / 12),
    }[kind]
    x = torch.zeros(n)
    lin = nn.Linear(1, 1)
    got = []
    for power in (1, 2):
        def loss_fn(m, b, power=power):
            return m(b["x"][:1].reshape(1, 1)).sum() * 0 + ((draw(b["x"]) - mean) ** power).mean()

        graph, meta = torch_frontend.trace_step(lin, {"x": x}, loss_fn)
        assert "rng_uniform" in graph.op_counts()
        feed = {meta["params"][k]: p.detach().numpy() for k, p in lin.named_parameters()}
        feed.update({i: np.zeros(graph.nodes[i].type.shape) for i in meta["opt_state"].values()})
        feed[meta["step"]] = 1.0
        feed[meta["batch"][0]] = x.numpy()
        got.append(float(interpreter.run(graph, feed, seed=11)[0]))
    assert abs(got[0]) < 6 * np.sqrt(var / n)
    assert abs(got[1] - var) < 6 * np.sqrt(2 * var ** 2 / n)  # Var of a squared deviation <= 2 var^2 here
