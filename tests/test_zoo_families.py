"""More families in the zoo (issue 22), each a tiny model written the way its community writes
it, its float64 loss and gradients from the interpreter checked against torch's:

* diffusion UNet: GroupNorm, sinusoidal time embedding, down/up sampling with a skip, noise drawn
  from a schedule held as a plain tensor attribute (diffusers' ``alphas_cumprod``);
* CLIP-style contrastive: text transformer pooled at the end-of-text token (``argmax`` of the ids),
  patch-conv image tower, symmetric InfoNCE with a learned temperature;
* speech: a strided conv1d front end (wav2vec2 / Whisper) into a transformer encoder, CTC-free
  frame classification;
* ConvNeXt-ish: depthwise 7x7, LayerNorm over channels, inverted MLP, layer scale and drop_path
  (stochastic depth: ``floor(keep + rand)``);
* Mamba-ish: a selective scan (input-dependent step, decay and projections) unrolled over time,
  with a gated depthwise causal conv;
* RNNs: a 2-layer LSTM language model with a tied decoder, and a bidirectional GRU classifier
  whose label smoothing indexes ``torch.eye`` (both trace through ATen's native RNN: an input
  projection GEMM, then a recurrent GEMM and the gates per step, as cuDNN runs them);
* CTC speech recognition: conv front end, GRU, ``F.ctc_loss`` with per-utterance lengths,
  concatenated targets and ``zero_infinity``;
* DLRM-style recommender: ``nn.EmbeddingBag`` (sum with per-sample weights, mean, an empty bag),
  a bottom MLP, pairwise dot interactions and a top MLP on a click label.
(GNN with a train mask: tests/test_data_dependent.py; MoE: tests/test_zoo_moe.py.)
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = nn.functional

from stepcheck import assert_step_matches  # noqa: E402


def _gen(seed):
    return torch.Generator().manual_seed(seed)


class _ResBlock(nn.Module):
    def __init__(self, c_in, c_out, t_dim):
        super().__init__()
        self.n1 = nn.GroupNorm(2, c_in)
        self.c1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.t = nn.Linear(t_dim, c_out)
        self.n2 = nn.GroupNorm(2, c_out)
        self.c2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x, temb):
        h = self.c1(F.silu(self.n1(x)))
        h = h + self.t(F.silu(temb))[:, :, None, None]
        h = self.c2(F.silu(self.n2(h)))
        return h + self.skip(x)


class TinyUNet(nn.Module):
    def __init__(self, c=8, t_dim=16, steps=50):
        super().__init__()
        self.t_dim = t_dim
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.down = _ResBlock(c, 2 * c, t_dim)
        self.pool = nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1)
        self.mid = _ResBlock(2 * c, 2 * c, t_dim)
        self.up = _ResBlock(4 * c, c, t_dim)
        self.out = nn.Conv2d(c, 3, 3, padding=1)
        betas = torch.linspace(1e-4, 0.02, steps, dtype=torch.float64)
        self.alphas_cumprod = torch.cumprod(1 - betas, 0)  # a plain attribute, as diffusers keeps it

    def embed(self, t):
        half = self.t_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half).to(self.inp.weight.dtype)
        args = t[:, None].to(freqs.dtype) * freqs[None]
        return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)

    def forward(self, x0, t, noise):
        a = self.alphas_cumprod[t].to(x0.dtype)[:, None, None, None]
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        temb = self.embed(t)
        h0 = self.inp(xt)
        h1 = self.down(h0, temb)
        h2 = self.mid(self.pool(h1), temb)
        h2 = F.interpolate(h2, scale_factor=2.0, mode="nearest")
        h = self.up(torch.cat([h2, h1], dim=1), temb)
        return F.mse_loss(self.out(F.silu(h)), noise)


def _unet():
    g = _gen(1)
    return TinyUNet(), (torch.randn(2, 3, 8, 8, generator=g), torch.tensor([3, 41]), torch.randn(2, 3, 8, 8, generator=g))


class TinyCLIP(nn.Module):
    def __init__(self, vocab=50, d=16, eot=49):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(8, d) * 0.02)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.GELU(approximate="tanh"), nn.Linear(32, d))
        self.ln = nn.LayerNorm(d)
        self.patch = nn.Conv2d(3, d, 4, stride=4)
        self.vis_ln = nn.LayerNorm(d)
        self.t_proj = nn.Linear(d, 12, bias=False)
        self.v_proj = nn.Linear(d, 12, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, ids, images):
        B, L = ids.shape
        h = self.tok(ids) + self.pos[:L]
        q, k, v = self.qkv(self.ln1(h)).reshape(B, L, 3, 2, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # CLIP's causal text mask
        h = h + self.proj(a.transpose(1, 2).reshape(B, L, -1))
        h = self.ln(h + self.mlp(self.ln2(h)))
        text = h[torch.arange(h.shape[0]), ids.argmax(dim=-1)]  # end-of-text token: the largest id
        v = self.patch(images).flatten(2).transpose(1, 2)
        img = self.vis_ln(v.mean(1))
        t = F.normalize(self.t_proj(text), dim=-1)
        i = F.normalize(self.v_proj(img), dim=-1)
        logits = self.logit_scale.exp() * i @ t.T
        labels = torch.arange(ids.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _clip():
    g = _gen(2)
    ids = torch.randint(1, 40, (3, 6), generator=g)
    ids[0, 4], ids[1, 5], ids[2, 2] = 49, 49, 49
    return TinyCLIP(), (ids, torch.randn(3, 3, 8, 8, generator=g))


class TinySpeech(nn.Module):
    def __init__(self, d=16, classes=7):
        super().__init__()
        self.fe = nn.Sequential(nn.Conv1d(1, d, 10, stride=5), nn.GELU(), nn.Conv1d(d, d, 3, stride=2), nn.GELU())
        self.norm = nn.LayerNorm(d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True, activation="gelu")
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, wav, frame_labels):
        h = self.fe(wav[:, None, :]).transpose(1, 2)
        h = self.enc(self.norm(h))
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), frame_labels.reshape(-1))


def _speech():
    g = _gen(3)
    wav = torch.randn(2, 120, generator=g)
    frames = ((120 - 10) // 5 + 1 - 3) // 2 + 1
    return TinySpeech(), (wav, torch.randint(0, 7, (2, frames), generator=g))


def drop_path(x, p: float, training: bool):
    """timm's stochastic depth."""
    if p == 0.0 or not training:
        return x
    keep = 1 - p
    mask = (keep + torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype)).floor_()
    return x.div(keep) * mask


