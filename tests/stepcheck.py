"""Shared check for traced torch steps: loss and gradients from the float64 interpreter.

``interpreted_loss_and_grads`` traces a step with real tensors (``fake=False``), runs the IR in
float64 from the model's parameters, zero AdamW moments and step 1, and reads each gradient back
from the updated first moment: with ``m = 0`` and ``beta1 = 0.5``, ``exp_avg' = 0.5 * g`` exactly,
so ``g = 2 * exp_avg'`` with no rounding. ``torch_loss_and_grads`` is the float64 reference.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from sftctl.compiler import interpreter
from sftctl.compiler.frontends import torch as torch_frontend


def _double(batch):
    return torch.utils._pytree.tree_map(
        lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch)


def interpreted_loss_and_grads(model, batch, loss_fn, *, seed: int = 0, fake: bool = False,
                               interp_dtype: str | None = "float64", **trace_kw):
    """(loss, {param name: grad}, graph, meta) of one traced step of ``model`` (float64)."""
    model = copy.deepcopy(model).double()
    batch = _double(batch)
    graph, meta = torch_frontend.trace_step(model, batch, loss_fn, fake=fake, betas=(0.5, 0.999),
                                            weight_decay=0.0, **trace_kw)
    params = dict(model.named_parameters())
    feed = {meta["params"][n]: _real_view(params[n]).numpy() for n in meta["param_names"]}
    for i in meta["opt_state"].values():
        feed[i] = np.zeros(graph.nodes[i].type.shape)
    feed[meta["step"]] = np.float64(1.0)
    buffers = dict(model.named_buffers())
    for n, i in meta["buffers"].items():
        feed[i] = (buffers[n] if n in buffers else dict(model.named_parameters(remove_duplicate=False))[n]).detach().numpy()
    for i, x in zip(meta["batch"], [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]):
        feed[i] = x.detach().numpy()
    out = interpreter.run(graph, feed, dtype=interp_dtype, seed=seed)
    by_role = dict(zip(graph.output_roles, out))
    grads = {n: 2.0 * by_role[f"opt_state:{n}.exp_avg"] for n in meta["param_names"]}
    return float(by_role["loss"]), grads, graph, meta


def torch_loss_and_grads(model, batch, loss_fn):
    """float64 torch reference: (loss, {param name: grad}) (zero for unused parameters)."""
    model = copy.deepcopy(model).double()
    batch = _double(batch)
    loss = loss_fn(model, batch)
    loss.backward()
    return float(loss.detach()), {n: (_real_view(p.grad).numpy() if p.grad is not None
                                      else np.zeros(tuple(_real_view(p).shape)))
                                  for n, p in model.named_parameters()}


def _real_view(t):
    """A tensor as the IR holds it: a complex one (a Fourier layer's weights) as ``[..., 2]``."""
    t = t.detach()
    return torch.view_as_real(t) if t.is_complex() else t


def assert_step_matches(model, batch, loss_fn, *, rtol=1e-7, atol_rel=1e-10, **trace_kw):
    """Interpreted float64 loss and gradients equal torch's float64 ones: the loss within ``rtol``,
    each gradient within ``rtol`` plus ``atol_rel`` times its largest magnitude (models that
    compute parts in float32 under a float64 model, as transformers' RoPE and loss do, need the
    interpreter to honour those dtypes, ``interp_dtype=None``, and a tolerance of float32's order).
    Returns ``(graph, meta)``."""
    loss, grads, graph, meta = interpreted_loss_and_grads(model, batch, loss_fn, **trace_kw)
    ref_loss, ref_grads = torch_loss_and_grads(model, batch, loss_fn)
    np.testing.assert_allclose(loss, ref_loss, rtol=rtol, err_msg="loss")
    assert sorted(grads) == sorted(ref_grads)
    overall = max(float(np.abs(g).max(initial=0.0)) for g in ref_grads.values())
    for n, g in grads.items():
        # a gradient that is zero in exact arithmetic (a key bias under softmax) is rounding noise
        # far below every other gradient: judged against a millionth of the largest one
        scale = max(float(np.abs(ref_grads[n]).max(initial=0.0)), 1e-6 * overall)
        np.testing.assert_allclose(g, ref_grads[n], rtol=rtol, atol=atol_rel * scale + 1e-300, err_msg=f"grad {n}")
    assert any(float(np.abs(g).max(initial=0.0)) > 0 for g in grads.values())
    return graph, meta
