"""CTC loss while tracing: ``aten._ctc_loss.Tensor`` (``F.ctc_loss`` with tensor lengths, as
wav2vec2-for-CTC and Conformer-CTC recipes call it) as the op ``sftctl::ctc_loss``.

torch's fake kernel of ``_ctc_loss.Tensor`` cannot give ``log_alpha``'s shape without data (its
last dim is ``2 * max(target_lengths) + 1``), so a trace on fake tensors died with
``DynamicOutputShapeException``. While tracing, :func:`decompositions` sends it to
``sftctl::ctc_loss``, whose ``log_alpha`` is sized by the static bound of the targets
(``targets.size(1)`` padded, ``targets.numel()`` concatenated); autograd's formula still calls
``_ctc_loss_backward.Tensor`` with it. Both lower in :mod:`.lowerings.ctc`.
"""

from __future__ import annotations

import torch


def _bound(targets: torch.Tensor) -> int:
    return int(targets.shape[1]) if targets.dim() == 2 else int(targets.numel())


@torch.library.custom_op("sftctl::ctc_loss", mutates_args=())
def ctc_loss_op(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
                target_lengths: torch.Tensor, blank: int, zero_infinity: bool) -> tuple[torch.Tensor, torch.Tensor]:
    nll, alpha = torch.ops.aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)
    width = 2 * _bound(targets) + 1
    pad = alpha.new_full((*alpha.shape[:2], width - alpha.shape[2]), float("-inf"))
    return nll, torch.cat([alpha, pad], dim=2)


@ctc_loss_op.register_fake
def _(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    batch = log_probs.shape[1] if log_probs.dim() == 3 else 1
    return (log_probs.new_empty((batch,)),
            log_probs.new_empty((batch, log_probs.shape[0], 2 * _bound(targets) + 1)))


def _ctc_decomposition(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    return torch.ops.sftctl.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)


def decompositions() -> dict:
    """``{aten._ctc_loss.Tensor: -> sftctl::ctc_loss}`` for make_fx's decomposition table."""
    return {torch.ops.aten._ctc_loss.Tensor: _ctc_decomposition}
