"""Issue 43 (models beyond language models, round 3): the constructs research code uses that the
tracer refused, each traced and run by the float64 interpreter against torch in float64
(random inputs; loss and gradients within ``rtol`` 1e-7 unless a test says otherwise):

* ``torch.utils.checkpoint(..., use_reentrant=True)`` traced as the non-reentrant form (the
  same gradients; a call with no input that requires grad gives its parameters none, as torch);
* ``slice_scatter`` with a step (``y[:, 1::3] = ...``, Swin's shifted-window masks);
* integer shifts and bitwise ops on signed and unsigned integers (``x >> 2``, ``&``, ``~``);
* ``.item()`` of a value used as a value (``h / h.abs().max().item()``, ``loss / n.item()``);
  a size computed from one is refused naming the line;
* the user's prints while a model is traced go to stderr, never to ``compile --json``'s stdout.
"""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = nn.functional

from stepcheck import assert_step_matches  # noqa: E402

from sftctl.compiler.frontends import torch as torch_frontend  # noqa: E402

def _gen(seed):
    return torch.Generator().manual_seed(seed)


class _ReentrantNet(nn.Module):
    """An embedding, then blocks under reentrant checkpointing (transformers < 4.35's
    ``gradient_checkpointing``), and one block checkpointed on the raw batch (no input requires
    grad: torch runs it without autograd, so its parameters get no gradient)."""

    def __init__(self, d=6):
        super().__init__()
        self.first = nn.Linear(d, d)
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d)) for _ in range(2))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        import torch.utils.checkpoint as ck

        h = self.inp(x) + ck.checkpoint(self.first, x, use_reentrant=True)
        for blk in self.blocks:
            h = h + ck.checkpoint(blk, h, use_reentrant=True)
        return self.head(h).pow(2).mean()


def test_reentrant_checkpoint_traces_like_the_non_reentrant_one():
    model = _ReentrantNet()
    graph, _ = assert_step_matches(model, torch.randn(5, 6, generator=_gen(1)), lambda m, x: m(x), fake=True)
    # the blocks' forward is recomputed in the backward: 2 tanh forward + 2 recomputed
    assert graph.op_counts()["tanh"] == 4, graph.op_counts()


def test_reentrant_checkpoint_of_the_batch_alone_names_the_line():
    """The whole loss under a reentrant checkpoint of the batch has no gradient in torch either
    (torch warns "None of the inputs have requires_grad=True"): one line names the call."""
    import torch.utils.checkpoint as ck

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return ck.checkpoint(self.lin, x, use_reentrant=True).sum()

    line = inspect.getsourcelines(M.forward)[1] + 1
    with pytest.raises(NotImplementedError) as e:
        torch_frontend.trace_step(M(), torch.randn(2, 4), lambda m, x: m(x))
    msg = str(e.value)
    assert "use_reentrant=False" in msg and f"test_models_round3.py:{line} (forward)" in msg, msg


class _StridedWrites(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 10)

    def forward(self, x):
        h = self.a(x)
        z = torch.zeros(4, 10, dtype=h.dtype)
        z = torch.slice_scatter(z, h[:, ::2] * 3, dim=1, start=0, step=2)
        y = h.clone()
        y[:, 1::3] = h[:, 1::3] ** 2          # positions 1, 4, 7
        w = h.clone()
        w[1:4:2] = torch.sin(h[0:2])          # rows 1, 3
        return (z * h).sum() + (y * h).sum() + w.pow(2).sum()


def test_slice_scatter_with_a_step_matches_torch():
    graph, _ = assert_step_matches(_StridedWrites(), torch.randn(4, 6, generator=_gen(2)), lambda m, x: m(x))
    assert graph.op_counts().get("gather", 0) >= 3


