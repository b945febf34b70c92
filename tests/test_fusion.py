"""How the graph is cut into kernels: epilogues, pointwise chains, reductions, no cycles."""

from __future__ import annotations

from sftctl.compiler.fusion import fuse
from sftctl.compiler.ir import Graph


def linear_gelu_softmax() -> tuple[Graph, dict]:
    g = Graph()
    x = g.add("input", [], (64, 32), "float32", role="batch", name="x")
    w = g.add("input", [], (32, 16), "float32", role="param", name="w")
    b = g.add("input", [], (16,), "float32", role="param", name="b")
    mm = g.add("dot_general", [x, w], (64, 16), "float32", lhs_batch=(), rhs_batch=(), lhs_contract=(1,), rhs_contract=(0,))
    bb = g.add("broadcast_in_dim", [b], (64, 16), "float32", shape=(64, 16), dims=(1,))
    y = g.add("add", [mm, bb], (64, 16), "float32")
    t = g.add("tanh", [y], (64, 16), "float32")
    m = g.add("max", [t], (64, 1), "float32", axes=(1,), keepdim=True)
    mb = g.add("broadcast_in_dim", [m], (64, 16), "float32", shape=(64, 16), dims=(0, 1))
    # t is read by two kernels' worth of consumers: the max and the subtraction
    d = g.add("sub", [t, mb], (64, 16), "float32")
    e = g.add("exp", [d], (64, 16), "float32")
    s = g.add("sum", [e], (64, 1), "float32", axes=(1,), keepdim=True)
    sb = g.add("broadcast_in_dim", [s], (64, 16), "float32", shape=(64, 16), dims=(0, 1))
    p = g.add("div", [e, sb], (64, 16), "float32")
    g.outputs = [p]
    g.output_roles = ["loss"]
    return g, dict(x=x, w=w, b=b, mm=mm, y=y, t=t, m=m, d=d, e=e, s=s, p=p)


def test_epilogue_and_reduction_fusion():
    g, ids = linear_gelu_softmax()
    kernels = fuse(g)
    by_anchor = {k.anchor: k for k in kernels}
    gemm = by_anchor[ids["mm"]]
    assert gemm.kind == "gemm"
    # bias add and tanh ride in the GEMM's epilogue; tanh's output has two readers, so it is written
    assert gemm.nodes == [ids["mm"], ids["y"], ids["t"]]
    assert gemm.writes == [ids["t"]]
    p = gemm.gemm
    assert (p.batch, p.m, p.n, p.k, p.dtype, p.out_dtype) == (1, 64, 16, 32, "float32", "float32")
    assert p.epilogue_bytes_per_elem == 16 * 4 / (64 * 16)  # the bias bytes spread over the outputs
    assert p.epilogue_flops_per_elem == 2.0  # bias add and tanh: one FLOP each per output
    assert gemm.bytes_read == (64 * 32 + 32 * 16 + 16) * 4
    assert gemm.flops == 2 * 64 * 16 * 32 + 2 * 64 * 16
    # the whole softmax (max, sub, exp, sum, div) is one kernel: same iteration space
    assert len(kernels) == 2
    soft = by_anchor[ids["m"]]
    assert soft.kind == "reduction" and soft.nodes == [ids["m"], ids["d"], ids["e"], ids["s"], ids["p"]]
    assert soft.reads == [ids["t"]] and soft.writes == [ids["p"]]
    order = [k.anchor for k in kernels]
    assert order.index(ids["mm"]) < order.index(ids["m"])
    # every compute node is in exactly one kernel
    compute = [n.id for n in g.nodes if n.op not in ("input", "broadcast_in_dim")]
    assert sorted(i for k in kernels for i in k.nodes) == sorted(compute)


def test_fusion_never_creates_cycles():
    g = Graph()
    a = g.add("input", [], (8, 8), "float32", role="batch")
    x = g.add("exp", [a], (8, 8), "float32")          # kernel K1
    r = g.add("sum", [x], (8, 1), "float32", axes=(1,), keepdim=True)  # joins K1? x has two users
    rb = g.add("broadcast_in_dim", [r], (8, 8), "float32", shape=(8, 8), dims=(0, 1))
    y = g.add("mul", [x, rb], (8, 8), "float32")
    g.outputs = [y]
    kernels = fuse(g)
    pos = {nid: i for i, k in enumerate(kernels) for nid in k.nodes}
    for i, k in enumerate(kernels):
        for rd in k.reads:
            if rd in pos:
                assert pos[rd] <= i
