"""ResNet-50 and ViT-B/16 written with ``torch.nn`` only (no torchvision), for tracing.

* ``ResNet`` with ``Bottleneck`` blocks (He et al. 2016, "Deep Residual Learning for Image
  Recognition", Table 1: conv1 7x7/2, 3x3/2 max pool, stages of [3, 4, 6, 3] bottlenecks of
  widths 64..512 with expansion 4, stride on the 3x3 conv as torchvision's "ResNet v1.5", global
  average pool, fully connected classifier). Batch norm after every convolution.
* ``ViT`` (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words", Table 1, ViT-Base: patch
  16, width 768, depth 12, 12 heads, MLP 3072): a strided convolution embeds the patches, a
  class token and learned position embeddings are prepended/added, pre-LayerNorm encoder blocks
  with ``F.scaled_dot_product_attention``, the class token's final LayerNorm feeds the head.
* ``build_resnet50`` / ``build_vit_b16`` (and ``build_resnet`` / ``build_vit`` for other sizes)
  follow the ``build(batch_size, dtype) -> (model, example_batch, loss_fn)`` contract of
  ``examples/gpt/model.py``: images ``[batch, 3, H, W]`` float, labels ``[batch]`` int64,
  cross-entropy loss. Models are in train mode (batch norm uses batch statistics).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (stride here) -> 1x1 expand (x4), each with batch norm; ReLU; a
    projection shortcut (1x1 conv + BN) when the shape changes."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.down = None
        if stride != 1 or in_ch != out_ch:
            self.down = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch))

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + idt)


class ResNet(nn.Module):
    """Bottleneck ResNet: ``layers`` blocks per stage, stage widths ``base * 2**i``."""

    def __init__(self, layers=(3, 4, 6, 3), base: int = 64, num_classes: int = 1000, in_ch: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_ch, base, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(base),
                                  nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        blocks, ch = [], base
        for i, n in enumerate(layers):
            width = base * 2 ** i
            for j in range(n):
                blocks.append(Bottleneck(ch, width, stride=2 if (j == 0 and i > 0) else 1))
                ch = width * Bottleneck.expansion
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Block(nn.Module):
    """Pre-LayerNorm transformer encoder block (bidirectional attention, GELU MLP)."""

    def __init__(self, dim: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    """Vision transformer: ``patch`` x ``patch`` patches of an ``image`` x ``image`` input."""

    def __init__(self, image: int = 224, patch: int = 16, dim: int = 768, depth: int = 12, heads: int = 12,
                 mlp: int = 3072, num_classes: int = 1000, in_ch: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(in_ch, dim, patch, stride=patch)
        n = (image // patch) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads, mlp) for _ in range(depth)])
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.ln(self.blocks(x))
        return self.head(x[:, 0])


def classification_loss(model: nn.Module, batch) -> torch.Tensor:
    """Cross-entropy of ``model(images)`` against ``labels``; ``batch = (images, labels)``."""
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def _batch(batch_size: int, image: int, num_classes: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, image, image, generator=gen).to(dtype),
            torch.randint(0, num_classes, (batch_size,), generator=gen))


def build_resnet(batch_size: int = 32, dtype: str = "float32", layers=(3, 4, 6, 3), base: int = 64,
                 image: int = 224, num_classes: int = 1000):
    """A bottleneck ResNet (default: ResNet-50, 25.6 M parameters) and a random batch.

    Returns ``(model, (images [batch, 3, image, image], labels [batch] int64), loss_fn)``;
    the model is seeded (deterministic), in ``dtype`` and in train mode.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ResNet(layers, base, num_classes)
    dt = getattr(torch, dtype)
    return model.to(dt).train(), _batch(batch_size, image, num_classes, dt), classification_loss


def build_resnet50(batch_size: int = 32, dtype: str = "float32"):
    """ResNet-50 at 224 x 224 (He et al. 2016, Table 1); see :func:`build_resnet`."""
    return build_resnet(batch_size, dtype)


def build_vit(batch_size: int = 32, dtype: str = "float32", image: int = 224, patch: int = 16, dim: int = 768,
              depth: int = 12, heads: int = 12, mlp: int = 3072, num_classes: int = 1000):
    """A ViT (default: ViT-B/16, 86.6 M parameters) and a random batch; see :func:`build_resnet`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ViT(image, patch, dim, depth, heads, mlp, num_classes)
    dt = getattr(torch, dtype)
    return model.to(dt).train(), _batch(batch_size, image, num_classes, dt), classification_loss


def build_vit_b16(batch_size: int = 32, dtype: str = "float32"):
    """ViT-B/16 at 224 x 224 (Dosovitskiy et al. 2021, Table 1); see :func:`build_vit`."""
    return build_vit(batch_size, dtype)