class _Bits(nn.Module):
    """Hashing and bit-packing as positional encodings and quantizers write them."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 7, generator=_gen(3)))

    def forward(self, i, u):
        q = ((i >> 2) + (i << 1) * 3 + (i & 5) * 5 + (i | 3) * 7 + (i ^ 6) * 11 + (~i) * 13
             + torch.bitwise_right_shift(i, 3) * 17 + (i >> (u.long() % 4)) * 19)
        q = q.to(self.w.dtype) + ((u >> 1) + (~u) * 2 + (u << 2)).to(self.w.dtype) * 1000
        return (self.w * q).sum()


def test_integer_shifts_and_bitwise_ops_match_torch():
    i = torch.randint(-300, 300, (4, 7), generator=_gen(4))
    u = torch.randint(0, 256, (4, 7), generator=_gen(5)).to(torch.uint8)
    graph, _ = assert_step_matches(_Bits(), (i, u), lambda m, b: m(*b))
    ops = graph.op_counts()
    assert ops.get("shift_right_logical", 0) >= 3 and ops.get("bitwise_xor", 0) >= 3, ops


class _ItemValues(nn.Module):
    """Values read with ``.item()`` and used as values: a max-abs scale and a count."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(6, 6)

    def forward(self, x):
        h = self.w(x)
        m = h.abs().max().item()
        n = (x > 0).sum().item()
        return (h / (m + 1.0)).pow(2).sum() / n + h.sum() * (n * 2 + 1)


def test_item_of_a_value_flows_on_as_a_value():
    graph, _ = assert_step_matches(_ItemValues(), torch.randn(4, 6, generator=_gen(6)), lambda m, x: m(x), fake=True)
    assert graph.op_counts().get("max", 0) >= 1


def test_item_used_as_a_size_names_the_line():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(6, 6)

        def forward(self, x):
            k = (x > 0).sum().item()
            return self.w(x).reshape(-1)[:k].sum()

    line = inspect.getsourcelines(M.forward)[1] + 1
    with pytest.raises(NotImplementedError) as e:
        torch_frontend.trace_step(M(), torch.randn(4, 6), lambda m, x: m(x))
    msg = str(e.value)  # the slice by the value's line (it makes a size of its own) or the .item() line
    assert f"test_models_round3.py:{line + 1}" in msg or f"test_models_round3.py:{line}" in msg, msg


class SpectralConv2d(nn.Module):
    """The Fourier layer of Li et al.'s FNO (neuraloperator's ``fourier_2d.py``): ``rfft2``, the
    lowest modes mixed by complex weights (``einsum`` of complex tensors), ``irfft2``.
    ``cdtype``: the complex dtype the authors write as ``torch.cfloat``."""

    def __init__(self, cin, cout, m1, m2, cdtype=torch.cfloat):
        super().__init__()
        self.cout, self.m1, self.m2, self.cdtype = cout, m1, m2, cdtype
        scale = 1 / (cin * cout)
        self.weights1 = nn.Parameter(scale * torch.rand(cin, cout, m1, m2, dtype=cdtype, generator=_gen(11)))
        self.weights2 = nn.Parameter(scale * torch.rand(cin, cout, m1, m2, dtype=cdtype, generator=_gen(12)))

    def compl_mul2d(self, input, weights):
        return torch.einsum("bixy,ioxy->boxy", input, weights)

    def forward(self, x):
        b = x.shape[0]
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(b, self.cout, x.size(-2), x.size(-1) // 2 + 1, dtype=self.cdtype, device=x.device)
        out_ft[:, :, :self.m1, :self.m2] = self.compl_mul2d(x_ft[:, :, :self.m1, :self.m2], self.weights1)
        out_ft[:, :, -self.m1:, :self.m2] = self.compl_mul2d(x_ft[:, :, -self.m1:, :self.m2], self.weights2)
        return torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))


class FNO2d(nn.Module):
    """A 2-layer Fourier neural operator on a (x, y, a(x, y)) grid, as FNO's Darcy-flow script."""

    def __init__(self, modes=3, width=6, cdtype=torch.cfloat):
        super().__init__()
        self.fc0 = nn.Linear(3, width)
        self.conv0, self.w0 = SpectralConv2d(width, width, modes, modes, cdtype), nn.Conv2d(width, width, 1)
        self.conv1, self.w1 = SpectralConv2d(width, width, modes, modes, cdtype), nn.Conv2d(width, width, 1)
        self.fc1, self.fc2 = nn.Linear(width, 8), nn.Linear(8, 1)

    def forward(self, x):
        x = self.fc0(x).permute(0, 3, 1, 2)
        x = F.gelu(self.conv0(x) + self.w0(x))
        x = self.conv1(x) + self.w1(x)
        return self.fc2(F.gelu(self.fc1(x.permute(0, 2, 3, 1))))