class _ConvNeXtBlock(nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d, eps=1e-6)
        self.pw1 = nn.Linear(d, 4 * d)
        self.pw2 = nn.Linear(4 * d, d)
        self.gamma = nn.Parameter(1e-1 * torch.ones(d))
        self.p = p

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.pw2(F.gelu(self.pw1(self.norm(h)))) * self.gamma
        return x + drop_path(h.permute(0, 3, 1, 2), self.p, self.training)


class TinyConvNeXt(nn.Module):
    def __init__(self, d=8, classes=5, p=0.0):
        super().__init__()
        self.stem = nn.Conv2d(3, d, 4, stride=4)
        self.blocks = nn.Sequential(_ConvNeXtBlock(d, p), _ConvNeXtBlock(d, p))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, y):
        h = self.blocks(self.stem(x)).mean((-2, -1))
        return F.cross_entropy(self.head(self.norm(h)), y)


def _convnext():
    g = _gen(4)
    return TinyConvNeXt(), (torch.randn(3, 3, 16, 16, generator=g), torch.tensor([0, 3, 4]))


class TinyMamba(nn.Module):
    """One selective-state-space block (Mamba's S6) over a short sequence, scanned step by step."""

    def __init__(self, vocab=30, d=8, n=4, conv=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.in_proj = nn.Linear(d, 2 * 2 * d, bias=False)
        self.conv = nn.Conv1d(2 * d, 2 * d, conv, groups=2 * d, padding=conv - 1)
        self.x_proj = nn.Linear(2 * d, 1 + 2 * n, bias=False)
        self.dt_proj = nn.Linear(1, 2 * d)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(2 * d, 1))
        self.D = nn.Parameter(torch.ones(2 * d))
        self.out_proj = nn.Linear(2 * d, d, bias=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.n = n

    def forward(self, ids):
        x = self.emb(ids)
        B, L, _ = x.shape
        xz = self.in_proj(x)
        u, z = xz.chunk(2, dim=-1)
        u = F.silu(self.conv(u.transpose(1, 2))[..., :L].transpose(1, 2))
        dt_b_c = self.x_proj(u)
        dt, Bm, Cm = dt_b_c.split([1, self.n, self.n], dim=-1)
        dt = F.softplus(self.dt_proj(dt))                       # B, L, 2d
        A = -torch.exp(self.A_log)                              # 2d, n
        h = u.new_zeros(B, u.shape[-1], self.n)
        ys = []
        for t in range(L):
            dA = torch.exp(dt[:, t, :, None] * A)
            h = dA * h + dt[:, t, :, None] * Bm[:, t, None, :] * u[:, t, :, None]
            ys.append((h * Cm[:, t, None, :]).sum(-1) + self.D * u[:, t])
        y = torch.stack(ys, dim=1) * F.silu(z)
        logits = self.head(self.norm(self.out_proj(y) + x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _mamba():
    return TinyMamba(), torch.randint(0, 30, (2, 7), generator=_gen(5))


class TinyLSTMLM(nn.Module):
    """A word-level LSTM language model as the PyTorch examples write it: embedding, dropout, a
    2-layer ``nn.LSTM`` (batch_first), tied decoder."""

    def __init__(self, vocab=30, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(0.0)
        self.rnn = nn.LSTM(d, d, num_layers=2, batch_first=True)
        self.dec = nn.Linear(d, vocab)
        self.dec.weight = self.emb.weight

    def forward(self, ids):
        out, _ = self.rnn(self.drop(self.emb(ids)))
        logits = self.dec(out)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class TinyBiGRU(nn.Module):
    """A bidirectional GRU sequence classifier with label smoothing built from ``torch.eye``
    (one-hot rows: a uint8 ``arange`` compared inside torch's decomposition)."""

    def __init__(self, d_in=6, d=8, classes=3):
        super().__init__()
        self.rnn = nn.GRU(d_in, d, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * d, classes)
        self.classes = classes

    def forward(self, x, y):
        out, h = self.rnn(x)
        logits = self.head(torch.cat([h[0], h[1]], dim=-1))
        target = torch.eye(self.classes, dtype=x.dtype, device=x.device)[y] * 0.9 + 0.1 / self.classes
        return -(target * F.log_softmax(logits, -1)).sum(-1).mean()


class TinyDLRM(nn.Module):
    """A DLRM-style recommender: sparse features pooled by ``nn.EmbeddingBag`` (sum, with
    per-sample weights, and mean), dense features through an MLP, pairwise dot interactions,
    a top MLP and BCE on a click label."""

    def __init__(self, vocab=(20, 12), d=8, dense=5):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(vocab[0], d, mode="sum"), nn.EmbeddingBag(vocab[1], d, mode="mean")])
        self.bottom = nn.Sequential(nn.Linear(dense, 16), nn.ReLU(), nn.Linear(16, d))
        self.top = nn.Sequential(nn.Linear(d + 3, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense, ids0, off0, w0, ids1, off1, label):
        feats = [self.bottom(dense), self.bags[0](ids0, off0, per_sample_weights=w0), self.bags[1](ids1, off1)]
        z = torch.stack(feats, dim=1)                                   # B, 3, d
        inter = torch.bmm(z, z.transpose(1, 2))
        i, j = torch.triu_indices(3, 3, offset=1)
        x = torch.cat([feats[0], inter[:, i, j]], dim=1)
        return F.binary_cross_entropy_with_logits(self.top(x).squeeze(1), label)


def _dlrm():
    g = _gen(9)
    return TinyDLRM(), (torch.randn(4, 5, generator=g), torch.randint(0, 20, (9,), generator=g),
                        torch.tensor([0, 2, 5, 5]), torch.rand(9, generator=g),
                        torch.randint(0, 12, (6,), generator=g), torch.tensor([0, 1, 3, 4]),
                        torch.randint(0, 2, (4,), generator=g).float())


class TinyCTC(nn.Module):
    """A CTC speech recognizer as wav2vec2-for-CTC / Conformer-CTC recipes train it: a strided
    conv front end over features, a GRU, per-frame log-probabilities and ``F.ctc_loss`` with
    per-utterance input and target lengths (tensors), concatenated targets and
    ``zero_infinity`` (an utterance too short for its transcript)."""

    def __init__(self, feats=6, d=8, vocab=5):
        super().__init__()
        self.conv = nn.Conv1d(feats, d, 3, stride=2, padding=1)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, x, x_lens, targets, target_lens):
        h = F.gelu(self.conv(x.transpose(1, 2))).transpose(1, 2)        # B, T/2, d
        h, _ = self.rnn(h)
        lp = self.head(h).log_softmax(-1).transpose(0, 1)                # T', B, vocab
        out_lens = torch.div(x_lens + 1, 2, rounding_mode="floor")
        return F.ctc_loss(lp, targets, out_lens, target_lens, blank=0, zero_infinity=True)


def _ctc():
    g = _gen(10)
    target_lens = torch.tensor([3, 1, 4])                     # the last cannot fit 3 frames: inf -> 0
    return TinyCTC(), (torch.randn(3, 12, 6, generator=g), torch.tensor([12, 9, 5]),
                       torch.randint(1, 5, (int(target_lens.sum()),), generator=g), target_lens)


def _lstm():
    return TinyLSTMLM(), torch.randint(0, 30, (2, 6), generator=_gen(6))


def _gru():
    return TinyBiGRU(), (torch.randn(3, 5, 6, generator=_gen(7)), torch.randint(0, 3, (3,), generator=_gen(8)))


FAMILIES = {"unet": _unet, "clip": _clip, "speech": _speech, "convnext": _convnext, "mamba": _mamba,
            "lstm": _lstm, "gru": _gru, "dlrm": _dlrm, "ctc": _ctc}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_torch_in_float64(name):
    torch.manual_seed(0)
    model, batch = FAMILIES[name]()
    model.train()
    graph, _ = assert_step_matches(model, batch, lambda m, b: m(*b) if isinstance(b, tuple) else m(b), fake=True)
    assert graph.op_counts().get("dot_general", 0) + graph.op_counts().get("conv", 0) > 0


def test_drop_path_traces_with_its_random_keep_mask():
    """Stochastic depth on (ConvNeXt / Swin / DeiT recipes): ``floor(keep + rand)`` per sample."""
    from sftctl.compiler.frontends import torch as torch_frontend

    model = TinyConvNeXt(p=0.2).train()
    _, batch = _convnext()
    graph, _ = torch_frontend.trace_step(model, batch, lambda m, b: m(*b))
    ops = graph.op_counts()
    assert ops.get("rng_uniform", 0) == 2 and ops.get("floor", 0) == 2, ops
