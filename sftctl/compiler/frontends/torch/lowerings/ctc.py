"""CTC loss (``F.ctc_loss``: wav2vec2 / HuBERT / Conformer-CTC fine-tuning): ``_ctc_loss`` and
``_ctc_loss_backward`` as torch's CPU kernels compute them (aten/src/ATen/native/LossCTC.cpp), the
alpha and beta recursions over the extended label sequence (blanks interleaved, length
``L = 2 S + 1``) unrolled over the ``T`` time steps, in log space, per batch element's own input
and target length (data: the ``.Tensor`` overloads take them as tensors).

Each step is a handful of elementwise ops over [B, L] (a three-way log-sum-exp and the emission
gathered from the log-probabilities), as one CUDA kernel per step would do; the emissions are one
gather of [T, B, L] up front. Unbatched log-probabilities ([T, C]) are unsupported.

Each ``@lowers`` function is the IR lowering of the ATen op packet it is named after (``op_<packet>``),
called as ``fn(lowering, node, *node.args, **node.kwargs)``; see :mod:`..lowering`."""

from __future__ import annotations

import numpy as np
import torch.fx as fx

from sftctl.compiler.frontends.torch.lowering import lowers

_NEG_INF = float("-inf")


def _lengths(self, lengths, batch: int, what: str) -> int:
    """int64 [B] of an ``int[]`` or a tensor of lengths (``what``: its name in the graph)."""
    if isinstance(lengths, fx.Node):
        return self.cast(self.arg(lengths), "int64")
    return self.add("input", [], (batch,), "int64", role="constant", name=f"{self._node.name}_{what}",
                    value=np.asarray(list(lengths), dtype=np.int64))