class _SpectralOps(nn.Module):
    """The rest of ``torch.fft`` as Hyena's long convolution and audio front ends use it: ``rfft``
    / ``irfft`` zero-padded to ``2L`` with ``norm="ortho"``, complex ``fft`` / ``ifft`` over
    another dim, ``fft2``'s magnitude, a phase, and an STFT magnitude spectrogram."""

    def __init__(self, d=4, L=6):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.k = nn.Parameter(torch.randn(d, L, generator=_gen(13)) * 0.3)

    def forward(self, x, wave):
        u = self.proj(x).transpose(1, 2)                                    # B, d, L
        L = u.shape[-1]
        kf = torch.fft.rfft(self.k, n=2 * L)
        y = torch.fft.irfft(torch.fft.rfft(u, n=2 * L, norm="ortho") * kf, n=2 * L, norm="ortho")[..., :L]
        z = torch.fft.ifft(torch.fft.fft(u, dim=1), dim=1).real
        spec = torch.fft.fft2(x).abs()
        phase = torch.angle(torch.fft.rfft(u)).sin()
        stft = torch.stft(wave * u.mean(), n_fft=8, hop_length=4, window=torch.hann_window(8, dtype=wave.dtype),
                          return_complex=True).abs()
        return (y ** 2).mean() + (z * u).mean() + spec.mean() + phase.mean() + stft.pow(2).mean()


def test_fno_matches_torch_in_float64():
    """Complex parameters (AdamW on their real view), ``rfft2``/``irfft2``, complex ``einsum``
    and strided writes into a complex spectrum, exact to float64 rounding."""
    model = FNO2d(cdtype=torch.cdouble)
    batch = (torch.randn(2, 8, 8, 3, generator=_gen(14)), torch.randn(2, 8, 8, 1, generator=_gen(15)))
    graph, meta = assert_step_matches(model, batch, lambda m, b: F.mse_loss(m(b[0]), b[1]), rtol=1e-9, fake=True)
    assert graph.nodes[meta["params"]["conv0.weights1"]].type.shape == (6, 6, 3, 3, 2)
    assert sum(1 for n in graph.nodes if "fft" in n.attrs) >= 16


def test_fno_as_published_in_cfloat_traces_in_float32():
    """The authors' ``torch.cfloat`` weights in a float32 step: each complex64 parameter is one
    float32 IR input ``[..., 2]`` (its AdamW moments too), the FFTs run in float32."""
    batch = (torch.randn(2, 8, 8, 3), torch.randn(2, 8, 8, 1))
    graph, meta = torch_frontend.trace_step(FNO2d(), batch, lambda m, b: F.mse_loss(m(b[0]), b[1]))
    w = graph.nodes[meta["params"]["conv1.weights2"]].type
    assert (w.shape, w.dtype) == ((6, 6, 3, 3, 2), "float32")
    assert graph.nodes[meta["opt_state"]["conv1.weights2.exp_avg_sq"]].type == w
    assert {n.type.dtype for n in graph.nodes if "fft" in n.attrs} == {"float32"}


def test_fft_family_matches_torch_in_float64():
    batch = (torch.randn(2, 6, 4, generator=_gen(18)), torch.randn(2, 32, generator=_gen(19)))
    assert_step_matches(_SpectralOps(), batch, lambda m, b: m(*b), rtol=1e-9)


