"""Cut a step's graph into kernels: which ops run together, and what each kernel moves.

Rules (each saves the intermediate tensor's write and read and one launch, so under the cost
model a legal fusion never loses; greedy application is therefore optimal for these rules):

* layout ops (reshape, transpose, broadcast, slice, concatenate, pad, reverse) and sources (inputs,
  constants, iota) are free: a consumer reads through them with index math. A transposed
  operand of a contraction becomes part of its prologue (``a_transposed``/``b_transposed``).
* every ``dot_general`` and every ``conv`` (an implicit GEMM: M = output positions, N = output
  channels, K = input channels x kernel taps, per group) anchors a GEMM kernel; elementwise consumers with the same number of
  elements that only it feeds (bias, activation, residual add, scaling, cast) become its
  epilogue and add the bytes of their other operands.
* elementwise ops and reductions join the kernel of a producer when they iterate over the same
  number of elements (Inductor's rule), so a pointwise chain is one kernel and a softmax or a
  layer norm (reductions with their prologue and epilogue) is one kernel; elementwise ops on a
  reduction's per-row result (a layer norm's ``rsqrt``) join the reduction's kernel too. A
  producer read from outside its kernel is still written. Nodes of different phases (tagged
  ``forward``/``backward``/``optimizer`` by the frontend) never share a kernel: forward and
  backward are compiled as separate graphs, so backward work is not hoisted into the forward.
* ``gather`` and ``scatter_add`` are kernels of their own (data-dependent addressing).
* attention is a kernel of its own (kind ``attention``), as flash attention runs it: the
  ``attention`` and ``attention_lse`` nodes of one call are one forward kernel (reads Q, K, V and
  the mask; writes O and the LSE), and the ``attention_grad`` nodes of one call are one backward
  kernel (reads Q, K, V, O, dO, LSE and the mask; writes dQ, dK, dV). K and V are read at their
  own head count (GQA). FLOPs are the matrix products flash attention does, over the kept
  fraction of the score matrix (:func:`attention_flops`); the S x S scores are never memory.
  ``rng_bernoulli`` is elementwise (a random mask generated where it is used); a ``cumsum`` scan
  fuses like an elementwise op over its elements (never into a GEMM epilogue).
* the optimizer's per-parameter updates, independent of each other, are batched into one launch
  (horizontal fusion, as fused AdamW's ``multi_tensor_apply`` does).

A kernel's bytes are what it reads from and writes to memory: each distinct external tensor it
reads (through views; a broadcast reads its smaller source), and each tensor it produces that
something outside the kernel (or the step's outputs) reads.
"""

from __future__ import annotations

import dataclasses
import math

from sftctl.compiler.ir import (
    ATTENTION,
    CONTRACTIONS,
    DTYPE_BYTES,
    DATA,
    ELEMENTWISE,
    RANDOM,
    SCANS,
    LAYOUT,
    REDUCTIONS,
    SOURCES,
    Graph,
    Node,
    conv_gemm_dims,
    conv_lhs_touched,
)
from sftctl.compiler.problem import GemmProblem


@dataclasses.dataclass
class Kernel:
    """A group of ops that runs as one kernel.

    Attributes:
        kind: ``gemm``, ``pointwise``, ``reduction``, ``data`` or ``attention``.
        nodes: ids of the compute nodes in it, in graph order (the anchor first for gemm).
        reads: ids of the materialized tensors it reads (after looking through views).
        writes: ids of the tensors it materializes.
        bytes_read, bytes_written: memory traffic, bytes.
        flops: arithmetic, FLOPs (2*M*N*K*batch for a GEMM; one per element per op otherwise).
        gemm: for ``gemm`` kernels, its :class:`~sftctl.compiler.problem.GemmProblem` as traced:
            ``batch, m, n, k``, ``dtype`` (the operands' traced dtype), ``out_dtype`` (the main
            output's dtype), ``a_transposed``/``b_transposed``, ``epilogue_bytes_per_elem`` (every
            byte the kernel moves besides its operands and its main output, per output element:
            the epilogue's extra operands (bias, residual) and its extra outputs (a saved
            pre-activation, an fp32 copy)) and ``epilogue_flops_per_elem`` (the kernel's FLOPs
            besides the GEMM's, per output element); None otherwise.
        out_dtype: for ``gemm`` kernels, the dtype of the main output the kernel stores
            (``gemm.out_dtype``).
    """

    kind: str
    nodes: list[int]
    reads: list[int] = dataclasses.field(default_factory=list)
    writes: list[int] = dataclasses.field(default_factory=list)
    bytes_read: int = 0
    bytes_written: int = 0
    flops: float = 0.0
    gemm: GemmProblem | None = None
    out_dtype: str | None = None  # gemm: dtype of the output the GEMM stores (its epilogue's result)
    attention: dict | None = None  # for ``attention`` kernels: see :func:`attention_shape`
    horizontal: int = 1  # independent kernels batched into this launch (multi-tensor apply)

    @property
    def anchor(self) -> int:
        return self.nodes[0]


