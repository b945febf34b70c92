"""Issue 43: the model reads a tensor's value while traced (a data-dependent ``if``, ``assert``,
``.cpu().numpy()``): the trace takes the representative batch's value, records the assumption
with the model's ``file:line`` (``meta["assumptions"]``, and on the graph for ``sftctl
compile``'s notes), and refuses naming the line only where no real value exists. Checked in
float64 against torch (loss and gradients within ``rtol`` 1e-7) on the batch traced.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from stepcheck import assert_step_matches  # noqa: E402

from sftctl.compiler.frontends import torch as torch_frontend  # noqa: E402


class _Reads(nn.Module):
    """A scale read with ``.cpu().numpy()`` and ``.tolist()``, a branch on a value, a ``while``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, x):
        h = self.w(x)
        scale = float(h.detach().abs().max().cpu().numpy())
        h = h / scale
        top = x[0].tolist()
        if top[0] > 0:
            h = h + 1
        k = 0
        while h.detach().abs().sum() > 0.5 and k < 3:
            h = h * 0.5
            k += 1
        return h.tanh().pow(2).sum()


def test_numpy_tolist_and_branches_take_the_traced_batchs_values():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    graph, meta = assert_step_matches(_Reads(), x, lambda m, x: m(x), fake=True)
    said = meta["assumptions"]
    line = inspect.getsourcelines(_Reads.forward)[1]
    assert any(f".numpy() at {__file__}:{line + 2} (forward)" in a for a in said), said
    assert any(f".tolist() at {__file__}:{line + 4} (forward)" in a for a in said), said
    assert any(f"data-dependent branch at {__file__}:{line + 8} (forward): taken as True" in a for a in said), said
    step = next(n for n in graph.nodes if n.op == "input" and n.attrs.get("role") == "step")
    # what sftctl compile lists in its notes; a tuple, as every IR attribute (it survives to_json)
    assert step.attrs["trace_assumptions"] == tuple(said)


def test_a_value_with_no_real_input_is_refused_naming_the_line():
    with torch.device("meta"):
        model = _Reads()
    line = inspect.getsourcelines(_Reads.forward)[1] + 2
    with pytest.raises(NotImplementedError, match=f"test_branches.py:{line} \\(forward\\) reads a tensor's value "
                                                  "\\(.numpy\\(\\)\\)"):
        torch_frontend.trace_step(model, torch.randn(3, 4), lambda m, x: m(x))


def test_a_meta_built_entrypoint_is_rebuilt_for_its_values(tmp_path):
    """``trace_entrypoint`` builds on ``meta``; a branch on a value then reads it from the
    entrypoint built for real (once)."""
    (tmp_path / "m.py").write_text(textwrap.dedent("""
        import torch

        calls = []

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Linear(4, 4)

            def forward(self, x):
                h = self.w(x)
                if x.max() > 100:
                    raise ValueError("out of range")
                return h.pow(2).mean()

        def build(batch_size, dtype):
            calls.append(torch.empty(0).device.type)
            return M(), torch.randn(batch_size, 4), lambda m, x: m(x)
    """))
    graph, meta = torch_frontend.trace_entrypoint("m.py:build", str(tmp_path), 3)
    assert meta["built_on"] == "meta"
    assert len(meta["assumptions"]) == 1 and "m.py:13 (forward): taken as False" in meta["assumptions"][0], meta


def test_wav2vec2_for_ctc_compiles_as_written():
    """transformers' Wav2Vec2ForCTC (config-built, no download) guards on the labels' values
    (``labels.max() >= vocab_size``), draws LayerDrop per layer and selects the CTC targets with
    ``masked_select``: it traces, each read recorded, the targets kept padded with their static
    width (:mod:`sftctl.compiler.frontends.torch.ctc`)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
        vocab_size=10, mask_time_prob=0.0)
    with torch.device("meta"):
        model = transformers.Wav2Vec2ForCTC(cfg)
    x, labels = torch.randn(2, 1600), torch.randint(1, 10, (2, 6))
    rebuild = lambda: (transformers.Wav2Vec2ForCTC(cfg), (x, labels), None)  # noqa: E731
    graph, meta = torch_frontend.trace_step(model, (x, labels), lambda m, b: m(input_values=b[0], labels=b[1]).loss,
                                            representative=rebuild)
    said = " ".join(meta["assumptions"])
    assert "modeling_wav2vec2.py" in said and "taken as False" in said, meta["assumptions"]
    assert graph.op_counts().get("conv", 0) >= 4
