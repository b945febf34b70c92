"""Issue 22: what a model computes from data or holds outside its parameters and buffers.

* a plain tensor attribute (not a buffer: a diffusers scheduler's ``alphas_cumprod``) is a constant
  of the step, traced in fake mode (it failed with FakeTensor's "Please convert all Tensors to
  FakeTensors first"), also when the model was built on the ``meta`` device;
* a boolean-mask select (``logits[mask]``, PyG's ``out[train_mask]``) traces with a bounded
  data-dependent size (it failed with "DynamicOutputShapeException", naming no line): priced at the
  mask's bound (``model.mask_fraction`` sets another, stated in the compile report), with values
  exact in float64 against torch;
* a size the tracer cannot bound (``.item()`` into a shape) exits UNTRACEABLE naming file:line.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from stepcheck import assert_step_matches  # noqa: E402

from sftctl.compiler.frontends import torch as torch_frontend  # noqa: E402

F = torch.nn.functional


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


class _MaskedHead(torch.nn.Module):
    """Token classification whose loss and statistics read only the masked positions."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x, y, mask):
        h = torch.tanh(self.body(x))
        logits = self.head(h)
        sel = logits[mask]
        return (F.cross_entropy(sel, y[mask]) + 0.3 * sel.mean() + sel.amax(0).sum()
                + self.head(h[mask]).square().mean())


class _GCN(torch.nn.Module):
    """Two rounds of mean-aggregation message passing written as PyG writes it (``index_add_``
    over an edge list), trained on the nodes of ``train_mask`` only."""

    def __init__(self, d=6, classes=3):
        super().__init__()
        self.l1 = torch.nn.Linear(d, 8)
        self.l2 = torch.nn.Linear(8, classes)

    @staticmethod
    def propagate(h, src, dst):
        agg = torch.zeros_like(h).index_add_(0, dst, h[src])
        deg = torch.zeros(h.shape[0], dtype=h.dtype).index_add_(0, dst, torch.ones_like(dst, dtype=h.dtype))
        return agg / deg.clamp(min=1)[:, None] + h

    def forward(self, x, edge_index, y, train_mask):
        src, dst = edge_index
        h = F.relu(self.l1(self.propagate(x, src, dst)))
        out = self.l2(self.propagate(h, src, dst))
        return F.cross_entropy(out[train_mask], y[train_mask])


class _ManySelects(torch.nn.Module):
    """The other spellings: a mask on a later dim, a 2-D mask written to, masked_select (whose
    backward is masked_scatter), nonzero's coordinates and torch.where(mask)'s indices."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 6)

    def forward(self, x, mask2, m1):
        h = self.lin(x)
        written = h.clone()
        written[mask2] = 0.0
        idx = torch.nonzero(mask2)
        cols = torch.where(m1)[0]
        return (h[:, m1].square().sum() + written.sum() + torch.masked_select(h, mask2).mean()
                + 2 * h[idx[:, 0], idx[:, 1]].sum() + 0.5 * h[:, cols].sum())


class _SizeAsNumber(torch.nn.Module):
    """The selected count used as a number and a size: a divisor, an arange, a reshape."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 6)

    def forward(self, x, mask):
        h = self.lin(x)[mask]
        pos = torch.arange(h.shape[0], dtype=h.dtype)
        return (h.reshape(-1, 3) ** 2).sum() + (h * pos[:, None]).sum() + h.sum() / h.shape[0]


def _size_batch():
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(2)), torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool)


def _many_batch():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(5, 8, generator=gen), torch.rand(5, 6, generator=gen) < 0.4,
            torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool))


def _masked_batch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 8, generator=gen)
    y = torch.randint(0, 5, (7,), generator=gen)
    return x, y, torch.tensor([1, 0, 1, 1, 0, 1, 0], dtype=torch.bool)


def _graph_batch():
    gen = torch.Generator().manual_seed(1)
    n, e = 9, 20
    x = torch.randn(n, 6, generator=gen)
    edge_index = torch.randint(0, n, (2, e), generator=gen)
    y = torch.randint(0, 3, (n,), generator=gen)
    train_mask = torch.rand(n, generator=gen) < 0.5
    return x, edge_index, y, train_mask


