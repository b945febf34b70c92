"""The zoo grows by issue 43's families beyond language models, each written the way its authors
publish it (``torch.nn`` only), its float64 loss and gradients from the interpreter checked against
torch's at rtol 1e-9 (random inputs):

* NeRF (nerf-pytorch): positional encoding, an MLP with a skip, view-dependent colour, stratified
  samples along rays, alpha compositing with an exclusive ``cumprod`` (the stratification noise
  is a batch input here so torch and the interpreter see the same draw
  drawn in the step with
  ``torch.rand``, as the model does without it, it is an ``rng_uniform``);
* PointNet++ (Pointnet_Pointnet2_pytorch, SSG): farthest point sampling in a Python loop over
  ``argmax``, ball query by ``sort`` and boolean-mask writes, grouping by advanced indexing,
  shared MLPs with BatchNorm, max pooling (conv biases off: before BatchNorm their gradient is
  zero, rounding noise either side);
* an ACT-style policy (Action Chunking with Transformers): a CVAE encoder with a key padding mask,
  a conv backbone, ``nn.Transformer``, chunk queries, L1 on unpadded actions and the KL term (the
  reparameterization's noise a batch input);
* Swin (microsoft/Swin-Transformer): window attention with the relative position bias table,
  the shifted block's mask built by slice assignment, ``torch.roll``, patch merging by strided
  slices.
(The Fourier neural operator and the physics-informed MLP: tests/test_models_round3.py.)
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = nn.functional

from stepcheck import assert_step_matches  # noqa: E402


def _gen(seed):
    return torch.Generator().manual_seed(seed)

class TinyNeRF(nn.Module):
    """NeRF (Mildenhall et al.) as nerf-pytorch writes it: positional encoding, an MLP with a skip,
    density and view-dependent colour, stratified samples along each ray (torch.rand), alpha
    compositing with an exclusive cumprod of transmittance."""
    def __init__(self, L=4, Ld=2, W=16):
        super().__init__()
        self.L, self.Ld = L, Ld
        din, dd = 3 + 6 * L, 3 + 6 * Ld
        self.l1, self.l2 = nn.Linear(din, W), nn.Linear(W, W)
        self.l3 = nn.Linear(W + din, W)
        self.sigma, self.feat = nn.Linear(W, 1), nn.Linear(W, W)
        self.rgb = nn.Sequential(nn.Linear(W + dd, W // 2), nn.ReLU(), nn.Linear(W // 2, 3))
    @staticmethod
    def embed(x, L):
        out = [x]
        for i in range(L):
            out += [torch.sin(2.0 ** i * x), torch.cos(2.0 ** i * x)]
        return torch.cat(out, -1)
    def forward(self, rays_o, rays_d, target, u=None, near=2.0, far=6.0, n_samples=8):
        t = torch.linspace(0.0, 1.0, n_samples, dtype=rays_o.dtype)
        z = near * (1 - t) + far * t
        mids = 0.5 * (z[1:] + z[:-1])
        upper = torch.cat([mids, z[-1:]])
        lower = torch.cat([z[:1], mids])
        u = torch.rand(rays_o.shape[0], n_samples, dtype=rays_o.dtype) if u is None else u
        z = lower + (upper - lower) * u
        pts = rays_o[:, None, :] + rays_d[:, None, :] * z[..., None]               # R, S, 3
        viewdirs = rays_d / torch.norm(rays_d, dim=-1, keepdim=True)
        x = self.embed(pts, self.L)
        h = F.relu(self.l2(F.relu(self.l1(x))))
        h = F.relu(self.l3(torch.cat([h, x], -1)))
        sigma = self.sigma(h)[..., 0]
        d = self.embed(viewdirs[:, None, :].expand(pts.shape), self.Ld)
        rgb = torch.sigmoid(self.rgb(torch.cat([self.feat(h), d], -1)))
        dists = torch.cat([z[..., 1:] - z[..., :-1], torch.full_like(z[..., :1], 1e10)], -1)
        dists = dists * torch.norm(rays_d[..., None, :], dim=-1)
        alpha = 1.0 - torch.exp(-F.relu(sigma) * dists)
        T = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1.0 - alpha + 1e-10], -1), -1)[:, :-1]
        weights = alpha * T
        color = (weights[..., None] * rgb).sum(-2)
        return F.mse_loss(color, target)

def square_distance(src, dst):
    return (src[:, :, None, :] - dst[:, None, :, :]).pow(2).sum(-1)
def index_points(points, idx):
    B = points.shape[0]
    batch = torch.arange(B).view(B, *([1] * (idx.dim() - 1))).expand_as(idx)
    return points[batch, idx, :]
def farthest_point_sample(xyz, npoint):
    B, N, _ = xyz.shape
    centroids = torch.zeros(B, npoint, dtype=torch.long)
    distance = torch.ones(B, N, dtype=xyz.dtype) * 1e10
    farthest = torch.zeros(B, dtype=torch.long)
    batch_indices = torch.arange(B, dtype=torch.long)
    for i in range(npoint):
        centroids[:, i] = farthest
        centroid = xyz[batch_indices, farthest, :].view(B, 1, 3)
        dist = torch.sum((xyz - centroid) ** 2, -1)
        distance = torch.min(distance, dist)
        farthest = torch.max(distance, -1)[1]
    return centroids
def query_ball_point(radius, nsample, xyz, new_xyz):
    B, N, _ = xyz.shape
    S = new_xyz.shape[1]
    group_idx = torch.arange(N, dtype=torch.long).view(1, 1, N).repeat([B, S, 1])
    sqrdists = square_distance(new_xyz, xyz)
    group_idx[sqrdists > radius ** 2] = N
    group_idx = group_idx.sort(dim=-1)[0][:, :, :nsample]
    group_first = group_idx[:, :, 0].view(B, S, 1).repeat([1, 1, nsample])
    mask = group_idx == N
    group_idx[mask] = group_first[mask]
    return group_idx
class SetAbstraction(nn.Module):
    def __init__(self, npoint, radius, nsample, cin, mlp):
        super().__init__()
        self.npoint, self.radius, self.nsample = npoint, radius, nsample
        self.convs = nn.ModuleList()
        self.bns = nn.ModuleList()
        last = cin + 3
        for c in mlp:
            self.convs.append(nn.Conv2d(last, c, 1, bias=False))
            self.bns.append(nn.BatchNorm2d(c))
            last = c
    def forward(self, xyz, points):
        fps_idx = farthest_point_sample(xyz, self.npoint)
        new_xyz = index_points(xyz, fps_idx)
        idx = query_ball_point(self.radius, self.nsample, xyz, new_xyz)
        grouped_xyz = index_points(xyz, idx) - new_xyz[:, :, None, :]
        new_points = torch.cat([grouped_xyz, index_points(points, idx)], -1) if points is not None else grouped_xyz
        new_points = new_points.permute(0, 3, 2, 1)
        for conv, bn in zip(self.convs, self.bns):
            new_points = F.relu(bn(conv(new_points)))
        return new_xyz, torch.max(new_points, 2)[0].transpose(1, 2)
class TinyPointNet2(nn.Module):
    """PointNet++ (Qi et al.) classification, SSG, as Pointnet_Pointnet2_pytorch writes it:
    farthest point sampling, ball query by sort, grouping by gather, shared MLPs, max pooling."""
    def __init__(self, k=3):
        super().__init__()
        self.sa1 = SetAbstraction(6, 0.4, 4, 0, [8, 8])
        self.sa2 = SetAbstraction(3, 0.8, 4, 8, [16])
        self.fc = nn.Linear(16, k)
    def forward(self, xyz, label):
        l1_xyz, l1 = self.sa1(xyz, None)
        _, l2 = self.sa2(l1_xyz, l1)
        return F.cross_entropy(self.fc(l2.max(1)[0]), label)


class TinyACT(nn.Module):
    """An ACT-style policy (Zhao et al., Action Chunking with Transformers): a CVAE whose encoder
    reads [CLS, joints, action chunk], a conv backbone over the camera, a transformer encoder over
    [latent, proprio, image tokens], a decoder of chunk queries, L1 on unpadded actions + KL."""
    def __init__(self, d=16, chunk=4, joints=3, heads=2):
        super().__init__()
        self.chunk = chunk
        self.cls = nn.Embedding(1, d)
        self.enc_action, self.enc_joint = nn.Linear(joints, d), nn.Linear(joints, d)
        self.cvae = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, 32, dropout=0.0, batch_first=True), 1)
        self.latent_proj = nn.Linear(d, 2 * 4)
        self.latent_out = nn.Linear(4, d)
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(8, d, 3, stride=2, padding=1))
        self.proprio = nn.Linear(joints, d)
        self.pos = nn.Parameter(torch.randn(1, 2 + 4, d, generator=_gen(40)) * 0.02)
        self.transformer = nn.Transformer(d, heads, 1, 1, 32, dropout=0.0, batch_first=True)
        self.query = nn.Embedding(chunk, d)
        self.head = nn.Linear(d, joints)
    def forward(self, image, qpos, actions, is_pad, eps):
        B = qpos.shape[0]
        x = torch.cat([self.cls.weight.expand(B, 1, -1), self.enc_joint(qpos)[:, None], self.enc_action(actions)], 1)
        pad = torch.cat([torch.zeros(B, 2, dtype=torch.bool), is_pad], 1)
        h = self.cvae(x, src_key_padding_mask=pad)[:, 0]
        mu, logvar = self.latent_proj(h).chunk(2, -1)
        z = mu + (logvar / 2).exp() * eps
        feat = self.backbone(image).flatten(2).transpose(1, 2)                       # B, 4, d
        src = torch.cat([self.latent_out(z)[:, None], self.proprio(qpos)[:, None], feat], 1) + self.pos
        out = self.transformer(src, self.query.weight.expand(B, -1, -1))
        a_hat = self.head(out)
        l1 = (F.l1_loss(actions, a_hat, reduction="none") * ~is_pad[..., None]).mean()
        kl = (-0.5 * (1 + logvar - mu.pow(2) - logvar.exp())).sum(1).mean()
        return l1 + 10 * kl

def window_partition(x, ws):
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, C)
def window_reverse(windows, ws, H, W):
    B = int(windows.shape[0] / (H * W / ws / ws))
    x = windows.view(B, H // ws, W // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)
class WindowAttention(nn.Module):
    def __init__(self, dim, ws, heads):
        super().__init__()
        self.ws, self.heads, self.scale = ws, heads, (dim // heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * ws - 1) ** 2, heads, generator=_gen(41)) * 0.02)
        coords = torch.stack(torch.meshgrid([torch.arange(ws), torch.arange(ws)], indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        rel[:, :, 0] += ws - 1
        rel[:, :, 1] += ws - 1
        rel[:, :, 0] *= 2 * ws - 1
        self.register_buffer("relative_position_index", rel.sum(-1))
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(N, N, -1).permute(2, 0, 1)
        attn = attn + bias.unsqueeze(0)
        if mask is not None:
            nW = mask.shape[0]
            attn = attn.view(B_ // nW, nW, self.heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.heads, N, N)
        attn = attn.softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B_, N, C))
class SwinBlock(nn.Module):
    def __init__(self, dim, res, heads, ws, shift):
        super().__init__()
        self.res, self.ws, self.shift = res, ws, shift
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, ws, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        if shift:
            H, W = res
            img_mask = torch.zeros((1, H, W, 1))
            cnt = 0
            for h in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
                for w in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
                    img_mask[:, h, w, :] = cnt
                    cnt += 1
            mw = window_partition(img_mask, ws).view(-1, ws * ws)
            am = mw.unsqueeze(1) - mw.unsqueeze(2)
            am = am.masked_fill(am != 0, float(-100.0)).masked_fill(am == 0, float(0.0))
        else:
            am = None
        self.register_buffer("attn_mask", am)
    def forward(self, x):
        H, W = self.res
        B, L, C = x.shape
        sc = x
        x = self.norm1(x).view(B, H, W, C)
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        xw = window_partition(x, self.ws).view(-1, self.ws * self.ws, C)
        aw = self.attn(xw, mask=self.attn_mask).view(-1, self.ws, self.ws, C)
        x = window_reverse(aw, self.ws, H, W)
        if self.shift:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        x = sc + x.view(B, H * W, C)
        return x + self.mlp(self.norm2(x))
class PatchMerging(nn.Module):
    def __init__(self, res, dim):
        super().__init__()
        self.res = res
        self.norm, self.reduction = nn.LayerNorm(4 * dim), nn.Linear(4 * dim, 2 * dim, bias=False)
    def forward(self, x):
        H, W = self.res
        B, L, C = x.shape
        x = x.view(B, H, W, C)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1).view(B, -1, 4 * C)
        return self.reduction(self.norm(x))
class TinySwin(nn.Module):
    """Swin Transformer (Liu et al.) as microsoft/Swin-Transformer writes it: patch embedding,
    window attention with the relative position bias table, a shifted block with the -100 mask
    built by slice assignment and torch.roll, patch merging by strided slices, a classifier."""
    def __init__(self, classes=3, dim=8):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 2, 2)
        self.blocks = nn.Sequential(SwinBlock(dim, (4, 4), 2, 2, 1))  # the shifted block (W-MSA is its special case)
        self.merge = PatchMerging((4, 4), dim)
        self.norm, self.head = nn.LayerNorm(2 * dim), nn.Linear(2 * dim, classes)
    def forward(self, img, label):
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = self.merge(self.blocks(x))
        return F.cross_entropy(self.head(self.norm(x).mean(1)), label)


def _nerf():
    g = _gen(60)
    torch.manual_seed(7)  # an initialization whose densities are not all clipped to 0 by the ReLU
    return TinyNeRF(), (torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g), torch.rand(5, 3, generator=g),
                        torch.rand(5, 8, generator=g))


def _pointnet2():
    return TinyPointNet2(), (torch.rand(2, 16, 3, generator=_gen(61)), torch.tensor([0, 2]))


def _act():
    g = _gen(62)
    return TinyACT(), (torch.randn(2, 3, 8, 8, generator=g), torch.randn(2, 3, generator=g), torch.randn(2, 4, 3, generator=g),
                       torch.tensor([[False, False, True, True], [False, False, False, False]]), torch.randn(2, 4, generator=g))


def _swin():
    return TinySwin(), (torch.randn(2, 3, 8, 8, generator=_gen(63)), torch.tensor([1, 2]))


FAMILIES = {"nerf": _nerf, "pointnet2": _pointnet2, "act": _act, "swin": _swin}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_round3_family_matches_torch_in_float64(name):
    torch.manual_seed(0)
    model, batch = FAMILIES[name]()
    model.train()
    graph, _ = assert_step_matches(model, batch, lambda m, b: m(*b), rtol=1e-9)
    assert graph.op_counts().get("dot_general", 0) + graph.op_counts().get("conv", 0) > 0