def test_fft_is_priced_as_cufft_not_as_a_dense_product():
    """A Hyena-sized long convolution (rfft/irfft of 2 x 4096 over 8 x 64 channels): each FFT
    node is priced at its share of a bandwidth-bound cuFFT transform, over ten times below the
    dense product's FLOPs."""
    from sftctl.compiler.fft import fft_bytes_flops, fft_time_s
    from sftctl.compiler.fusion import fuse
    from sftctl.compiler.step import cost_kernels
    from sftctl.compiler.target import load_target

    class LongConv(nn.Module):
        def __init__(self, d=64, L=4096):
            super().__init__()
            self.k = nn.Parameter(torch.randn(d, L))

        def forward(self, u):
            L = u.shape[-1]
            return torch.fft.irfft(torch.fft.rfft(u, n=2 * L) * torch.fft.rfft(self.k, n=2 * L), n=2 * L)[..., :L]

    with torch.device("meta"):
        model = LongConv()
    graph, _ = torch_frontend.trace_step(model, torch.empty(8, 64, 4096, device="meta"), lambda m, u: m(u).mean())
    target = load_target("H100")
    kernels = fuse(graph)
    costs = cost_kernels(graph, kernels, target)
    ffts = [(k, p) for k, p in zip(kernels, costs.plans) if k.kind == "gemm" and "fft" in graph.nodes[k.anchor].attrs]
    assert len(ffts) >= 10
    for k, plan in ffts:
        node = graph.nodes[k.anchor]
        assert plan.time_s == pytest.approx(fft_time_s(node.attrs["fft"], node.type.dtype, target))
        _, flops = fft_bytes_flops(node.attrs["fft"], node.type.dtype)
        n = node.attrs["fft"]["n"]
        # the product as a float32 GEMM at full precision (the step's default, matmul_precision "highest")
        dense = 2.0 * node.attrs["fft"]["batch"] * n * (n // 2 + 1) / target.hw.vector_peak("float32")
        assert plan.time_s < dense / 10
    total = sum(p.time_s for _, p in ffts)
    assert 1e-6 < total < 2e-3, total


def test_randperm_draws_a_permutation():
    """``torch.randperm`` (PointNet++'s and NeRF's sampling, a shuffled batch): the interpreter's
    draw differs from torch's, so the loss is one a permutation cannot change, and the sorted
    draw must be ``arange``."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(3, 3)

        def forward(self, x):
            idx = torch.randperm(x.shape[0])
            exact = (idx.sort().values == torch.arange(x.shape[0])).sum()
            return self.w(x[idx]).pow(2).sum() + exact

    graph, _ = assert_step_matches(M(), torch.randn(9, 3, generator=_gen(20)), lambda m, x: m(x))
    assert graph.op_counts()["rng_uniform"] == 1


class _Special(nn.Module):
    """Beta / Gamma likelihood terms: ``lgamma``, ``digamma`` and ``polygamma(1, .)`` of positive
    concentrations and of arguments of any sign (the reflection formula), with their gradients
    (``digamma``, ``polygamma(1|2, .)``), and ``erfinv`` (a probit link)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 6)

    def forward(self, x):
        h = self.w(x)
        a = F.softplus(h) + 0.05
        b = h * 3
        lg = torch.lgamma(a) + 0.1 * torch.lgamma(b)
        dg = torch.digamma(a) + 0.1 * torch.digamma(b)
        return ((lg * h).sum() + (dg ** 2).sum() + 0.1 * torch.polygamma(1, a).sum()
                + torch.erfinv(torch.tanh(h)).pow(2).sum())