def source_of(graph: Graph, nid: int) -> int:
    """Follow layout ops back to the tensor that is actually in memory."""
    node = graph.nodes[nid]
    while node.op in LAYOUT and node.op not in ("concatenate", "pad") and node.inputs:
        node = graph.nodes[node.inputs[0]]
    return node.id


def _is_free(node: Node) -> bool:
    return node.op in LAYOUT or node.op in SOURCES


def _real_users(graph: Graph) -> list[set[int]]:
    """For each node, the compute nodes that read it (seen through free layout ops)."""
    users = graph.users()
    real_users: list[set[int]] = [set() for _ in graph.nodes]
    for n in reversed(graph.nodes):
        for u in users[n.id]:
            if _is_free(graph.nodes[u]):
                real_users[n.id] |= real_users[u]
            else:
                real_users[n.id].add(u)
    return real_users


def kind_of(graph: Graph, nodes: list[int]) -> str:
    """The kernel kind of a group of compute nodes: ``attention`` for an attention call, ``gemm``
    if it contracts, ``data`` for a gather/scatter, ``reduction`` if it reduces, else
    ``pointwise``."""
    ops = {graph.nodes[i].op for i in nodes}
    if ops & ATTENTION:
        return "attention"
    if ops & CONTRACTIONS:
        return "gemm"
    if ops & DATA:
        return "data"
    return "reduction" if ops & REDUCTIONS else "pointwise"


def regroup(graph: Graph, groups: list[list[int]], kinds: list[str] | None = None) -> list[Kernel]:
    """Kernels from explicit groups of compute nodes (each group one launch), accounted like
    :func:`fuse`'s and put in dependency order. Used for the execution modes that do not fuse as
    :func:`fuse` does (eager PyTorch: one kernel per dispatched ATen op; see
    :mod:`sftctl.compiler.modes`). A contraction is each group's anchor (listed first).
    """
    real_users = _real_users(graph)
    outputs = set(graph.outputs)
    group_of: dict[int, int] = {}
    kernels: list[Kernel] = []
    for gi, nodes in enumerate(groups):
        nodes = sorted(nodes, key=lambda i: (graph.nodes[i].op not in CONTRACTIONS, i))
        kernels.append(Kernel(kinds[gi] if kinds else kind_of(graph, nodes), nodes))
        for i in nodes:
            group_of[i] = gi
    for k in kernels:
        _account(graph, k, group_of, real_users, outputs)
    return _order(graph, kernels, group_of)


