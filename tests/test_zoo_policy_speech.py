"""The zoo's issue-43 robotics and speech families, written as their authors publish them
(``torch.nn`` only), float64 loss and gradients from the interpreter against torch's at rtol 1e-9
(random inputs):

* a diffusion policy (Chi et al., "Diffusion Policy", ``ConditionalUnet1D``): a 1-D conv U-Net
  over the action horizon, Conv1d + GroupNorm + Mish blocks, FiLM conditioning (a per-channel
  scale and bias from the observation features and the sinusoidal diffusion-step embedding),
  strided-conv downsampling and transposed-conv upsampling with skips; the DDPM epsilon loss
  (the noise and timesteps are batch inputs so torch and the interpreter see the same draw);
* a Conformer encoder (Gulati et al.; torchaudio's ``Conformer`` layout): half-step feed-forward
  modules, multi-head self-attention with a key padding mask, the convolution module (pointwise
  conv, GLU, depthwise conv, BatchNorm, SiLU, pointwise conv), a final LayerNorm, per-frame
  log-probabilities and CTC.
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


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        half = self.dim // 2
        emb = math.log(10000) / (half - 1)
        emb = torch.exp(torch.arange(half, device=x.device, dtype=x.dtype) * -emb)
        emb = x[:, None] * emb[None, :]
        return torch.cat((emb.sin(), emb.cos()), dim=-1)


class Conv1dBlock(nn.Module):
    def __init__(self, cin, cout, k, groups=2):
        super().__init__()
        self.block = nn.Sequential(nn.Conv1d(cin, cout, k, padding=k // 2), nn.GroupNorm(groups, cout), nn.Mish())

    def forward(self, x):
        return self.block(x)


class ConditionalResidualBlock1D(nn.Module):
    """Two conv blocks; FiLM between them: ``scale * h + bias`` from the condition."""

    def __init__(self, cin, cout, cond_dim, k=3):
        super().__init__()
        self.blocks = nn.ModuleList([Conv1dBlock(cin, cout, k), Conv1dBlock(cout, cout, k)])
        self.out_channels = cout
        self.cond_encoder = nn.Sequential(nn.Mish(), nn.Linear(cond_dim, cout * 2), nn.Unflatten(-1, (-1, 1)))
        self.residual_conv = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, cond):
        out = self.blocks[0](x)
        embed = self.cond_encoder(cond).reshape(cond.shape[0], 2, self.out_channels, 1)
        out = embed[:, 0] * out + embed[:, 1]
        out = self.blocks[1](out)
        return out + self.residual_conv(x)


class ConditionalUnet1D(nn.Module):
    def __init__(self, action_dim=3, obs_dim=5, step_dim=8, dims=(8, 16)):
        super().__init__()
        self.step_encoder = nn.Sequential(SinusoidalPosEmb(step_dim), nn.Linear(step_dim, step_dim * 4), nn.Mish(),
                                          nn.Linear(step_dim * 4, step_dim))
        cond_dim = step_dim + obs_dim
        all_dims = [action_dim, *dims]
        pairs = list(zip(all_dims[:-1], all_dims[1:]))
        self.down = nn.ModuleList([nn.ModuleList([ConditionalResidualBlock1D(a, b, cond_dim),
                                                  nn.Conv1d(b, b, 3, 2, 1) if i < len(pairs) - 1 else nn.Identity()])
                                   for i, (a, b) in enumerate(pairs)])
        self.mid = ConditionalResidualBlock1D(dims[-1], dims[-1], cond_dim)
        self.up = nn.ModuleList([nn.ModuleList([ConditionalResidualBlock1D(b * 2, a, cond_dim),
                                                nn.ConvTranspose1d(a, a, 4, 2, 1)])
                                 for a, b in reversed(pairs[1:])])
        self.final = nn.Sequential(Conv1dBlock(dims[0], dims[0], 3), nn.Conv1d(dims[0], action_dim, 1))

    def forward(self, sample, timestep, obs):
        x = sample.transpose(1, 2)                                   # B, action_dim, T
        cond = torch.cat([self.step_encoder(timestep), obs], dim=-1)
        skips = []
        for block, down in self.down:
            x = block(x, cond)
            skips.append(x)
            x = down(x)
        x = self.mid(x, cond)
        for block, up in self.up:
            x = block(torch.cat([x, skips.pop()], dim=1), cond)
            x = up(x)
        return self.final(x).transpose(1, 2)


class DiffusionPolicy(nn.Module):
    """DDPM training step: noise the expert action chunk at a timestep, predict the noise."""

    def __init__(self, steps=100):
        super().__init__()
        self.net = ConditionalUnet1D()
        betas = torch.linspace(1e-4, 2e-2, steps, dtype=torch.float64)
        self.register_buffer("alphas_cumprod", torch.cumprod(1 - betas, 0))

    def forward(self, actions, obs, noise, t):
        a = self.alphas_cumprod[t].to(actions.dtype)[:, None, None]
        noisy = a.sqrt() * actions + (1 - a).sqrt() * noise
        return F.mse_loss(self.net(noisy, t.to(actions.dtype), obs), noise)


class ConformerLayer(nn.Module):
    def __init__(self, d=16, heads=2, ffn=32, kernel=5):
        super().__init__()
        self.ffn1 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, ffn), nn.SiLU(), nn.Linear(ffn, d))
        self.attn_norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.conv_norm = nn.LayerNorm(d)
        self.pointwise1 = nn.Conv1d(d, 2 * d, 1)
        self.depthwise = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d, bias=False)  # BatchNorm follows
        self.bn = nn.BatchNorm1d(d)
        self.pointwise2 = nn.Conv1d(d, d, 1)
        self.ffn2 = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, ffn), nn.SiLU(), nn.Linear(ffn, d))
        self.final_norm = nn.LayerNorm(d)

    def forward(self, x, pad):
        x = x + 0.5 * self.ffn1(x)
        h = self.attn_norm(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        h = self.conv_norm(x).transpose(1, 2)
        h = F.glu(self.pointwise1(h), dim=1)
        h = self.pointwise2(F.silu(self.bn(self.depthwise(h))))
        x = x + h.transpose(1, 2)
        x = x + 0.5 * self.ffn2(x)
        return self.final_norm(x)


class ConformerCTC(nn.Module):
    def __init__(self, feats=6, d=16, vocab=7, layers=2):
        super().__init__()
        self.subsample = nn.Conv1d(feats, d, 3, stride=2, padding=1)
        self.layers = nn.ModuleList(ConformerLayer(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, x, x_lens, targets, target_lens):
        h = self.subsample(x.transpose(1, 2)).transpose(1, 2)             # B, T', d
        out_lens = torch.div(x_lens + 1, 2, rounding_mode="floor")
        pad = torch.arange(h.shape[1])[None, :] >= out_lens[:, None]
        for layer in self.layers:
            h = layer(h, pad)
        lp = self.head(h).log_softmax(-1).transpose(0, 1)
        return F.ctc_loss(lp, targets, out_lens, target_lens, blank=0)


def _diffusion_policy():
    g = _gen(40)
    return DiffusionPolicy(), (torch.randn(3, 8, 3, generator=g), torch.randn(3, 5, generator=g),
                               torch.randn(3, 8, 3, generator=g), torch.randint(0, 100, (3,), generator=g))


def _conformer():
    g = _gen(41)
    target_lens = torch.tensor([3, 2])
    return ConformerCTC(), (torch.randn(2, 12, 6, generator=g), torch.tensor([12, 9]),
                            torch.randint(1, 7, (2, 3), generator=g), target_lens)


FAMILIES = {"diffusion_policy": _diffusion_policy, "conformer": _conformer}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_policy_and_speech_family_matches_torch_in_float64(name):
    torch.manual_seed(0)
    model, batch = FAMILIES[name]()
    model.train()
    graph, _ = assert_step_matches(model, batch, lambda m, b: m(*b), fake=True, rtol=1e-9)
    assert graph.op_counts().get("conv", 0) >= 4