class _Sampling(nn.Module):
    """Adaptive max pooling to sizes that do and do not divide the input (torch's overlapping
    bins), with indices; ``grid_sample`` bilinear and bicubic (reflection padding), whose
    backward reaches both the features and the grid (a spatial transformer)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(2, 3, 3, padding=1)
        self.loc = nn.Linear(3, 2)

    def forward(self, x, grid):
        h = self.c(x)
        p1 = F.adaptive_max_pool2d(h, (2, 3))
        p2, i2 = F.adaptive_max_pool2d(h, 3, return_indices=True)
        g = grid + 0.1 * torch.tanh(self.loc(p1.mean((2, 3))))[:, None, None, :]
        y = (F.grid_sample(h, g, align_corners=False)
             + F.grid_sample(h, g, mode="bicubic", padding_mode="reflection", align_corners=True))
        return p1.pow(2).sum() + p2.sum() + (i2.to(h.dtype) * 1e-3).sum() + y.pow(2).sum()


def test_special_functions_match_torch_in_float64():
    assert_step_matches(_Special(), torch.randn(5, 4, generator=_gen(21)), lambda m, x: m(x), rtol=1e-9)


def test_adaptive_max_pool_and_grid_sample_backward_match_torch():
    batch = (torch.randn(2, 2, 7, 5, generator=_gen(22)), torch.rand(2, 4, 3, 2, generator=_gen(23)) * 2.4 - 1.2)
    graph, _ = assert_step_matches(_Sampling(), batch, lambda m, b: m(*b), rtol=1e-9)
    assert graph.op_counts().get("scatter_add", 0) >= 2


class PINN(nn.Module):
    """A physics-informed MLP for viscous Burgers' equation (Raissi et al.'s PINNs): the
    residual ``u_t + u u_x - nu u_xx`` from ``torch.autograd.grad(..., create_graph=True)`` of
    the network with respect to its input coordinates, second order included."""

    def __init__(self, width=8, nu=0.01):
        super().__init__()
        self.nu = nu
        self.net = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                 nn.Linear(width, 1))

    def forward(self, xt, xt0, u0):
        xt = xt.clone().requires_grad_(True)
        u = self.net(xt)
        du = torch.autograd.grad(u.sum(), xt, create_graph=True)[0]
        u_x, u_t = du[:, :1], du[:, 1:]
        u_xx = torch.autograd.grad(u_x.sum(), xt, create_graph=True)[0][:, :1]
        residual = u_t + u * u_x - self.nu * u_xx
        return residual.pow(2).mean() + (self.net(xt0) - u0).pow(2).mean()


class _InputGrad(nn.Module):
    """The batch handed over already requiring grad (the collocation points of a PINN script)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1))

    def forward(self, xt):
        u = self.net(xt)
        du, = torch.autograd.grad(u.sum(), xt, create_graph=True)
        return (du[:, 1:] + u * du[:, :1]).pow(2).mean()


class _FuncTransforms(nn.Module):
    """``torch.func`` inside the step: per-sample Jacobians (``vmap(jacrev)``), ``jacfwd``,
    per-sample input gradients (``vmap(grad)``) and a plain ``vmap``."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2))

    def forward(self, x):
        f = torch.func
        jac = f.vmap(f.jacrev(self.net))(x)                                  # B, 2, 3
        jf = f.jacfwd(self.net)(x[0])
        gx = f.vmap(f.grad(lambda xi: self.net(xi).pow(2).sum()))(x)
        return jac.pow(2).sum() + jf.sum() + gx.pow(2).mean() + f.vmap(lambda xi: self.net(xi).sum())(x).sum()


def test_pinn_with_second_order_input_gradients_matches_torch():
    batch = (torch.rand(6, 2, generator=_gen(24)), torch.rand(3, 2, generator=_gen(25)), torch.randn(3, 1, generator=_gen(26)))
    assert_step_matches(PINN(), batch, lambda m, b: m(*b), rtol=1e-9)


def test_a_batch_that_requires_grad_keeps_it():
    xt = torch.rand(5, 2, generator=_gen(27)).requires_grad_(True)
    assert_step_matches(_InputGrad(), xt, lambda m, x: m(x), rtol=1e-9)


def test_torch_func_transforms_inside_the_step_match_torch():
    """``jacrev`` builds its basis with ``zeros(n, n).diagonal().fill_(1)``: the write through the
    diagonal view reaches its base (it was lost before, giving a zero Jacobian)."""
    assert_step_matches(_FuncTransforms(), torch.randn(4, 3, generator=_gen(28)), lambda m, x: m(x), rtol=1e-9)


def test_in_place_writes_into_chunks_and_diagonals_reach_their_base():
    """A write into a piece of ``chunk`` / ``unbind`` or a ``diagonal`` reaches the tensor it is a
    view of (before, such a write was lost without a word)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 6, generator=_gen(29)))

        def forward(self, x):
            c = x.detach().clone()
            a, b = c.chunk(2, dim=1)
            a.mul_(3.0)
            r0, r1, r2, r3 = c.unbind(0)
            r2.add_(1.5)
            d = torch.zeros(4, 6, dtype=x.dtype)
            d.diagonal(offset=1).fill_(2.0)
            return ((c + d) * self.w).pow(2).sum()

    assert_step_matches(M(), torch.randn(4, 6, generator=_gen(30)), lambda m, x: m(x))