def fuse(graph: Graph, gemm_epilogues: bool = True, horizontal: bool = True,
         barrier: frozenset[int] | set[int] = frozenset()) -> list[Kernel]:
    """Partition ``graph``'s compute nodes into kernels, in an order that respects dependencies.

    ``gemm_epilogues=False`` keeps every GEMM alone (a library GEMM, as Inductor's extern
    ``mm``: elementwise consumers then fuse among themselves); ``horizontal=False`` leaves the
    optimizer's per-parameter updates as separate kernels; nodes in ``barrier`` neither join
    nor are joined (ops that run outside the fused program).

    Returns the kernels with their traffic and FLOPs filled in. Raises ValueError for an op the
    IR does not know.
    """
    real_users = _real_users(graph)
    outputs = set(graph.outputs)
    group_of: dict[int, int] = {}
    kernels: list[Kernel] = []

    deps: list[set[int]] = []  # kernel -> kernels it reads from

    def only_user_is(producer: int, consumer: int) -> bool:
        return real_users[producer] == {consumer} and producer not in outputs

    def input_kernels(node: Node) -> set[int]:
        return {group_of[s] for s in (source_of(graph, i) for i in node.inputs) if s in group_of}

    def reaches(start: int, goal: int) -> bool:
        """Whether kernel ``start`` depends, directly or not, on kernel ``goal``."""
        stack, seen = [start], {start}
        while stack:
            g = stack.pop()
            if g == goal:
                return True
            for d in deps[g] - seen:
                seen.add(d)
                stack.append(d)
        return False

    domain: list[int] = []  # kernel -> elements it iterates over
    rows: list[set[int]] = []  # kernel -> output sizes of its reductions (its per-row values)
    phase: list[str] = []  # kernel -> the step phase of its first node ("" untagged)

    def new_kernel(kind: str, node: Node) -> None:
        group_of[node.id] = len(kernels)
        kernels.append(Kernel(kind, [node.id]))
        phase.append(node.attrs.get("phase", ""))
        domain.append(_domain(graph, node))
        rows.append({node.type.numel} if node.op in REDUCTIONS else set())
        deps.append(input_kernels(node) - {group_of[node.id]})

    attention_calls: dict[tuple, int] = {}  # one kernel per attention call and direction
    for node in graph.nodes:
        if _is_free(node):
            continue
        if node.op in CONTRACTIONS:
            new_kernel("gemm", node)
            continue
        if node.op in ATTENTION:
            call = ("bwd" if node.op == "attention_grad" else "fwd", node.inputs,
                    tuple(sorted((k, v) for k, v in node.attrs.items() if k != "wrt")))
            if call in attention_calls:
                group_of[node.id] = attention_calls[call]
                kernels[attention_calls[call]].nodes.append(node.id)
            else:
                new_kernel("attention", node)
                attention_calls[call] = group_of[node.id]
            continue
        if node.op in DATA:
            new_kernel("data", node)
            continue
        if node.op not in ELEMENTWISE and node.op not in REDUCTIONS and node.op not in RANDOM and node.op not in SCANS:
            raise ValueError(f"fusion: unknown op {node.op!r}")
        target = None
        for inp in node.inputs if node.id not in barrier else ():
            src = source_of(graph, inp)
            if src not in group_of or src in barrier:
                continue
            kph, nph = phase[group_of[src]], node.attrs.get("phase", "")
            if kph and nph and kph != nph:
                continue  # forward and backward compile as separate graphs (AOTAutograd)
            k = kernels[group_of[src]]
            if k.kind == "gemm":
                # epilogue: applied elementwise to the GEMM's output, which nothing else reads
                if (gemm_epilogues and (node.op in ELEMENTWISE or node.op in RANDOM) and only_user_is(src, node.id)
                        and node.type.numel == graph.nodes[k.anchor].type.numel):
                    target = group_of[src]
            elif k.kind in ("pointwise", "reduction") and (
                    _domain(graph, node) == domain[group_of[src]]
                    or (node.op in ELEMENTWISE and node.type.numel in rows[group_of[src]])):
                # same iteration space (Inductor's rule): a multi-output kernel is fine, the
                # producer is still written if a reader outside needs it. Elementwise work on a
                # reduction's per-row result (a layer norm's rsqrt) runs in the reduction's kernel,
                # as Inductor's reduction epilogues do
                target = group_of[src]
            others = input_kernels(node) - {target}
            if target is not None and any(reaches(o, target) for o in others):
                target = None  # joining would make the kernels depend on each other
            if target is not None:
                break
        if target is None:
            new_kernel("reduction" if node.op in REDUCTIONS else "pointwise", node)
        else:
            group_of[node.id] = target
            kernels[target].nodes.append(node.id)
            deps[target] |= input_kernels(node) - {target}
            if node.op in REDUCTIONS:
                kernels[target].kind = "reduction" if kernels[target].kind != "gemm" else "gemm"
                rows[target].add(node.type.numel)

    for k in kernels:
        _account(graph, k, group_of, real_users, outputs)
    ordered = _order(graph, kernels, group_of)
    return _horizontal(ordered, graph) if horizontal else ordered


