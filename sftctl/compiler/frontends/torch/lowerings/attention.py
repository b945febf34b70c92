"""Lowerings of the ``sftctl::attention`` custom op and its backward to the IR's ``attention``, ``attention_lse`` and ``attention_grad``.

Each ``@lowers`` function is the IR lowering of the ATen op packet it is named after (``op_<packet>``),
called as ``fn(lowering, node, *node.args, **node.kwargs)``; see :mod:`..lowering`."""

from __future__ import annotations

from sftctl.compiler.frontends.torch.lowering import lowers


@lowers("sftctl::attention")
def op_sftctl_attention(self, n, q, k, v, mask, causal, scale, dropout_p, rng):
    """``sftctl::attention`` -> IR ``attention`` (O) and ``attention_lse`` (LSE)."""
    (oshape, odt), (lshape, ldt) = self.out_at(0), self.out_at(1)
    ops = [self.arg(q, odt), self.arg(k, odt), self.arg(v, odt)]
    if mask is not None:
        ops.append(self.arg(mask))
    attrs = dict(causal=bool(causal), scale=float(scale), dropout_p=float(dropout_p), rng=int(rng))
    return [self.add("attention", ops, oshape, odt, **attrs), self.add("attention_lse", ops, lshape, ldt, **attrs)]


@lowers("sftctl::attention_backward")
def op_sftctl_attention_backward(self, n, do, q, k, v, mask, o, lse, causal, scale, dropout_p, rng):
    """``sftctl::attention_backward`` -> three IR ``attention_grad`` nodes (dQ, dK, dV)."""
    _, dt = self.out_at(0)
    ops = [self.arg(q, dt), self.arg(k, dt), self.arg(v, dt), self.arg(o, dt), self.arg(do, dt), self.arg(lse)]
    if mask is not None:
        ops.append(self.arg(mask))
    attrs = dict(causal=bool(causal), scale=float(scale), dropout_p=float(dropout_p), rng=int(rng))
    return [self.add("attention_grad", ops, self.out_at(j)[0], self.out_at(j)[1], wrt=w, **attrs)
            for j, w in enumerate("qkv")]
