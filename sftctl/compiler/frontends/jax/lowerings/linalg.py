"""Contractions: ``dot_general`` and ``conv_general_dilated`` (an IR ``conv`` between transposes
to the IR's NCHW / OIHW layout)."""

from __future__ import annotations

from sftctl.compiler.frontends.jax.lowering import _prim


@_prim("dot_general")
def _dot_general(self, args, p, shape, dtype):
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    return [self.add("dot_general", args[:2], shape, dtype, lhs_batch=tuple(int(d) for d in lb),
                     rhs_batch=tuple(int(d) for d in rb), lhs_contract=tuple(int(d) for d in lc),
                     rhs_contract=tuple(int(d) for d in rc))]


@_prim("conv_general_dilated")
def _conv_general_dilated(self, args, p, shape, dtype):
    return [_conv_nchw(self, args[0], args[1], p, shape, dtype)]


def _conv_nchw(self, lhs: int, rhs: int, p, shape, dtype) -> int:
    """``lax.conv_general_dilated``: operands transposed to NCHW / OIHW, an IR ``conv``, the
    result transposed back from NCHW to the equation's output layout."""
    dn = p["dimension_numbers"]
    lspec, rspec, ospec = (tuple(int(d) for d in s_) for s_ in (dn.lhs_spec, dn.rhs_spec, dn.out_spec))
    x = self.transpose(self.cast(lhs, dtype), lspec)
    w = self.transpose(self.cast(rhs, dtype), rspec)
    nsp = len(lspec) - 2
    lhs_dil = tuple(int(d) for d in (p.get("lhs_dilation") or (1,) * nsp))
    rhs_dil = tuple(int(d) for d in (p.get("rhs_dilation") or (1,) * nsp))
    out_nchw = tuple(shape[d] for d in ospec)
    y = self.add("conv", [x, w], out_nchw, dtype, stride=tuple(int(s_) for s_ in p["window_strides"]),
                 padding=tuple((int(lo), int(hi)) for lo, hi in p["padding"]), lhs_dilation=lhs_dil,
                 rhs_dilation=rhs_dil, feature_group_count=int(p["feature_group_count"]),
                 batch_group_count=int(p["batch_group_count"]))
    inv = [0] * len(ospec)
    for i, d in enumerate(ospec):
        inv[d] = i
    return self.transpose(y, inv)