def _horizontal(kernels: list[Kernel], graph: Graph) -> list[Kernel]:
    """Batch the step's final pointwise updates into one launch (multi-tensor apply).

    Pointwise kernels that only write step outputs (the optimizer's new parameters and state)
    and that no other kernel reads are independent of each other, so they can run as one
    kernel over a list of tensors, as ``torch.optim.AdamW(fused=True)`` and ``_foreach`` ops
    do (``multi_tensor_apply``). The batch runs last; its traffic is the sum of theirs.
    """
    outputs = set(graph.outputs)
    opt = [k for k in kernels if k.kind == "pointwise"
           and all(graph.nodes[n].attrs.get("phase") == "optimizer" for n in k.nodes)]
    clips = any(k.kind != "pointwise" and any(graph.nodes[n].attrs.get("phase") == "optimizer" for n in k.nodes)
                for k in kernels)
    opt_nodes = {n for k in opt for n in k.nodes}
    read_later = any(r in opt_nodes for k in kernels if k not in opt for r in k.reads)
    if len(opt) >= 2 and not clips and not read_later:
        # a tagged optimizer (no gradient-norm reduction in it): the whole update is one fused,
        # multi-tensor kernel (AdamW(fused=True)): it reads parameters, gradients and state
        # once and writes them once; its intermediates stay in registers
        nodes = sorted(n for k in opt for n in k.nodes)
        merged = Kernel("pointwise", nodes, horizontal=sum(1 for k in opt if set(k.writes) & outputs) or len(opt))
        group_of = {n: i for i, k in enumerate(kernels) for n in k.nodes}
        for n in nodes:
            group_of[n] = -1
        _account(graph, merged, group_of, _real_users(graph), outputs)
        ids = {id(k) for k in opt}
        return [k for k in kernels if id(k) not in ids] + [merged]
    read_elsewhere = {r for k in kernels for r in k.reads}
    leaves = [k for k in kernels if k.kind == "pointwise" and k.writes
              and set(k.writes) <= outputs and not set(k.writes) & read_elsewhere]
    if len(leaves) < 2:
        return kernels
    merged = Kernel("pointwise", [n for k in leaves for n in k.nodes],
                    reads=sorted({r for k in leaves for r in k.reads}),
                    writes=[w for k in leaves for w in k.writes],
                    bytes_read=sum(k.bytes_read for k in leaves),
                    bytes_written=sum(k.bytes_written for k in leaves),
                    flops=sum(k.flops for k in leaves), horizontal=len(leaves))
    ids = {id(k) for k in leaves}
    return [k for k in kernels if id(k) not in ids] + [merged]


def _domain(graph: Graph, node: Node) -> int:
    """Elements a node iterates over: a reduction's input, anything else's output."""
    if node.op in REDUCTIONS:
        return graph.nodes[node.inputs[0]].type.numel
    return node.type.numel


