"""Issue 22: what a model computes from data or holds outside its parameters and buffers.

* a plain tensor attribute (not a buffer: a diffusers scheduler's ``alphas_cumprod``) is a constant
  of the step, traced in fake mode (it failed with FakeTensor's "Please convert all Tensors to
  FakeTensors first"), also when the model was built on the ``meta`` device;
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from stepcheck import assert_step_matches  # noqa: E402

from sftctl.compiler.frontends import torch as torch_frontend  # noqa: E402


class _Scheduled(torch.nn.Module):
    """A denoiser that scales its input by a noise schedule held as a plain attribute, as
    diffusers' DDPMScheduler holds ``alphas_cumprod``."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 8)
        self.alphas_cumprod = torch.cumprod(torch.linspace(0.99, 0.9, 10, dtype=torch.float64), 0)

    def forward(self, x, t):
        a = self.alphas_cumprod[t].to(x.dtype)
        noisy = x * a.sqrt()[:, None]
        return (self.net(noisy) - x).square().mean()


def _schedule_batch():
    gen = torch.Generator().manual_seed(3)
    return torch.randn(6, 8, generator=gen), torch.tensor([0, 3, 9, 1, 5, 5])


def test_plain_tensor_attribute_traces_in_fake_mode_and_matches_torch():
    graph, _ = assert_step_matches(_Scheduled(), _schedule_batch(), lambda m, b: m(*b), fake=True)
    consts = [n for n in graph.nodes if n.op == "input" and n.attrs.get("role") == "constant"]
    assert [n.type.shape for n in consts] == [(10,)]


def test_plain_tensor_attribute_of_a_meta_built_model_is_a_constant_input():
    with torch.device("meta"):
        model = _Scheduled()
    graph, _ = torch_frontend.trace_step(model, _schedule_batch(), lambda m, b: m(*b))
    consts = [n for n in graph.nodes if n.op == "input" and n.attrs.get("role") == "constant"]
    assert [(n.type.shape, n.attrs["name"]) for n in consts] == [((10,), consts[0].attrs["name"])]
    assert model.alphas_cumprod.device.type == "meta"  # put back after the trace
