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


def _through_casts(node):
    while getattr(node, "op", None) == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in (
            "_to_copy", "convert_element_type", "clone", "alias", "view", "to"):
        node = node.args[0]
    return node


def _padded_targets(targets: torch.Tensor, target_lengths) -> torch.Tensor | None:
    """``labels.masked_select(mask)`` with ``target_lengths = mask.sum(-1)`` (transformers' CTC
    loss) as the padded ``[B, S]`` targets with each row's selected labels first, in order
    (a stable sort of the row by ``~mask``): the same bags, and a static size. None for any
    other form of concatenated targets."""
    from torch.fx.experimental.proxy_tensor import get_innermost_proxy_mode, get_proxy_slot

    mode = get_innermost_proxy_mode()
    if mode is None or not isinstance(target_lengths, torch.Tensor):
        return None
    try:
        sel = get_proxy_slot(targets, mode.tracer).proxy.node
        lens = _through_casts(get_proxy_slot(target_lengths, mode.tracer).proxy.node)
    except Exception:  # noqa: BLE001 - not traced tensors
        return None
    if getattr(sel, "target", None) is not torch.ops.aten.masked_select.default:
        return None
    labels, mask = (a.meta.get("val") for a in sel.args[:2])
    if not (isinstance(labels, torch.Tensor) and isinstance(mask, torch.Tensor) and labels.dim() == 2
            and tuple(mask.shape) == tuple(labels.shape)):
        return None
    if not (getattr(lens, "target", None) is torch.ops.aten.sum.dim_IntList
            and _through_casts(lens.args[0]) is sel.args[1] and list(lens.args[1]) in ([-1], [1])):
        return None
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    return torch.gather(labels, 1, order)


def _ctc_decomposition(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    if targets.dim() == 1 and not isinstance(targets.numel(), int):  # a data-dependent length
        padded = _padded_targets(targets, target_lengths)
        if padded is not None:
            targets = padded
    return torch.ops.sftctl.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)


@torch.library.custom_op("sftctl::ctc_loss_backward", mutates_args=())
def ctc_loss_backward_op(grad: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor,
                         input_lengths: torch.Tensor, target_lengths: torch.Tensor, nll: torch.Tensor,
                         log_alpha: torch.Tensor, blank: int, zero_infinity: bool) -> torch.Tensor:
    width = 2 * int(target_lengths.max()) + 1 if target_lengths.numel() else 1
    return torch.ops.aten._ctc_loss_backward.Tensor(grad, log_probs, targets, input_lengths, target_lengths, nll,
                                                    log_alpha[..., :width].contiguous(), blank, zero_infinity)


@ctc_loss_backward_op.register_fake
def _(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank, zero_infinity):
    return torch.empty_like(log_probs)


def _ctc_backward_decomposition(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood,
                                log_alpha, blank, zero_infinity=False):
    if targets.dim() == 1 and not isinstance(targets.numel(), int):  # masked_select targets, as forward
        padded = _padded_targets(targets, target_lengths)
        if padded is not None:
            targets = padded
    return torch.ops.sftctl.ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths,
                                              neg_log_likelihood, log_alpha, blank, zero_infinity)


def decompositions() -> dict:
    """``{aten._ctc_loss.Tensor: -> sftctl::ctc_loss, aten._ctc_loss_backward.Tensor: ->
    sftctl::ctc_loss_backward}`` for make_fx's decomposition table (the backward has no fake
    kernel in torch, so a fake trace could not record it)."""
    return {torch.ops.aten._ctc_loss.Tensor: _ctc_decomposition,
            torch.ops.aten._ctc_loss_backward.Tensor: _ctc_backward_decomposition}
