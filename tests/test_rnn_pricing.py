"""Issue 43: eager PyTorch's RNN layers priced as cuDNN runs them (per layer, direction and step a
recurrent GEMM and one fused pointwise kernel for the gates; the weight gradient one GEMM over
the sequence), not one kernel per ATen op (:mod:`sftctl.compiler.frontends.torch.rnn`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn


class _Recurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(8, 16, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0]).pow(2).mean()


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_eager_rnn_runs_as_fused_cudnn_kernels(cell):
    from sftctl.compiler.frontends import torch as torch_frontend
    from sftctl.compiler.modes import predict_mode
    from sftctl.compiler.target import load_target

    steps = 6
    graph, _ = torch_frontend.trace_step(_Recurrent(cell), torch.randn(4, steps, 8), lambda m, x: m(x))
    phases = {n.attrs.get("phase") for n in graph.nodes if "rnn" in n.attrs}
    assert phases == {"forward", "backward"}, phases
    target = load_target("H100")
    fused = predict_mode(graph, target, "eager")
    default = predict_mode(graph, target, "default")
    for n in graph.nodes:
        n.attrs.pop("rnn", None)
    per_op = predict_mode(graph, target, "eager")
    # one kernel per ATen op is well above cuDNN's count, which is about what Inductor's fusion gives
    assert per_op["kernels"] > 1.3 * fused["kernels"], (per_op["kernels"], fused["kernels"])
    assert fused["kernels"] <= default["kernels"] * 1.1, (fused["kernels"], default["kernels"])
    # 2 layers x 2 directions x 6 steps, each at least a GEMM and a gates kernel each way
    assert fused["kernels"] >= 2 * 2 * steps * 2 * 2
    assert fused["compute_time_s"] < per_op["compute_time_s"]