@pytest.mark.parametrize("model, batch", [(_MaskedHead, _masked_batch), (_GCN, _graph_batch), (_ManySelects, _many_batch),
                                           (_SizeAsNumber, _size_batch)],
                         ids=["logits_mask", "gcn_train_mask", "many_selects", "size_as_number"])
def test_boolean_mask_select_traces_bounded_and_matches_torch(model, batch):
    graph, _ = assert_step_matches(model(), batch(), lambda m, b: m(*b), fake=True)
    said = [n.attrs["assumption"] for n in graph.nodes if "assumption" in n.attrs]
    assert said and all("test_data_dependent.py:" in s for s in said), said
    n_mask = int(batch()[-1].numel())
    assert any(f"{n_mask} of {n_mask} elements selected" in s for s in said), said
    assert_step_matches(model(), batch(), lambda m, b: m(*b), fake=False)  # real mode: sizes as counted


def test_mask_fraction_prices_the_select_smaller():
    model, batch = _MaskedHead(), _masked_batch()
    full, _ = torch_frontend.trace_step(model, batch, lambda m, b: m(*b))
    half, _ = torch_frontend.trace_step(model, batch, lambda m, b: m(*b), mask_fraction=0.5)

    def dot_rows(g):
        return sorted(n.type.shape[0] for n in g.nodes if n.op == "dot_general" and n.attrs.get("phase") == "forward")

    assert dot_rows(full) == [7, 7, 7] and dot_rows(half) == [4, 7, 7]  # head(h[mask]) at the bound
    said = [n.attrs["assumption"] for n in half.nodes if "assumption" in n.attrs]
    assert any("4 of 7 elements selected (mask_fraction 0.5)" in s for s in said), said


_ITEM_SIZED = """import torch


class Truncate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        n = int((x > 0).sum())
        return self.proj(x[:n]).sum()


def build(batch_size=2, dtype="float32"):
    return Truncate(), torch.randn(batch_size, 4), lambda m, x: m(x)
"""


def test_a_size_read_from_a_value_is_untraceable_naming_the_line(tmp_path, home):
    from sftctl import api
    from sftctl.errors import ExitCode, UntraceableModelError

    (tmp_path / "model.py").write_text(_ITEM_SIZED)
    spec = tmp_path / "job.yaml"
    spec.write_text("name: trunc\nmodel: {entrypoint: model.py:build, batch_size: 2}\nrun: echo hi\n")
    with pytest.raises(UntraceableModelError) as e:
        api.plan(str(spec))
    assert e.value.exit_code == ExitCode.UNTRACEABLE
    assert "model.py:10" in e.value.message, e.value.message


def test_compile_report_states_the_select_bound(tmp_path, home):
    from sftctl import api

    (tmp_path / "model.py").write_text(
        "import torch\n\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.head = torch.nn.Linear(16, 10)\n\n"
        "    def forward(self, x, y, mask):\n"
        "        return torch.nn.functional.cross_entropy(self.head(x)[mask], y[mask])\n\n\n"
        "def build(batch_size=8, dtype='float32'):\n"
        "    return M(), (torch.randn(batch_size, 16), torch.randint(0, 10, (batch_size,)),\n"
        "                 torch.rand(batch_size) < 0.3), lambda m, b: m(*b)\n")
    spec = tmp_path / "job.yaml"
    spec.write_text("name: masked\nmodel: {entrypoint: model.py:build, batch_size: 8, mask_fraction: 0.25}\n"
                    "run: echo hi\n")
    res = api.compile(str(spec), "h100", out=str(tmp_path / "out"))
    notes = res.doc["notes"]
    assert any("2 of 8 elements selected (mask_fraction 0.25)" in n and "model.py:9" in n for n in notes), notes
    assert "mask_fraction 0.25" in (tmp_path / "out" / "report.md").read_text()