def _account(graph: Graph, k: Kernel, group_of: dict[int, int], real_users, outputs: set[int]) -> None:
    mine = set(k.nodes)
    reads: dict[int, int] = {}
    for nid in k.nodes:
        for inp in graph.nodes[nid].inputs:
            src = source_of(graph, inp)
            if src in mine:
                continue
            srcnode = graph.nodes[src]
            if srcnode.op in ("constant", "iota"):
                continue
            nbytes = srcnode.type.nbytes
            node = graph.nodes[nid]
            if node.op == "gather" and inp == node.inputs[0]:
                # a gather reads one source element per output element (index count x row bytes),
                # not its whole source (an embedding lookup, a cross-entropy's target logits)
                nbytes = min(nbytes, node.type.numel * DTYPE_BYTES[srcnode.type.dtype])
            elif node.op == "conv" and inp == node.inputs[0]:
                # a strided convolution reads only the input positions its windows cover
                touched = conv_lhs_touched(graph.nodes[inp].type.shape, graph.nodes[node.inputs[1]].type.shape,
                                           node.type.shape, node.attrs)
                nbytes = min(nbytes, touched * DTYPE_BYTES[srcnode.type.dtype])
            reads[src] = max(reads.get(src, 0), nbytes)
    writes = [
        nid for nid in k.nodes
        if nid in outputs or any(group_of.get(u) != group_of[nid] and u not in mine for u in real_users[nid])
    ]
    k.reads = sorted(reads)
    k.writes = writes
    k.bytes_read = sum(reads.values())
    k.bytes_written = sum(graph.nodes[w].type.nbytes for w in writes)
    flops = 0.0
    if k.kind == "attention":
        k.attention = attention_shape(graph, graph.nodes[k.anchor])
        k.flops = attention_flops(k.attention)
        return
    for nid in k.nodes:
        n = graph.nodes[nid]
        if n.op in CONTRACTIONS:
            flops += 2.0 * math.prod(_gemm_dims(graph, n))
        elif n.op in REDUCTIONS:
            flops += graph.nodes[n.inputs[0]].type.numel
        else:
            flops += n.type.numel
    k.flops = flops
    if k.kind == "gemm":
        anchor = graph.nodes[k.anchor]
        batch, m, n_, kk = _gemm_dims(graph, anchor)
        a_t, b_t = _transposed(graph, anchor)
        out_elems = max(1, anchor.type.numel)
        operand_bytes = sum(reads.get(source_of(graph, i), 0) for i in dict.fromkeys(anchor.inputs))
        # the main output: the last full-size tensor the kernel writes (its epilogue's result);
        # every other write (a saved pre-activation, an fp32 copy) is charged as epilogue bytes
        full = [w for w in writes if graph.nodes[w].type.numel == anchor.type.numel]
        main = graph.nodes[full[-1]] if full else anchor
        main_bytes = main.type.nbytes if full else 0
        extra = max(0, k.bytes_read - operand_bytes) + max(0, k.bytes_written - main_bytes)
        k.out_dtype = main.type.dtype
        gemm_elems = max(1, batch * m * n_)
        if gemm_elems < out_elems:
            # a strided convolution's input gradient: the GEMM computes ceil(out / stride)
            # positions per dim, the kernel still stores every element of its (larger) output
            extra += (out_elems - gemm_elems) * DTYPE_BYTES[main.type.dtype]
        k.gemm = GemmProblem(
            batch=batch, m=m, n=n_, k=kk, dtype=graph.nodes[anchor.inputs[0]].type.dtype, out_dtype=main.type.dtype,
            a_transposed=a_t, b_transposed=b_t, epilogue_bytes_per_elem=extra / gemm_elems,
            epilogue_flops_per_elem=max(0.0, flops - 2.0 * batch * m * n_ * kk) / gemm_elems)


def causal_fraction(L: int, S: int) -> float:
    """Fraction of an L x S score matrix a top-left-aligned causal mask keeps (j <= i)."""
    kept = sum(min(i + 1, S) for i in range(L)) if L <= 4096 else (
        min(L, S) * (min(L, S) + 1) / 2 + max(0, L - S) * S)
    return kept / (L * S) if L and S else 0.0


#: ops a query/key position index passes through unchanged in order (HF's cache_position offsets,
#: unsqueezes, broadcasts, dtype casts)
_INDEX_OPS = ("reshape", "broadcast", "cast", "add", "sub")


def _position_index(graph: Graph, i: int, depth: int = 0) -> bool:
    """Whether node ``i`` is a position index: an ``iota`` (``torch.arange``) moved only by
    reshapes, broadcasts, casts and additions of constants."""
    n = graph.nodes[i]
    if n.op == "iota":
        return True
    if depth > 12 or n.op not in _INDEX_OPS:
        return False
    args = [j for j in n.inputs if graph.nodes[j].op != "constant"]
    return len(args) == 1 and _position_index(graph, args[0], depth + 1)


