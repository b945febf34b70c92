"""Vision models in the zoo: convolution, pooling and batch norm through the torch frontend.

Models are the ``torch.nn`` ResNet (bottleneck blocks) and ViT of ``examples/vision/model.py``
at tiny sizes (no torchvision: PyPI's build links CUDA and does not load next to the CPU torch).
For each: the step traces; the float64 reference interpreter reproduces torch's float64 loss,
every parameter gradient (rtol 1e-7 of each gradient's largest magnitude, floored at 1e-6 of the
largest gradient of all) and the updated batch-norm running statistics (train mode), on fresh
random weights and batches; the contraction FLOPs equal the analytic count; and no kernel is
predicted above 100 % of its roofline.

Gradients are read from the traced AdamW step itself: traced with ``beta1 = 0`` and zero
moments, the ``opt_state:<name>.exp_avg`` output *is* the gradient.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

from conftest import REPO
from sftctl.compiler import interpreter
from sftctl.compiler.frontends.torch import trace_step
from sftctl.compiler.fusion import _gemm_dims, fuse
from sftctl.compiler.target import load_target
from sftctl.compiler.ir import Graph
from sftctl.compiler.step import compile_graph

RTOL = 1e-7


def _load_vision():
    spec = importlib.util.spec_from_file_location("_vision_example_model", REPO / "examples" / "vision" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


vision = _load_vision()


def _seed() -> int:
    return int(np.random.SeedSequence().entropy % (2**31))


def _randomize(model: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():  # norm scales around 1, everything else around 0
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * (0.3 if p.dim() > 1 else 0.1)
                    + (1.0 if p.dim() == 1 and n.endswith("weight") else 0.0))


def check_step_float64(model: nn.Module, batch, loss_fn, seed: int):
    """Trace ``model`` (float64, real tensors), interpret the step in float64 and compare the
    loss and every parameter's gradient with torch's float64 autograd. Returns (graph, meta,
    worst relative gradient error)."""
    model = model.double()
    ref = copy.deepcopy(model)  # tracing with real tensors may update the model's buffers
    batch = tuple(t.double() if t.is_floating_point() else t for t in batch)
    graph, meta = trace_step(model, batch, loss_fn, fake=False, betas=(0.0, 0.999))
    model = ref
    params = dict(model.named_parameters())
    feed = {meta["params"][n]: params[n].detach().numpy() for n in meta["param_names"]}
    for i in meta["opt_state"].values():
        feed[i] = np.zeros(graph.nodes[i].type.shape)
    buffers = dict(model.named_buffers())
    for n, i in meta["buffers"].items():
        feed[i] = buffers[n].detach().clone().numpy()
    feed[meta["step"]] = np.float64(1.0)
    for i, x in zip(meta["batch"], batch):
        feed[i] = x.numpy()
    out = interpreter.run(graph, feed, dtype="float64")

    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    np.testing.assert_allclose(out[meta["outputs"]["loss"]], loss.item(), rtol=RTOL, err_msg=f"loss (seed {seed})")
    worst = 0.0
    overall = max(float(p.grad.abs().max()) for p in params.values())
    for n in meta["param_names"]:
        want = params[n].grad.numpy()
        got = out[meta["outputs"][f"opt_state:{n}.exp_avg"]]
        # a gradient zero in exact arithmetic (a conv bias before train-mode batch norm) is
        # rounding noise: its scale is floored at 1e-6 of the largest gradient
        scale = max(float(np.abs(want).max()), 1e-6 * overall)
        err = float(np.abs(got - want).max()) / scale
        assert err < RTOL, f"gradient of {n}: max error {err:.3g} of its largest magnitude (seed {seed})"
        worst = max(worst, err)
    # buffers the step updates in place (batch norm's running statistics) are step outputs
    for role, i in meta["outputs"].items():
        if role.startswith("buffer:"):
            want = buffers[role[len("buffer:"):]].detach().numpy()
            np.testing.assert_allclose(out[i], want, rtol=RTOL, atol=1e-12, err_msg=f"{role} (seed {seed})")
    return graph, meta, worst


def contraction_flops(graph: Graph) -> float:
    """FLOPs of every dot_general and conv node (2 x batch x M x N x K)."""
    return sum(2.0 * math.prod(_gemm_dims(graph, n)) for n in graph.nodes if n.op in ("dot_general", "conv"))


def assert_within_roofline(graph: Graph, what: str) -> None:
    for target in ("H100", "L4"):
        compiled = compile_graph(graph, load_target(target))
        over = [(k.label, round(k.roofline_fraction, 3)) for k in compiled.kernels if k.roofline_fraction > 1 + 1e-9]
        assert not over, f"{what} on {target}: kernels above their roofline: {over[:5]}"
        assert math.isfinite(compiled.compute_time_s) and compiled.compute_time_s > 0


# ------------------------------------------------------------------------------------------------
# the conv op against torch, directly
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [
    dict(stride=1, padding=0, dilation=1, groups=1),
    dict(stride=2, padding=1, dilation=1, groups=1),
    dict(stride=2, padding=0, dilation=1, groups=1),   # 1x1-like stride skipping rows
    dict(stride=3, padding=2, dilation=2, groups=1),
    dict(stride=2, padding=1, dilation=1, groups=2),
    dict(stride=1, padding=1, dilation=1, groups=4),   # depthwise
])
def test_conv_forward_and_gradients_match_torch(cfg):
    """Conv2d (after another conv, so its input gradient is traced too) in a float64 step:
    loss and every gradient equal torch's within rtol 1e-7 (measured ~1e-15)."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Tanh(), nn.Conv2d(4, 8, 3, **cfg), nn.Flatten())
    x = torch.randn(2, 3, 11, 11, generator=gen)
    n_out = model(x).shape[1]
    model.append(nn.Linear(n_out, 5))
    _randomize(model, gen)
    y = torch.randint(0, 5, (2,), generator=gen)
    graph, _, _ = check_step_float64(model, (x, y), vision.classification_loss, seed)
    assert graph.op_counts()["conv"] == 5  # 2 forward, 2 weight gradients, 1 input gradient


