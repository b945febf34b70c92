"""How the torch frontend captures a step: the joint graph under make_fx (model code sees fake
tensors), in-place buffer updates as step outputs, and errors that name the model's code."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

from stepcheck import assert_step_matches, interpreted_loss_and_grads  # noqa: E402

from sftctl.compiler.frontends import torch as torch_frontend  # noqa: E402


class RunningStats(nn.Module):
    """Updates buffers in place in train mode, as BatchNorm does with its running statistics."""

    def __init__(self, d=6):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("running_mean", torch.zeros(d))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("untouched", torch.ones(d))

    def forward(self, x):
        y = self.lin(x)
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * y.mean(0))
                self.seen.add_(1)
        return (y - self.running_mean).pow(2).mean() * self.untouched.sum()


def test_in_place_buffer_updates_are_step_outputs():
    torch.manual_seed(0)
    model = RunningStats().train()
    x = torch.randn(5, 6)
    loss, grads, graph, meta = interpreted_loss_and_grads(model, {"x": x}, lambda m, b: m(b["x"]))
    roles = graph.output_roles
    assert "buffer:running_mean" in roles and "buffer:seen" in roles
    assert "buffer:untouched" not in roles  # not updated: no output
    assert set(meta["buffers"]) == {"running_mean", "seen", "untouched"}
    # run again to read the buffer outputs, against torch
    from sftctl.compiler import interpreter

    m64 = RunningStats().double().train()
    m64.load_state_dict(model.state_dict())
    feed = {meta["params"][n]: p.detach().numpy() for n, p in m64.named_parameters()}
    feed.update({i: np.zeros(graph.nodes[i].type.shape) for i in meta["opt_state"].values()})
    feed.update({meta["buffers"][n]: b.numpy() for n, b in m64.named_buffers()})
    feed[meta["step"]] = 1.0
    feed[meta["batch"][0]] = x.double().numpy()
    out = dict(zip(roles, interpreter.run(graph, feed)))
    ref_loss = m64(x.double())
    np.testing.assert_allclose(out["loss"], ref_loss.item(), rtol=1e-12)
    np.testing.assert_allclose(out["buffer:running_mean"], m64.running_mean.numpy(), rtol=1e-12)
    assert int(out["buffer:seen"]) == 1
    assert_step_matches(model, {"x": x}, lambda m, b: m(b["x"]))


def test_model_sees_fake_tensors_not_wrappers():
    """Library code that asks "am I traced?" (transformers' is_tracing) gets yes, and a step whose
    model would branch on a value in eager mode traces."""
    from torch._subclasses.fake_tensor import FakeTensor

    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, mask):
            seen.append(type(x))
            if not isinstance(mask, FakeTensor) and bool(mask.all()):  # transformers' pattern
                mask = None
            y = self.lin(x)
            return (y if mask is None else y * mask).sum()

    x = torch.empty(3, 4, device="meta")
    mask = torch.ones(3, 4, device="meta")
    graph, _ = torch_frontend.trace_step(Probe(), {"x": x, "m": mask}, lambda m, b: m(b["x"], b["m"]))
    assert seen and all(issubclass(t, FakeTensor) for t in seen)


def test_data_dependent_branch_names_the_model_line():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            if y.sum() > 0:  # the line the error must name
                return y.sum()
            return -y.sum()

    import inspect

    line = inspect.getsourcelines(Branchy.forward)[1] + 2
    # a batch with no values (meta): the branch cannot be evaluated, so it is refused, naming the line
    with pytest.raises(NotImplementedError) as info:
        torch_frontend.trace_step(Branchy(), {"x": torch.empty(3, 4, device="meta")}, lambda m, b: m(b["x"]), fake=True)
    msg = str(info.value)
    assert f"test_capture.py:{line} (forward)" in msg, msg
    assert "torch.where" in msg
    # a real batch: the branch is taken as that batch takes it (tests/test_branches.py checks the
    # recorded assumption), and the step matches the model on it
    torch_frontend.trace_step(Branchy(), {"x": torch.randn(3, 4)}, lambda m, b: m(b["x"]), fake=False)


def test_unsupported_op_names_op_module_and_line():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.special.i0e(self.lin(x))  # no lowering for the scaled Bessel function

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x).sum()

    x = torch.empty(3, 4, device="meta")
    with pytest.raises(NotImplementedError) as info:
        torch_frontend.trace_step(Net(), {"x": x}, lambda m, b: m(b["x"]))
    msg = str(info.value)
    assert "aten.special_i0e" in msg, msg
    assert "in module block (Block)" in msg, msg
    assert "try" in msg, msg


def test_batchnorm_train_mode_running_stats_are_outputs():
    """nn.BatchNorm1d in train mode: loss, gradients and the updated running statistics match torch."""
    from sftctl.compiler import interpreter

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1)).train()
    x = torch.randn(8, 5)
    loss_fn = lambda m, b: m(b["x"]).pow(2).mean()  # noqa: E731
    graph, meta = assert_step_matches(model, {"x": x}, loss_fn)
    m64 = __import__("copy").deepcopy(model).double()
    feed = {meta["params"][n]: p.detach().numpy() for n, p in m64.named_parameters()}
    feed.update({i: np.zeros(graph.nodes[i].type.shape) for i in meta["opt_state"].values()})
    feed.update({meta["buffers"][n]: b.numpy() for n, b in m64.named_buffers()})
    feed[meta["step"]] = 1.0
    feed[meta["batch"][0]] = x.double().numpy()
    out = dict(zip(graph.output_roles, interpreter.run(graph, feed)))
    loss_fn(m64, {"x": x.double()})
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        np.testing.assert_allclose(out[f"buffer:{name}"], dict(m64.named_buffers())[name].numpy(), rtol=1e-12)
    assert int(out["buffer:1.num_batches_tracked"]) == 1


def test_cumsum_and_flip_match_torch():
    """cumsum (RoBERTa's and OPT's position ids from the attention mask; a float scan with its
    flip-cumsum-flip gradient) and flip lower and reproduce torch's loss and gradients."""

    class Scan(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 5)

        def forward(self, x, mask):
            pos = torch.cumsum(mask, dim=1) * mask  # int64, as transformers builds position ids
            y = torch.cumsum(self.lin(x), dim=1).flip(-1)
            return (y * pos.unsqueeze(-1)).pow(2).mean()

    torch.manual_seed(4)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    graph, _ = assert_step_matches(Scan(), {"x": torch.randn(2, 6, 5), "mask": mask},
                                   lambda m, b: m(b["x"], b["mask"]))
    assert graph.op_counts()["cumsum"] >= 3  # int positions, float forward, float backward


def test_activation_checkpointing_recomputes_in_backward():
    """torch.utils.checkpoint (transformers' gradient_checkpointing): the backward recomputes the
    block on the traced parameters (attention included, as the attention op), gradients match
    torch's float64 ones, and the saved activations shrink."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from sftctl.compiler.fusion import fuse
    from sftctl.compiler.memory import peak_memory

    class Block(nn.Module):
        def __init__(self, d=32, heads=4):
            super().__init__()
            self.h = heads
            self.qkv, self.o, self.up, self.down = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, D = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
            x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
            return x + self.down(torch.relu(self.up(x)))

    class Net(nn.Module):
        def __init__(self, ckpt, nblocks=2):
            super().__init__()
            self.ckpt = ckpt
            self.blocks = nn.ModuleList([Block() for _ in range(nblocks)])

        def forward(self, x):
            for blk in self.blocks:
                x = checkpoint(blk, x, use_reentrant=False) if self.ckpt else blk(x)
            return x.pow(2).mean()

    torch.manual_seed(5)
    x = torch.randn(2, 6, 32)
    graph, _ = assert_step_matches(Net(True), {"x": x}, lambda m, b: m(b["x"]))
    assert graph.op_counts()["attention"] == 4  # 2 forward + 2 recomputed in backward
    peaks = {}
    for ckpt in (False, True):
        with torch.device("meta"):
            net = Net(ckpt)
        g, _ = torch_frontend.trace_step(net, {"x": torch.empty(8, 512, 32, device="meta")}, lambda m, b: m(b["x"]))
        peaks[ckpt] = peak_memory(g, fuse(g)).transient_peak_bytes
    assert peaks[True] < 0.75 * peaks[False]