class _Ctc:
    """The pieces both directions share: extended labels, skip mask, emissions, lengths."""

    def __init__(self, g, log_probs, targets, input_lengths, target_lengths, blank: int, L: int):
        self.g = g
        lp = g.arg(log_probs)
        if len(g.shape(lp)) != 3:
            g.unsupported(g._node, "with unbatched log-probabilities ([T, C])")
        self.T, self.B, self.C = g.shape(lp)
        self.dtype = g.dtype(lp)
        self.L, self.S = L, (L - 1) // 2
        T, B, C, S, dt = self.T, self.B, self.C, self.S, self.dtype
        self.lp = lp
        self.il = _lengths(g, input_lengths, B, "input_lengths")
        self.tl = _lengths(g, target_lengths, B, "target_lengths")
        tg = g.cast(g.arg(targets), "int64")
        if len(g.shape(tg)) == 2:  # [B, S_max] padded
            tgt = g.slice_dim(tg, 1, 0, S) if g.shape(tg)[1] > S else tg
            if g.shape(tgt)[1] < S:
                g.unsupported(g._node, "with targets shorter than the longest target length")
        else:  # concatenated: bag b starts at the sum of the lengths before it
            total = g.shape(tg)[0]
            csum = g.add("cumsum", [self.tl], (B,), "int64", axis=0)
            start = g.binary("sub", csum, self.tl)
            pos = g.binary("add", g.reshape(start, (B, 1)), g.iota((B, S), 1, "int64"))
            pos = g.binary("minimum", pos, g.const(max(total - 1, 0), (), "int64"))
            tgt = g.add("gather", [tg, pos], (B, S), "int64", axis=0) if total else g.const(blank, (B, S), "int64")
        # extended labels [B, L]: blank at even s, the target's (s - 1) / 2-th label at odd s
        s = np.arange(L)
        j = np.clip((s - 1) // 2, 0, max(S - 1, 0))
        if S:
            jid = g.add("input", [], (L,), "int64", role="constant", name=f"{g._node.name}_j", value=j.astype(np.int64))
            picked = g.add("gather", [tgt, jid], (B, L), "int64", axis=1)
        else:
            picked = g.const(blank, (B, L), "int64")
        odd = g.add("input", [], (1, L), "bool", role="constant", name=f"{g._node.name}_odd", value=(s % 2 == 1)[None])
        self.lab = g.add("where", [g.bcast(odd, (B, L)), picked, g.const(blank, (B, L), "int64")], (B, L), "int64")
        # a label may skip the blank before it when it differs from the label two back
        prev2 = g.add("pad", [g.slice_dim(self.lab, 1, 0, max(L - 2, 0))], (B, L), "int64", low=(0, 2), high=(0, 0),
                      value=blank) if L > 2 else g.const(blank, (B, L), "int64")
        self.skip = g.add("logical_and", [g.binary("ne", self.lab, g.const(blank, (), "int64"), "bool"),
                                          g.binary("ne", self.lab, prev2, "bool")], (B, L), "bool")
        # emissions [T, B, L]: log_probs at each extended label
        flat = g.reshape(lp, (T, B * C))
        idx = g.binary("add", self.lab, g.binary("mul", g.iota((B, L), 0, "int64"), g.const(C, (), "int64")))
        self.em = g.reshape(g.add("gather", [flat, g.reshape(idx, (B * L,))], (T, B * L), dt, axis=1), (T, B, L))
        self.s_idx = g.iota((B, L), 1, "int64")

    def ninf(self, shape=None):
        return self.g.const(_NEG_INF, shape if shape is not None else (), self.dtype)

    def lse(self, parts):
        """Log-sum-exp of same-shape IR values, exact where all are -inf."""
        g = self.g
        shape = g.shape(parts[0])
        m = parts[0]
        for p in parts[1:]:
            m = g.add("maximum", [m, p], shape, self.dtype)
        finite = g.add("gt", [m, self.ninf()], shape, "bool")
        ms = g.add("where", [finite, m, g.const(0.0, (), self.dtype)], shape, self.dtype)
        total = None
        for p in parts:
            e = g.add("exp", [g.add("sub", [p, ms], shape, self.dtype)], shape, self.dtype)
            total = e if total is None else g.add("add", [total, e], shape, self.dtype)
        return g.add("add", [g.add("log", [total], shape, self.dtype), ms], shape, self.dtype)

    def shift(self, x, by: int, where_ok=None):
        """``x`` moved ``by`` positions along L (filled with -inf; ``by`` < 0 moves it down),
        and -inf where ``where_ok`` is false."""
        g = self.g
        B, L = self.B, self.L
        if abs(by) >= L:
            return self.ninf((B, L))
        if by > 0:
            out = g.add("pad", [g.slice_dim(x, 1, 0, L - by)], (B, L), self.dtype, low=(0, by), high=(0, 0),
                        value=_NEG_INF)
        else:
            out = g.add("pad", [g.slice_dim(x, 1, -by, L)], (B, L), self.dtype, low=(0, 0), high=(0, -by),
                        value=_NEG_INF)
        if where_ok is not None:
            out = g.add("where", [where_ok, out, self.ninf()], (B, L), self.dtype)
        return out

    def at_time(self, seq, t_index):
        """Rows of ``seq`` [T, B, L] at each batch element's own time ``t_index`` [B] -> [B, L]."""
        g = self.g
        T, B, L = self.T, self.B, self.L
        t = g.binary("maximum", t_index, g.const(0, (), "int64"))
        row = g.binary("add", g.binary("mul", g.reshape(t, (B, 1)), g.const(B * L, (), "int64")),
                       g.binary("mul", g.iota((B, 1), 0, "int64"), g.const(L, (), "int64")))
        flat = g.binary("add", g.bcast(row, (B, L)), self.s_idx)
        picked = g.add("gather", [g.reshape(seq, (T * B * L,)), g.reshape(flat, (B * L,))], (B * L,), self.dtype, axis=0)
        return g.reshape(picked, (B, L))

    def last_two(self):
        """bool [B, L]: the positions a path may end at (2 tl and 2 tl - 1)."""
        g = self.g
        two = g.reshape(g.binary("mul", self.tl, g.const(2, (), "int64")), (self.B, 1))
        end = g.binary("eq", self.s_idx, two, "bool")
        before = g.binary("eq", self.s_idx, g.binary("sub", two, g.const(1, (), "int64")), "bool")
        return g.add("logical_or", [end, before], (self.B, self.L), "bool")

    def alphas(self):
        """log alpha [T, B, L] (each t computed for every batch element; rows past its input
        length are never read)."""
        g = self.g
        B, L = self.B, self.L
        em = [g.reshape(g.slice_dim(self.em, 0, t, t + 1), (B, L)) for t in range(self.T)]
        first = g.binary("lt", self.s_idx, g.const(2, (), "int64"), "bool")
        alpha = g.add("where", [first, em[0], self.ninf()], (B, L), self.dtype)
        out = [alpha]
        for t in range(1, self.T):
            alpha = g.add("add", [self.lse([alpha, self.shift(alpha, 1), self.shift(alpha, 2, self.skip)]), em[t]],
                          (B, L), self.dtype)
            out.append(alpha)
        return g.add("concatenate", [g.reshape(a, (1, B, L)) for a in out], (self.T, B, L), self.dtype, axis=0), em

    def nll(self, alphas):
        g = self.g
        final = self.at_time(alphas, g.binary("sub", self.il, g.const(1, (), "int64")))
        ends = g.add("where", [self.last_two(), final, self.ninf()], (self.B, self.L), self.dtype)
        m = g.add("max", [ends], (self.B, 1), self.dtype, axes=(1,), keepdim=True)
        ms = g.add("where", [g.add("gt", [m, self.ninf()], (self.B, 1), "bool"), m, g.const(0.0, (), self.dtype)],
                   (self.B, 1), self.dtype)
        s = g.add("sum", [g.add("exp", [g.binary("sub", ends, ms)], (self.B, self.L), self.dtype)], (self.B, 1),
                  self.dtype, axes=(1,), keepdim=True)
        return g.reshape(g.add("neg", [g.binary("add", g.add("log", [s], (self.B, 1), self.dtype), ms)], (self.B, 1),
                               self.dtype), (self.B,))


@lowers("_ctc_loss", "sftctl::ctc_loss")
def op__ctc_loss(self, n, log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """``[neg_log_likelihood [B], log_alpha [B, T, L]]``; ``zero_infinity`` sets impossible
    alignments' loss to 0."""
    (_, dtype), (ashape, _) = self.out_at(0), self.out_at(1)
    ctc = _Ctc(self, log_probs, targets, input_lengths, target_lengths, int(blank), ashape[2])
    alphas, _ = ctc.alphas()
    nll = ctc.nll(alphas)
    if zero_infinity:
        nll = self.add("where", [self.binary("eq", nll, self.const(float("inf"), (), dtype), "bool"),
                                 self.const(0.0, (), dtype), nll], (ctc.B,), dtype)
    return [nll, self.transpose(alphas, (1, 0, 2))]


@lowers("_ctc_loss_backward", "sftctl::ctc_loss_backward")
def op__ctc_loss_backward(self, n, grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood,
                          log_alpha, blank, zero_infinity=False):
    """The log-probabilities' gradient [T, B, C], as torch's kernel: the beta recursion from
    each element's last step, then ``(exp(lp) - exp(log sum_{s: l'_s = c} exp(alpha + beta) +
    nll - lp)) * grad`` for t < its input length, 0 after it (and for an impossible alignment
    under ``zero_infinity``)."""
    shape, dtype = self.out()
    L = self.shape(self.arg(log_alpha))[2]
    ctc = _Ctc(self, log_probs, targets, input_lengths, target_lengths, int(blank), L)
    T, B, C = ctc.T, ctc.B, ctc.C
    alphas = self.transpose(self.arg(log_alpha, dtype), (1, 0, 2))  # [T, B, L]
    nll = self.arg(neg_log_likelihood, dtype)
    last = self.binary("sub", ctc.il, self.const(1, (), "int64"))
    ends = ctc.last_two()
    skip_up = ctc.shift(self.cast(ctc.skip, dtype), -2)  # may s jump to s + 2 (the label two up skips)
    skip_up = self.binary("eq", skip_up, self.const(1.0, (), dtype), "bool")
    betas = [None] * T
    beta = ctc.ninf((B, L))
    for t in range(T - 1, -1, -1):
        em = self.reshape(self.slice_dim(ctc.em, 0, t, t + 1), (B, L))
        rec = self.add("add", [ctc.lse([beta, ctc.shift(beta, -1), ctc.shift(beta, -2, skip_up)]), em], (B, L), dtype)
        init = self.add("where", [ends, em, ctc.ninf()], (B, L), dtype)
        is_last = self.reshape(self.binary("eq", last, self.const(t, (), "int64"), "bool"), (B, 1))
        before = self.reshape(self.binary("gt", last, self.const(t, (), "int64"), "bool"), (B, 1))
        beta = self.add("where", [self.bcast(is_last, (B, L)), init,
                                  self.add("where", [self.bcast(before, (B, L)), rec, ctc.ninf()], (B, L), dtype)],
                        (B, L), dtype)
        betas[t] = beta
    betas = self.add("concatenate", [self.reshape(b, (1, B, L)) for b in betas], (T, B, L), dtype, axis=0)
    # sum over the positions of each label c of exp(alpha + beta + nll): a scatter-add into C
    ab = self.binary("add", self.binary("add", alphas, betas), self.reshape(nll, (1, B, 1)))
    weight = self.add("exp", [ab], (T, B, L), dtype)
    idx = self.binary("add", ctc.lab, self.binary("mul", self.iota((B, L), 0, "int64"), self.const(C, (), "int64")))
    per_c = self.add("scatter_add", [self.reshape(weight, (T, B * L)), self.reshape(idx, (B * L,))], (T, B * C),
                     dtype, axis=1, size=B * C)
    lp = self.arg(log_probs, dtype)
    per_c = self.reshape(per_c, (T, B, C))
    res = self.binary("sub", self.add("exp", [lp], (T, B, C), dtype),
                      self.binary("mul", per_c, self.add("exp", [self.add("neg", [lp], (T, B, C), dtype)], (T, B, C), dtype)))
    live = self.binary("lt", self.iota((T, B, 1), 0, "int64"), self.reshape(ctc.il, (1, B, 1)), "bool")
    ok = live
    if zero_infinity:
        finite = self.reshape(self.binary("ne", nll, self.const(float("inf"), (), dtype), "bool"), (1, B, 1))
        ok = self.add("logical_and", [self.bcast(live, (T, B, 1)), self.bcast(finite, (T, B, 1))], (T, B, 1), "bool")
    res = self.add("where", [self.bcast(ok, (T, B, C)), res, self.const(0.0, (), dtype)], (T, B, C), dtype)
    return self.binary("mul", res, self.reshape(self.arg(grad, dtype), (1, B, 1)))