def test_conv1d_conv3d_transposed_conv_and_pools_match_torch():
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 10, 10, generator=gen)
    y = torch.randint(0, 4, (2,), generator=gen)
    models = [
        nn.Sequential(nn.Conv2d(3, 4, 1), nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
                      nn.MaxPool2d(3, 2, 1), nn.AvgPool2d(2, 2, 1, ceil_mode=True, count_include_pad=False),
                      nn.Flatten(), nn.LazyLinear(4)),
        nn.Sequential(nn.Conv2d(3, 6, 3), nn.MaxPool2d(2, ceil_mode=True), nn.AvgPool2d(3, 1, 1),
                      nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.LazyLinear(4)),
    ]
    for m in models:
        m(x)
        _randomize(m, gen)
        check_step_float64(m, (x, y), vision.classification_loss, seed)
    m1 = nn.Sequential(nn.Conv1d(3, 6, 3, stride=2, padding=1), nn.Tanh(), nn.Conv1d(6, 6, 3, stride=2, padding=2,
                                                                                     dilation=2), nn.Flatten())
    m1.append(nn.Linear(m1(x[:, :, 0]).shape[1], 4))
    _randomize(m1, gen)
    check_step_float64(m1, (x[:, :, 0], y), vision.classification_loss, seed)
    m3 = nn.Sequential(nn.Conv3d(3, 3, 3, stride=(1, 2, 2), padding=1), nn.Tanh(), nn.Conv3d(3, 4, (1, 3, 3), stride=2),
                       nn.Flatten())
    x3 = torch.randn(2, 3, 4, 10, 10, generator=gen)
    m3.append(nn.Linear(m3(x3).shape[1], 4))
    _randomize(m3, gen)
    check_step_float64(m3, (x3, y), vision.classification_loss, seed)


# ------------------------------------------------------------------------------------------------
# zoo: tiny ResNet and ViT
# ------------------------------------------------------------------------------------------------