class _NanChecks(nn.Module):
    """NaN / inf guards as research code writes them in a forward."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, x):
        h = self.w(x)
        if torch.isnan(h).any():
            raise ValueError("NaN in the hidden state")
        if not torch.isfinite(h).all():
            h = torch.zeros_like(h)
        assert not torch.isinf(h).any(), "inf"
        loss = h.pow(2).mean()
        assert torch.isfinite(loss)
        return loss


def test_nan_checks_in_the_forward_are_taken_as_on_finite_data():
    graph, meta = assert_step_matches(_NanChecks(), torch.randn(3, 4, generator=_gen(31)), lambda m, x: m(x), fake=True)
    line = inspect.getsourcelines(_NanChecks.forward)[1] + 2
    said = meta["assumptions"]
    assert len(said) == 4 and f"test_models_round3.py:{line} (forward): taken as False" in said[0], said


def test_a_data_dependent_branch_is_taken_as_on_the_traced_batch():
    """Any other ``if tensor:`` takes the branch the traced batch takes (the assumption names the
    line; :mod:`sftctl.compiler.frontends.torch.branches`); a model on ``meta`` has no value to
    take, so the trace stops naming the line."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(4, 4)

        def forward(self, x):
            h = self.w(x)
            if (h > 0).any():
                h = h * 2
            return h.sum()

    line = inspect.getsourcelines(M.forward)[1] + 2
    _, meta = assert_step_matches(M(), torch.randn(3, 4, generator=_gen(35)), lambda m, x: m(x), fake=True)
    assert meta["assumptions"] == [f"data-dependent branch at {__file__}:{line} (forward): taken as True on the "
                                   "traced batch (another batch may take the other branch)"], meta["assumptions"]
    with torch.device("meta"):
        model = M()
    with pytest.raises(NotImplementedError, match="test_models_round3.py:[0-9]+ \\(forward\\) needs a tensor's value"):
        torch_frontend.trace_step(model, torch.randn(3, 4), lambda m, x: m(x))


class _GaussianProcess(nn.Module):
    """A GP's marginal likelihood on learned features (deep kernel learning): ``cholesky`` of the
    RBF kernel plus noise, ``cholesky_solve``, triangular solves from both sides and the upper
    factor, the log-determinant from the factor's diagonal."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(2, 3, bias=False)  # a bias cancels in pairwise distances: its gradient is 0
        self.log_ls = nn.Parameter(torch.zeros(()))
        self.log_noise = nn.Parameter(torch.tensor(-1.0))

    def forward(self, x, y):
        h = self.f(x)
        d = (h[:, None, :] - h[None, :, :]).pow(2).sum(-1)
        K = torch.exp(-0.5 * d / self.log_ls.exp() ** 2) + self.log_noise.exp() * torch.eye(x.shape[0], dtype=x.dtype)
        L = torch.linalg.cholesky(K)
        alpha = torch.cholesky_solve(y[:, None], L)
        z = torch.linalg.solve_triangular(L, y[:, None], upper=False)
        w = torch.linalg.solve_triangular(torch.linalg.cholesky(K, upper=True), y[:, None], upper=True)
        v = torch.linalg.solve_triangular(L, y[None, :], upper=False, left=False)
        return (0.5 * (y[:, None] * alpha).sum() + L.diagonal().log().sum() + z.pow(2).sum() + w.pow(2).sum()
                + v.pow(2).sum())


def test_cholesky_and_triangular_solves_match_torch_in_float64():
    batch = (torch.randn(5, 2, generator=_gen(32)), torch.randn(5, generator=_gen(33)))
    assert_step_matches(_GaussianProcess(), batch, lambda m, b: m(*b), rtol=1e-9)


def test_jax_stack_and_its_transpose_match_jax_in_float64():
    """JAX's ``stack`` primitive (``jnp.stack`` in newer JAX) and ``unstack`` (its transpose, in
    the gradient), through the JAX frontend and the float64 interpreter."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    def loss(p, x):
        h = x @ p["w"]
        return jnp.sum(jnp.stack([h, h * 2, jnp.tanh(h)], axis=1) ** 2 * jnp.arange(3.0)[None, :, None])

    _assert_jax_step_matches(jax, loss, seed=34, rtol=1e-12)


