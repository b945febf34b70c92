"""Recurrent layers tagged while traced, so eager PyTorch's RNN is priced as cuDNN runs it.

``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` call ``torch._VF.lstm`` / ``gru`` / ``rnn_tanh`` /
``rnn_relu``; with oneDNN off they trace as ATen's native RNN (an input-projection GEMM over the
sequence, then per time step a recurrent GEMM and the gates' pointwise ops). On a GPU eager
PyTorch hands the whole layer to cuDNN (``cudnnRNNForward`` / ``cudnnRNNBackwardData`` /
``BackwardWeights``), which runs, per layer and direction, the input GEMM over the sequence and
per step one recurrent GEMM and one fused pointwise kernel for all the gates (NVIDIA, "Optimizing
Recurrent Neural Networks in cuDNN 5", Appleyard, 2016: the four gates' GEMMs combined into one
and the pointwise operations fused into one kernel per step), not one kernel per ATen op.

:func:`tagged_rnns` wraps those calls in ``custom["rnn"] = {"mode", "id"}``; the backward's
nodes get their forward call's tag (:func:`.capture._backward_module_stacks`), the lowering copies
it to ``attrs["rnn"]``, and :func:`sftctl.compiler.modes.eager_kernels` groups the tagged nodes as
the compiler fuses them (a GEMM with its epilogue, the step's gates in one kernel).
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from torch.fx import traceback as fx_traceback

_MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")
_ids = itertools.count(1)


@contextlib.contextmanager
def tagged_rnns():
    """While a step is traced: each ``torch._VF`` RNN call's nodes carry ``custom["rnn"]``."""
    vf = torch._VF
    saved = {m: vf.__dict__.get(m) for m in _MODES}

    def wrap(mode):
        orig = getattr(vf, mode)

        def call(*args, **kwargs):
            with fx_traceback.annotate({"rnn": {"mode": mode, "id": next(_ids)}}):
                return orig(*args, **kwargs)
        return call

    for m in _MODES:
        setattr(vf, m, wrap(m))
    try:
        yield
    finally:
        for m in _MODES:
            if saved[m] is None:
                vf.__dict__.pop(m, None)
            else:
                setattr(vf, m, saved[m])