def causal_mask(graph: Graph, i: int, depth: int = 0) -> bool:
    """Whether the boolean mask node ``i`` keeps no key after its query: it is, or is a
    ``logical_and`` with, the comparison ``key position <= query position`` of two position
    indexes (:func:`_position_index`; the key's varying along the last axis, the query's along
    the one before), as transformers' ``sdpa_mask`` builds it on traced tensors, where it cannot
    see that an unpadded batch lets it drop the mask and call SDPA with ``is_causal=True``. The
    other terms of the ``and`` (a padding mask from ``batch['attention_mask']``, a sliding
    window) only remove more keys."""
    n = graph.nodes[i]
    if depth > 8:
        return False
    if n.op in ("logical_and", "reshape", "broadcast"):
        return any(causal_mask(graph, j, depth + 1) for j in n.inputs)
    if n.op not in ("le", "lt", "ge", "gt") or len(n.inputs) != 2:
        return False
    a, b = (graph.nodes[j] for j in n.inputs)
    if not all(_position_index(graph, j) for j in n.inputs) or len(a.type.shape) < 2 or len(b.type.shape) < 2:
        return False

    def along(x, axis: int) -> bool:  # varies along ``axis`` only (size > 1 there, 1 on the other)
        other = -1 if axis == -2 else -2
        return x.type.shape[axis] > 1 and x.type.shape[other] == 1

    key_first = along(a, -1) and along(b, -2)   # le(key, query): key <= query
    query_first = along(a, -2) and along(b, -1)  # ge(query, key)
    return (n.op in ("le", "lt") and key_first) or (n.op in ("ge", "gt") and query_first)


def attention_shape(graph: Graph, node: Node) -> dict:
    """The problem an attention kernel solves, from one of its nodes.

    Returns ``{"direction": "forward"|"backward", "batch", "q_heads", "kv_heads", "q_len",
    "kv_len", "head_dim", "v_head_dim", "dtype", "causal", "masked", "dropout_p",
    "kept_fraction", "implementation", "torch", "bias", "alibi", "padding"}`` (``padding``: a
    boolean SDPA mask's verdict on the traced batch, :func:`sftctl.compiler.attention.with_padding`,
    None without one; ``padded`` prices the call as not causal with a ``bias``; ``alibi``: FlashAttention's
    ``alibi_slopes`` given; ``implementation`` and ``torch``: the
    node's ``impl`` and ``torch`` attributes, :func:`sftctl.compiler.attention.with_implementation`,
    ``auto`` and None without them; ``bias``: the mask is an additive float bias, not boolean; lengths in tokens; ``kept_fraction`` is the causal fraction, 1.0 otherwise:
    an explicit mask is not assumed to skip work, as a kernel given a mask tensor computes every
    tile, except a boolean causal mask (:func:`causal_mask`), which is priced causal).
    """
    q, k, v = (graph.nodes[i].type for i in node.inputs[:3])
    B, Hq, L, D = q.shape
    _, Hkv, S, _ = k.shape
    backward = node.op == "attention_grad"
    masked = len(node.inputs) > (6 if backward else 3)
    mask = graph.nodes[node.inputs[-1]] if masked else None
    # a boolean causal mask (transformers' on traced tensors) is the causal kernel's work, unless
    # the batch pads (sftctl.compiler.attention.with_padding): SDPA gets the mask, every tile runs
    padded = node.attrs.get("padding") == "padded"
    causal = bool(node.attrs.get("causal")) or (
        not padded and mask is not None and mask.type.dtype == "bool" and causal_mask(graph, node.inputs[-1]))
    return {
        "direction": "backward" if backward else "forward", "batch": B, "q_heads": Hq, "kv_heads": Hkv,
        "q_len": L, "kv_len": S, "head_dim": D, "v_head_dim": v.shape[-1], "dtype": q.dtype,
        "causal": causal, "masked": masked,
        "dropout_p": float(node.attrs.get("dropout_p", 0.0)),
        "kept_fraction": causal_fraction(L, S) if causal else 1.0,
        "implementation": node.attrs.get("impl", "auto"), "torch": node.attrs.get("torch"),
        "bias": mask is not None and (mask.type.dtype != "bool" or padded),
        "alibi": bool(node.attrs.get("alibi", False)), "padding": node.attrs.get("padding"),
    }


