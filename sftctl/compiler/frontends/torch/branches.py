"""Values the model reads while it is traced, taken from the representative batch (issue 43).

A model's Python code may ask a tensor for its value: ``if labels.max() >= vocab: raise``
(transformers' Wav2Vec2), ``if (x > 0).all():``, ``n = x.cpu().numpy()``. Dynamo breaks the graph
there and runs the branch eagerly; a step traced without data cannot. :class:`Representative`
evaluates the tensor instead: the FX nodes the trace recorded so far that it depends on run
for real (outside the tracing and fake modes) on the step's real inputs: the batch the step
was traced with and the model's parameters and buffers where they are real tensors (not
``meta`` or fake), AdamW's zero moments and step 1. Values computed once are kept, so the cost
is at most one eager forward. The trace then takes the branch the representative batch takes
and the assumption, with the model's ``file:line``, goes to ``meta["assumptions"]`` (and the
``compile`` output's notes): another batch could take the other branch, which the step's price
does not cover. A value whose inputs are not real (a model built on ``meta``, a batch of fake
tensors) cannot be read: the trace stops naming the line, as before.

``.numpy()`` / ``.tolist()`` of a traced tensor (``x.cpu().numpy()`` in the forward) return that
value as a constant of the step, recorded the same way; the shapes computed from it are the
representative batch's.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from typing import Any, Callable

import torch
import torch.fx as fx


class Representative:
    """Evaluates traced tensors on the step's real inputs.

    Args:
        inputs: one thunk per placeholder of the traced function, in order, giving the real
            tensor (or value) behind it, or None where there is none (a meta parameter).
    """

    def __init__(self, inputs: list[Callable[[], Any]]):
        self.inputs = inputs
        self.env: dict[fx.Node, Any] = {}

    def node_of(self, t: torch.Tensor) -> fx.Node | None:
        """The FX node that computed ``t`` in the current trace, or None."""
        from torch.fx.experimental.proxy_tensor import get_innermost_proxy_mode, get_proxy_slot

        mode = get_innermost_proxy_mode()
        if mode is None:
            return None
        try:
            return get_proxy_slot(t, mode.tracer).proxy.node
        except Exception:  # noqa: BLE001 - not a traced tensor
            return None

    def value(self, t: torch.Tensor) -> Any:
        """``t``'s value on the real inputs (a real tensor), or None when some input is not real."""
        node = self.node_of(t)
        if node is None:
            return None
        need: set[fx.Node] = set()
        stack = [node]
        while stack:
            n = stack.pop()
            if n in need or n in self.env:
                continue
            need.add(n)
            stack.extend(n.all_input_nodes)
        from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_innermost_proxy_mode

        mode = get_innermost_proxy_mode()
        root = mode.tracer.root if mode is not None else None
        placeholders = [n for n in node.graph.nodes if n.op == "placeholder"]
        # a random draw (LayerDrop's ``torch.rand([]) < p``) takes the seed-0 draw: reproducible
        with disable_proxy_modes_tracing(), unset_fake_temporarily(), torch.no_grad(), \
                torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for n in node.graph.nodes:
                if n not in need:
                    continue
                if n.op == "placeholder":
                    i = placeholders.index(n)
                    v = self.inputs[i]() if i < len(self.inputs) else None
                elif n.op == "get_attr":
                    v = getattr(root, str(n.target), None)
                elif n.op == "call_function":
                    try:
                        args = fx.node.map_arg(n.args, lambda a: self.env[a])
                        kwargs = fx.node.map_arg(n.kwargs, lambda a: self.env[a])
                        v = n.target(*args, **kwargs)
                    except Exception:  # noqa: BLE001 - an op that cannot run eagerly: no value
                        return None
                else:
                    return None
                if v is None or (isinstance(v, torch.Tensor) and (is_fake(v) or v.device.type == "meta")):
                    return None
                self.env[n] = v
        return self.env[node]


#: ``frames -> "file:line (function)"`` of the model's innermost frame (set by :mod:`.capture`,
#: which owns the rule for what is the model's code)
model_frame_of: Callable[[list], str | None] = lambda frames: None  # noqa: E731


def _model_line() -> str:
    return model_frame_of(traceback.extract_stack(sys._getframe(2))) or "the model"


@contextlib.contextmanager
def values_read(rep: Representative, assumptions: list[str]):
    """While a step is traced: ``.numpy()`` and ``.tolist()`` of a traced tensor give its value on
    the representative batch (recorded in ``assumptions``); one that cannot be evaluated raises
    ``NotImplementedError`` naming the model's line."""
    orig_numpy, orig_tolist = torch.Tensor.numpy, torch.Tensor.tolist

    def read(self, what: str, orig, *args, **kwargs):
        if rep.node_of(self) is None:
            return orig(self, *args, **kwargs)
        at = _model_line()
        v = rep.value(self)
        if v is None:
            raise NotImplementedError(
                f"torch frontend: the model's code at {at} reads a tensor's value ({what}) while tracing, and "
                "the trace has no real value for it (a model built on the meta device or a fake batch); "
                "compute it from the batch's shape, keep it a tensor, or move it out of the step")
        assumptions.append(f"{what} at {at}: the value on the traced batch (shapes and branches after it "
                           "are that batch's)")
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

        with disable_proxy_modes_tracing(), unset_fake_temporarily():
            return orig(v.detach(), *args, **kwargs)

    def numpy(self, *args, **kwargs):
        return read(self, ".numpy()", orig_numpy, *args, **kwargs)

    def tolist(self, *args, **kwargs):
        return read(self, ".tolist()", orig_tolist, *args, **kwargs)

    from torch._subclasses.fake_tensor import FakeTensor

    fake_tolist = FakeTensor.__dict__.get("tolist")  # FakeTensor's own: unbacked symbols per element
    torch.Tensor.numpy = numpy
    torch.Tensor.tolist = tolist
    if fake_tolist is not None:
        FakeTensor.tolist = tolist
    try:
        yield
    finally:
        torch.Tensor.numpy = orig_numpy
        torch.Tensor.tolist = orig_tolist
        if fake_tolist is not None:
            FakeTensor.tolist = fake_tolist


def branch_value(rep: Representative | None, t: torch.Tensor, assumptions: list[str]) -> bool | None:
    """``bool(t)`` on the representative batch for a data-dependent ``if`` / ``assert`` / ``while``
    (recorded in ``assumptions`` with the model's line), or None when it cannot be evaluated."""
    if rep is None:
        return None
    v = rep.value(t)
    if v is None:
        return None
    verdict = bool(v)
    at = _model_line()
    assumptions.append(f"data-dependent branch at {at}: taken as {verdict} on the traced batch "
                       "(another batch may take the other branch)")
    return verdict