def _conv_shapes(model: nn.Module, x: torch.Tensor) -> list[tuple[nn.Module, tuple, tuple]]:
    shapes = []
    hooks = [m.register_forward_hook(lambda mod, i, o: shapes.append((mod, tuple(i[0].shape), tuple(o.shape))))
             for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return shapes


def _tiny_resnet():
    model, _, loss_fn = vision.build_resnet(2, "float32", layers=(1, 1), base=4, image=16, num_classes=5)
    return model, loss_fn


def test_tiny_resnet_float64_loss_gradients_flops_roofline():
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    model, loss_fn = _tiny_resnet()
    _randomize(model, gen)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)
    x = torch.randn(2, 3, 16, 16, generator=gen)
    y = torch.randint(0, 5, (2,), generator=gen)
    assert model.training  # batch norm on batch statistics, running statistics updated
    graph, meta, worst = check_step_float64(model, (x, y), loss_fn, seed)
    print(f"tiny ResNet: worst gradient error {worst:.3g} (seed {seed})")
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert sum(r.startswith("buffer:") and r.endswith(".running_var") for r in meta["outputs"]) == n_bn
    # analytic: each conv's MACs, x2 FLOPs, x3 (forward, input gradient, weight gradient) except
    # the stem, whose input (the images) needs no gradient
    stem = model.stem[0]
    expected = 0.0
    for mod, ishape, oshape in _conv_shapes(model, x.double()):
        if isinstance(mod, nn.Conv2d):
            macs = math.prod(oshape) * (ishape[1] // mod.groups) * math.prod(mod.kernel_size)
        else:
            macs = math.prod(ishape) * oshape[-1]
        expected += 2 * macs * (2 if mod is stem else 3)
    assert contraction_flops(graph) == expected
    counts = graph.op_counts()
    n_conv = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    assert counts["conv"] == 3 * n_conv - 1
    assert_within_roofline(trace_step(model.float(), (x, y), loss_fn, autocast_dtype="bfloat16")[0], "tiny ResNet")


def test_tiny_vit_float64_loss_gradients_flops_roofline():
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    b, image, patch, dim, depth, heads, mlp, classes = 2, 16, 4, 16, 2, 2, 32, 5
    model, _, loss_fn = vision.build_vit(b, "float32", image=image, patch=patch, dim=dim, depth=depth, heads=heads,
                                         mlp=mlp, num_classes=classes)
    _randomize(model, gen)
    x = torch.randn(b, 3, image, image, generator=gen)
    y = torch.randint(0, classes, (b,), generator=gen)
    graph, meta, worst = check_step_float64(model, (x, y), loss_fn, seed)
    print(f"tiny ViT: worst gradient error {worst:.3g} (seed {seed})")
    t = (image // patch) ** 2 + 1
    patch_macs = b * (t - 1) * dim * 3 * patch * patch
    linear_macs = depth * b * t * (dim * 3 * dim + dim * dim + 2 * dim * mlp) + b * dim * classes
    attn_macs = depth * 2 * b * t * t * dim  # q k^T and p v over all heads
    assert contraction_flops(graph) == 2 * (2 * patch_macs + 3 * linear_macs)
    # SDPA is one attention op: flash attention's forward (2 products) and backward (5 products)
    attn = [k for k in fuse(graph) if k.kind == "attention"]
    assert len(attn) == 2 * depth
    assert sum(k.flops for k in attn) == pytest.approx(2 * (attn_macs + 2.5 * attn_macs), rel=1e-12)
    assert graph.op_counts()["conv"] == 2  # patch embedding forward and weight gradient
    assert_within_roofline(trace_step(model.float(), (x, y), loss_fn, autocast_dtype="bfloat16")[0], "tiny ViT")


def test_resnet50_and_vit_b16_trace_fake():
    """Full-size ResNet-50 (train-mode batch norm) and ViT-B/16 at 224 x 224 trace on meta
    tensors: 53 + 52 + 53 convs (forward, input and weight gradients), ViT's 2."""
    with torch.device("meta"):
        resnet, rb, rl = vision.build_resnet50(2)
        vit, vb, vl = vision.build_vit_b16(2)
    graph, meta = trace_step(resnet, rb, rl, autocast_dtype="bfloat16")
    assert sum(r.startswith("buffer:") for r in meta["outputs"]) == 3 * 53  # mean, var, count per BN
    assert meta["n_params"] == 25_557_032  # torchvision's resnet50: 25,557,032
    assert graph.op_counts()["conv"] == 53 + 52 + 53
    kernels = fuse(graph)
    assert sum(graph.nodes[k.anchor].op == "conv" for k in kernels if k.kind == "gemm") == 158
    graph, meta = trace_step(vit, vb, vl, autocast_dtype="bfloat16")
    assert meta["n_params"] == 86_567_656  # torchvision's vit_b_16: 86,567,656
    assert graph.op_counts()["conv"] == 2