def _assert_jax_step_matches(jax, loss, *, seed: int, rtol: float) -> None:
    """``loss(p, x)`` (``p = {"w": [3, 4]}``, ``x`` [2, 3], random from ``seed``) traced by the JAX
    frontend and run by the float64 interpreter: loss and ``w``'s gradient (read back from
    AdamW's first moment: ``2 m'`` with ``beta1 = 0.5``) against JAX's in float64 within ``rtol``."""
    import jax.numpy as jnp
    import numpy as np

    from sftctl.compiler import interpreter
    from sftctl.compiler.frontends import jax as jax_frontend

    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        rng = np.random.default_rng(seed)
        params, x = {"w": jnp.asarray(rng.normal(size=(3, 4)))}, jnp.asarray(rng.normal(size=(2, 3)))
        graph, meta = jax_frontend.trace_step(loss, params, x, weight_decay=0.0, betas=(0.5, 0.999))
        feed = {meta["params"]["w"]: np.asarray(params["w"]), meta["step"]: 1.0, meta["batch"][0]: np.asarray(x)}
        for i in meta["opt_state"].values():
            feed[i] = np.zeros(graph.nodes[i].type.shape)
        out = dict(zip(graph.output_roles, interpreter.run(graph, feed, dtype="float64")))
        np.testing.assert_allclose(float(out["loss"]), float(loss(params, x)), rtol=rtol)
        np.testing.assert_allclose(2 * out["opt_state:w.exp_avg"], np.asarray(jax.grad(loss)(params, x)["w"]), rtol=rtol)
    finally:
        jax.config.update("jax_enable_x64", previous)


def test_jax_erf_inv_matches_jax_and_typed_key_normals_trace():
    """``lax.erf_inv`` (Giles's approximation refined by Newton) against JAX in float64, and a
    step that splits a typed key and draws ``jax.random.normal`` (inverse-CDF sampling through
    ``erf_inv``) traces: its draws are the interpreter's, as every random op's in the IR."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from sftctl.compiler.frontends import jax as jax_frontend

    def noisy(p, x):
        h = x @ p["w"]
        k1, k2 = jax.random.split(jax.random.key(0))
        return jnp.sum(jax.random.uniform(k1, h.shape) * h + jax.random.normal(k2, h.shape) * h)

    graph, _ = jax_frontend.trace_step(noisy, {"w": jnp.ones((3, 4))}, jnp.ones((2, 3)))
    assert graph.op_counts().get("erf", 0) >= 2

    def loss(p, x):
        return jnp.sum(jax.lax.erf_inv(jnp.tanh(x @ p["w"])) ** 2)

    _assert_jax_step_matches(jax, loss, seed=35, rtol=1e-10)


_PRINTING_MODEL = '''
import torch
print("importing the model")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        print("forward", tuple(x.shape))
        return self.lin(x)


def build(batch_size=2, dtype="float32"):
    print("building")
    return Net(), torch.randn(batch_size, 8), lambda m, x: m(x).pow(2).mean()
'''


def test_user_prints_go_to_stderr_while_tracing(tmp_path, capsys):
    (tmp_path / "model.py").write_text(_PRINTING_MODEL)
    graph, _ = torch_frontend.trace_entrypoint("model.py:build", str(tmp_path), batch_size=2)
    out, err = capsys.readouterr()
    assert out == ""
    assert "importing the model" in err and "building" in err and "forward (2, 8)" in err
    assert graph.op_counts()["dot_general"] >= 1