def attention_flops(a: dict) -> float:
    """Matrix FLOPs of flash attention (Dao et al., FlashAttention-2, 2023, section 3).

    Forward: ``Q K^T`` and ``P V``: ``2 * L * S * (D + Dv)`` per (batch, query head).
    Backward: ``Q K^T`` recomputed, ``dV = P^T dO``, ``dP = dO V^T``, ``dQ = dS K``,
    ``dK = dS^T Q``: ``2 * L * S * (3 * D + 2 * Dv)`` (2.5x forward when D == Dv).
    Both times the kept fraction of the scores (causal: about half). Softmax exponentials and
    the rescaling are vector work, not counted here.
    """
    per = a["q_len"] * a["kv_len"] * a["kept_fraction"] * a["batch"] * a["q_heads"]
    D, Dv = a["head_dim"], a["v_head_dim"]
    return 2.0 * per * ((3 * D + 2 * Dv) if a["direction"] == "backward" else (D + Dv))


def _gemm_dims(graph: Graph, node: Node) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a dot_general, or of the implicit GEMM of a ``conv``
    (:func:`~sftctl.compiler.ir.conv_gemm_dims`)."""
    lhs = graph.nodes[node.inputs[0]].type.shape
    rhs = graph.nodes[node.inputs[1]].type.shape
    if node.op == "conv":
        return conv_gemm_dims(lhs, rhs, node.type.shape, node.attrs)
    lb, rb = node.attrs["lhs_batch"], node.attrs["rhs_batch"]
    lc, rc = node.attrs["lhs_contract"], node.attrs["rhs_contract"]
    batch = math.prod(lhs[d] for d in lb)
    k = math.prod(lhs[d] for d in lc)
    m = math.prod(lhs[d] for d in range(len(lhs)) if d not in lb and d not in lc)
    n = math.prod(rhs[d] for d in range(len(rhs)) if d not in rb and d not in rc)
    return batch, m, n, k


def _transposed(graph: Graph, node: Node) -> tuple[bool, bool]:
    """Whether each operand is read K-major-wrong (needs a transposed load) in row-major terms.

    A is row-major (M x K) when its contracting dim is its last; B is row-major (K x N) when its
    contracting dim comes right after its batch dims.
    """
    if node.op == "conv":
        # implicit GEMM as cuDNN / CUTLASS run it on tensor cores: channels-last activations
        # (A is K-contiguous) and filters [O, taps x C] (B is K-contiguous too)
        return False, True
    lhs = graph.nodes[node.inputs[0]].type.shape
    lc, rc = node.attrs["lhs_contract"], node.attrs["rhs_contract"]
    a_t = bool(lc) and max(lc) != len(lhs) - 1
    b_t = bool(rc) and min(rc) != len(node.attrs["rhs_batch"])
    return a_t, b_t


def _order(graph: Graph, kernels: list[Kernel], group_of: dict[int, int]) -> list[Kernel]:
    """Kernels in an order where every kernel runs after the kernels it reads from."""
    deps: list[set[int]] = [set() for _ in kernels]
    for gi, k in enumerate(kernels):
        for r in k.reads:
            if r in group_of and group_of[r] != gi:
                deps[gi].add(group_of[r])
    # kernels are created in graph order of their first node; a fused consumer can make a kernel
    # depend on later-created ones. Topological order that always runs the earliest-created ready
    # kernel next, so the program keeps its own order (a pass-by-pass order would hoist work whose
    # inputs are ready early, such as activation checkpointing's recomputation, into the forward,
    # and liveness would then keep what checkpointing frees)
    import heapq

    users: list[list[int]] = [[] for _ in kernels]
    waiting = [len(d) for d in deps]
    for gi, d in enumerate(deps):
        for j in d:
            users[j].append(gi)
    ready = [gi for gi, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        gi = heapq.heappop(ready)
        order.append(gi)
        for u in users[gi]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) < len(kernels):
        raise ValueError("fusion produced a cycle between kernels")
    return [kernels[i] for i in order]

