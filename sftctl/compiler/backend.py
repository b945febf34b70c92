"""``torch.compile(model, backend="sftensor")``: ATen graphs with searched Triton GEMMs.

The backend runs through AOTAutograd (``torch._dynamo.backends.common.aot_autograd``), so the
forward *and* the backward ATen graphs of a training step reach :meth:`SftensorBackend.compile_aten`.
For each graph it

1. lowers what it can to the IR (:func:`lower_fx_to_ir`: the torch frontend's op-by-op lowering,
   with every op it cannot lower kept as an opaque input) and fuses it (:func:`~sftctl.compiler.fusion.fuse`),
   for a per-graph report (ops lowered, kernels, the model's predicted time);
2. finds the GEMM sites (:func:`find_gemm_sites`): ``aten.mm`` / ``aten.addmm`` / ``aten.bmm`` in a
   16-bit dtype (float32 only when ``torch.get_float32_matmul_precision()`` allows TF32, or when
   forced), with the simple epilogues that only they feed: the bias of ``addmm`` (or an ``add`` of
   a length-N vector), ``gelu`` (exact) / ``relu`` / ``silu``, and a residual ``add`` of a tensor of
   the output's shape, looked for through one ``view``;
3. picks each distinct :class:`~sftctl.compiler.costmodel.GemmProblem`'s schedule: the model's
   top :data:`TOP_K` (:func:`~sftctl.compiler.search.gemm.top_k_gemm`) on the accelerator of the
   inputs' device (:meth:`sftctl.compiler.target.Target.for_device`); on a CUDA device they are timed once at first compile and
   the fastest wins (:func:`search_cached`, :func:`pick_measured`), with no device the model's
   pick stands. Both are cached on disk under the compiler's cache dir
   (``<cache>/backend/gemm/<key>.json``, ``<cache>/backend/gemm-measured/<key>.json``, the winner
   per (kernel, problem, device name)), kernels by Triton's own cache;
4. rewrites the FX graph so each site is one call of :func:`sftensor_gemm` (which launches
   ``sftctl.compiler.codegen.gemm.gemm`` with the chosen config) while every other op stays ATen.

Inputs not on CUDA: the graph runs eager (Dynamo's graph, unchanged) and the backend warns once
(``sftensor: no GPU, running eager``). ``force=True`` (or ``SFTCTL_SFTENSOR_FORCE=1``) rewrites
graphs of CPU tensors too, for tests under ``TRITON_INTERPRET=1``; the schedule is then searched
for ``accelerator`` (default: ``$SFTCTL_ACCELERATOR``, else
:data:`sftctl.compiler.target.DEVICE_DEFAULT`).

Registration: the ``torch_dynamo_backends`` entry point ``sftensor`` (pyproject.toml), and on
``import sftctl.compiler`` when torch is already imported (:func:`register`).

Environment: ``SFTCTL_SFTENSOR_FORCE`` (1: rewrite CPU graphs), ``SFTCTL_ACCELERATOR`` (catalog
name overriding device detection), ``SFTCTL_SFTENSOR_NO_CACHE`` (1: no disk cache of searches),
``SFTCTL_SFTENSOR_ANALYZE`` (0: skip the IR report).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import operator
import threading
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from sftctl import settings
from sftctl.compiler.cache import atomic_write, cache_dir, cache_key
from sftctl.compiler.fusion import fuse
from sftctl.compiler.search.gemm import top_k_gemm
from sftctl.compiler.step import cost_kernels
from sftctl.compiler.target import Target, load_target

log = logging.getLogger("sftctl.compiler.backend")
aten = torch.ops.aten

NO_GPU_MESSAGE = "sftensor: no GPU, running eager"
BACKEND_NAME = "sftensor"

GEMM_TARGETS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
_ACTIVATIONS = {aten.relu.default: "relu", aten.silu.default: "silu", aten.gelu.default: "gelu"}
#: vector FLOPs per output element of each fused epilogue part (for the cost model's problem)
_EPILOGUE_FLOPS = {"bias": 1.0, "relu": 1.0, "silu": 4.0, "gelu": 8.0, "residual": 1.0, "alpha": 1.0}
#: value-preserving nodes an epilogue is looked for behind
_TRANSPARENT = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default)
_TORCH_TO_IR = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ------------------------------------------------------------------------------------------------
# the launcher the rewritten graphs call
# ------------------------------------------------------------------------------------------------

_codegen_state: dict[str, Any] = {}
_lock = threading.Lock()
#: counters of what ran: ``triton`` (codegen kernel launches), ``fallback`` (torch math, because
#: codegen is missing or a launch failed), ``failed`` (launches that raised)
STATS: dict[str, int] = {"triton": 0, "fallback": 0, "failed": 0}


def _codegen_gemm() -> Callable | None:
    """``sftctl.compiler.codegen.gemm.gemm``, imported on first use; None while it is missing."""
    if "gemm" not in _codegen_state:
        try:
            from sftctl.compiler.codegen.gemm import gemm
        except ImportError as e:  # codegen not there yet (or triton missing)
            log.warning("sftensor: codegen GEMM unavailable (%s); using torch math", e)
            gemm = None
        _codegen_state["gemm"] = gemm
    return _codegen_state["gemm"]


def reference_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None, activation: str = "none", alpha: float = 1.0,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The ATen ops a fused GEMM site replaced, in eager's order and rounding.

    ``act(alpha * (a @ b) + bias) + residual``; ``a``: ``[M, K]`` or ``[B, M, K]``, ``b``:
    ``[K, N]`` / ``[B, K, N]``, ``bias``: ``[N]``, ``residual``: the output's shape; the result has
    ``a``'s dtype unless ``out_dtype``. Raises ValueError for an unknown activation.
    """
    out = torch.matmul(a, b)
    if alpha != 1.0:
        out = out * alpha
    if bias is not None:
        out = out + bias
    if activation == "gelu":
        out = torch.nn.functional.gelu(out)
    elif activation == "relu":
        out = torch.relu(out)
    elif activation == "silu":
        out = torch.nn.functional.silu(out)
    elif activation != "none":
        raise ValueError(f"unknown activation {activation!r}")
    if residual is not None:
        out = out + residual
    return out if out_dtype is None else out.to(out_dtype)


def sftensor_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, activation: str = "none", alpha: float = 1.0,
                  out_dtype: torch.dtype | None = None, config: dict | None = None) -> torch.Tensor:
    """One rewritten GEMM site: ``act(alpha * (a @ b) + bias) + residual``.

    Shapes: ``a`` ``[M, K]`` or ``[B, M, K]``, ``b`` ``[K, N]`` or ``[B, K, N]`` (any strides),
    ``bias`` ``[N]``, ``residual`` ``[M, N]`` / ``[B, M, N]``; dtypes bfloat16/float16/float32 (fp32
    runs as TF32 when ``torch.get_float32_matmul_precision()`` is not ``highest``, else IEEE). Returns a new tensor in ``out_dtype`` (default ``a.dtype``).

    Launches the generated Triton kernel with ``config`` (a :data:`~sftctl.compiler.search.gemm.SPACE`
    point). When codegen is missing, or a launch raises (logged once per config), it computes
    :func:`reference_gemm` instead, so a training run never dies on a kernel problem.
    """
    impl = _codegen_gemm()
    if impl is not None:
        key = tuple(sorted((config or {}).items()))
        if key not in _codegen_state.setdefault("bad", set()):
            try:
                out = impl(a, b, bias=bias, activation=activation, residual=residual, alpha=alpha,
                           out_dtype=out_dtype, config=dict(config or {}),
                           allow_tf32=torch.get_float32_matmul_precision() != "highest")
                STATS["triton"] += 1
                return out
            except Exception as e:  # noqa: BLE001 - fall back, but say so once
                STATS["failed"] += 1
                _codegen_state["bad"].add(key)
                log.warning("sftensor: Triton GEMM failed for config %s (%s: %s); using torch math",
                            dict(key), type(e).__name__, e)
    STATS["fallback"] += 1
    return reference_gemm(a, b, bias, residual, activation, alpha, out_dtype)


# ------------------------------------------------------------------------------------------------
# finding GEMM sites with their epilogues
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GemmSite:
    """One GEMM to rewrite and the ATen nodes it absorbs.

    ``start`` is the mm/addmm/bmm node, ``final`` the last absorbed node (whose users get the new
    value), ``chain`` every absorbed node in graph order. ``view_shape`` is set when the epilogue
    was found behind views (and clones): the launcher's ``[.., M, N]`` result is viewed to it.
    """

    start: fx.Node
    final: fx.Node
    chain: list[fx.Node]
    a: fx.Node
    b: fx.Node
    bias: fx.Node | None = None
    residual: fx.Node | None = None
    activation: str = "none"
    alpha: float = 1.0
    view_shape: tuple[int, ...] | None = None
    problem: Any = None  # costmodel.GemmProblem
    config: dict | None = None
    predicted_s: float = math.inf

    @property
    def epilogue(self) -> list[str]:
        parts = ["bias"] if self.bias is not None else []
        parts += [self.activation] if self.activation != "none" else []
        return parts + (["residual"] if self.residual is not None else [])


def _val(n) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _concrete(xs) -> tuple[int, ...] | None:
    """Ints of a shape/stride, using size hints for symbolic dims; None if there is none."""
    out = []
    for x in xs:
        if isinstance(x, int):
            out.append(x)
            continue
        hint = getattr(getattr(x, "node", None), "hint", None)
        if hint is None:
            return None
        out.append(int(hint))
    return tuple(out)


def _sole_user(n: fx.Node) -> fx.Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 and len(users[0].args) and users[0].op == "call_function" else None


def _other_operand(add: fx.Node, cur: fx.Node):
    if add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return None
    a0, a1 = add.args
    if a0 is cur and a1 is not cur:
        return a1
    if a1 is cur and a0 is not cur:
        return a0
    return None


def _same_tensor_type(x, ref) -> bool:
    vx, vr = _val(x), _val(ref)
    return (isinstance(vx, torch.Tensor) and isinstance(vr, torch.Tensor) and vx.dtype == vr.dtype
            and _concrete(vx.shape) == _concrete(vr.shape) and vx.device == vr.device)


def gemm_dtype_allowed(dtype: torch.dtype, force: bool = False) -> bool:
    """Whether a GEMM in ``dtype`` is rewritten: 16-bit always; float32 when torch's float32
    matmul precision allows TF32 (``high``/``medium``), or under ``force`` (CPU interpreter tests,
    where the kernels compute in exact float32)."""
    if dtype in (torch.bfloat16, torch.float16):
        return True
    if dtype == torch.float32:
        return force or torch.get_float32_matmul_precision() != "highest"
    return False


def find_gemm_sites(gm: fx.GraphModule, *, fuse_epilogues: bool = True, force: bool = False) -> list[GemmSite]:
    """The mm/addmm/bmm nodes of ``gm`` that :func:`rewrite_gemms` replaces, with epilogues.

    A node qualifies when its operands are 2-D (``mm``/``addmm``) or 3-D (``bmm``) tensors with
    concrete (or hinted) sizes, all of one dtype allowed by :func:`gemm_dtype_allowed`; ``addmm``
    also needs ``beta == 1`` and a bias of shape ``[N]``/``[1, N]`` (bias) or ``[M, N]`` (residual).
    Epilogue nodes are absorbed only when the GEMM's value has no other reader (e.g. a forward
    activation whose input is saved for backward is not fused).

    Each epilogue node is absorbed by one site only: in ``A(x) + B(x)`` (Llama's backward sums
    the input gradients of its gate/up and q/k/v projections so) the first GEMM in graph order
    takes the ``add`` as its residual and the second keeps a plain epilogue-free site, whose
    rewritten value the first one's launcher then reads.
    """
    sites = []
    claimed: set[fx.Node] = set()  # epilogue nodes an earlier site absorbed
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in GEMM_TARGETS:
            continue
        site = _match_site(node, fuse_epilogues, force, claimed)
        if site is not None:
            sites.append(site)
            claimed.update(site.chain[1:])
    return sites


def _match_site(node: fx.Node, fuse_epilogues: bool, force: bool,
                claimed: set[fx.Node] | frozenset[fx.Node] = frozenset()) -> GemmSite | None:
    out = _val(node)
    if not isinstance(out, torch.Tensor) or _concrete(out.shape) is None or out.numel() == 0:
        return None
    if node.target is aten.addmm.default:
        bias, a, b = node.args[:3]
        beta = node.kwargs.get("beta", node.args[3] if len(node.args) > 3 else 1)
        alpha = node.kwargs.get("alpha", node.args[4] if len(node.args) > 4 else 1)
        if beta != 1 or not isinstance(alpha, (int, float)) or not isinstance(bias, fx.Node):
            return None
    else:
        (a, b), bias, alpha = node.args[:2], None, 1.0
    va, vb = _val(a), _val(b)
    rank = 3 if node.target is aten.bmm.default else 2
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)) or va.dim() != rank or vb.dim() != rank:
        return None
    if not (va.dtype == vb.dtype == out.dtype) or not gemm_dtype_allowed(va.dtype, force):
        return None
    site = GemmSite(start=node, final=node, chain=[node], a=a, b=b, alpha=float(alpha))
    if bias is not None:
        vbias = _val(bias)
        n_out = out.shape[-1]
        if not isinstance(vbias, torch.Tensor) or vbias.dtype != out.dtype:
            return None
        shape = _concrete(vbias.shape)
        if shape in ((n_out,), (1, n_out)):
            site.bias = bias
        elif shape == _concrete(out.shape):
            site.residual = bias
        else:
            return None
    if fuse_epilogues:
        _absorb_epilogue(site, claimed)
    return site


def _walk_transparent(cur: fx.Node) -> tuple[list[fx.Node], fx.Node | None]:
    """Follow sole users through views and clones (value-preserving) from ``cur``: returns the
    nodes passed and the first other sole user (None when a node has several readers)."""
    passed: list[fx.Node] = []
    user = _sole_user(cur)
    while user is not None and user.target in _TRANSPARENT and len(passed) < 3:
        if user.target is aten.clone.default and user.kwargs.get("memory_format") not in (None, torch.contiguous_format):
            break
        passed.append(user)
        user = _sole_user(user)
    return passed, user


def _absorb_epilogue(site: GemmSite, claimed: set[fx.Node] | frozenset[fx.Node] = frozenset()) -> None:
    """Extend ``site.chain`` by the bias / activation / residual nodes that follow its GEMM,
    never taking a node in ``claimed`` (absorbed by another site already)."""
    cur = site.start
    out = _val(cur)
    n_out = out.shape[-1]

    def free(*nodes) -> bool:
        return not any(n in claimed for n in nodes)

    # bias: mm's value plus a length-N vector
    user = _sole_user(cur)
    if user is not None and site.bias is None and site.residual is None and free(user):
        other = _other_operand(user, cur)
        v = _val(other)
        if (isinstance(v, torch.Tensor) and v.dtype == out.dtype and _concrete(v.shape) == (n_out,)
                and _val(user).shape == out.shape):
            site.bias, cur = other, user
            site.chain.append(user)
    if site.residual is not None:  # addmm with an [M, N] "bias": nothing may follow the add
        site.final = cur
        return
    # activation, possibly behind views (elementwise ops commute with them)
    passed, user = _walk_transparent(cur)
    if user is not None and user.target in _ACTIVATIONS and free(user, *passed):
        approximate = user.kwargs.get("approximate", user.args[1] if len(user.args) > 1 else "none")
        if user.target is not aten.gelu.default or approximate == "none":
            site.activation, cur = _ACTIVATIONS[user.target], user
            site.chain += passed + [user]
    # residual add of a tensor of the same shape and dtype, possibly behind views
    passed, user = _walk_transparent(cur)
    if user is not None and free(user, *passed):
        before = passed[-1] if passed else cur
        other = _other_operand(user, before)
        if other is not None and _same_tensor_type(other, user) and _same_tensor_type(user, before):
            site.residual, cur = other, user
            site.chain += passed + [user]
    site.final = cur
    final_shape = _concrete(_val(cur).shape)
    if final_shape != _concrete(out.shape):
        site.view_shape = final_shape


# ------------------------------------------------------------------------------------------------
# schedule search with a disk cache
# ------------------------------------------------------------------------------------------------


def gemm_problem(site: GemmSite):
    """The :class:`~sftctl.compiler.costmodel.GemmProblem` of a site, from its operands' shapes,
    strides (an operand whose last dim is not contiguous but whose other dim is counts as
    transposed) and fused epilogue."""
    from sftctl.compiler.costmodel import GemmProblem, dtype_bytes

    va, vb = _val(site.a), _val(site.b)
    sa, sb = _concrete(va.shape), _concrete(vb.shape)
    ta, tb = _concrete(va.stride()) or (0,) * va.dim(), _concrete(vb.stride()) or (0,) * vb.dim()
    batch = sa[0] if len(sa) == 3 else 1
    m, k, n = sa[-2], sa[-1], sb[-1]
    a_t = ta[-1] != 1 and ta[-2] == 1 and m > 1
    b_t = tb[-1] != 1 and tb[-2] == 1 and n > 1
    dtype = _TORCH_TO_IR[va.dtype]
    flops = sum(_EPILOGUE_FLOPS[p] for p in site.epilogue) + (_EPILOGUE_FLOPS["alpha"] if site.alpha != 1 else 0.0)
    epi_bytes = float(dtype_bytes(dtype)) if site.residual is not None else 0.0
    return GemmProblem(batch=int(batch), m=int(m), n=int(n), k=int(k), dtype=dtype,
                       a_transposed=bool(a_t), b_transposed=bool(b_t),
                       epilogue_bytes_per_elem=epi_bytes, epilogue_flops_per_elem=flops)


#: how many of the model's best schedules the backend times on the device at first compile
TOP_K = 8


def search_cached(problem, target, space: dict | None = None, use_disk: bool = True, timer=None,
                  device_name: str | None = None, k: int = TOP_K) -> tuple[dict | None, float]:
    """``(config, predicted_s)`` for one GEMM class on ``target`` (a
    :class:`sftctl.compiler.target.Target`).

    The model keeps its ``k`` best schedules (:func:`~sftctl.compiler.search.gemm.top_k_gemm`,
    ties broken by row segments, memory traffic and footprint, never by order). With no
    ``timer`` the model's first pick stands. With ``timer`` (``config -> seconds`` on the
    device; :func:`device_gemm_timer` builds the real one; a raise or a non-finite time marks
    a config that failed) the candidates are timed once, at first compile, and the fastest wins
    (:func:`pick_measured`); the winner is cached per (kernel, problem, ``device_name``) as
    JSON under ``<compiler cache>/backend/gemm-measured/``. The model's picks are cached under
    ``backend/gemm/`` keyed by the problem, every hardware number, the coefficients, the space
    and the compiler's fingerprint (:mod:`sftctl.compiler.cache`). A config of None means
    nothing feasible (the site stays ATen); ``predicted_s`` is the model's time of the config
    returned."""
    hw, coeffs = target.hw, target.coeffs
    path = None
    if use_disk:
        path = cache_dir() / "backend" / "gemm" / f"{cache_key('gemm-topk', problem, hw, coeffs, space, k)}.json"
    cands = None
    if path is not None and path.exists():
        try:
            cands = [(d["config"], float(d["time_s"])) for d in json.loads(path.read_text())["candidates"]]
        except Exception:  # noqa: BLE001 - a bad entry is recomputed
            path.unlink(missing_ok=True)
    if cands is None:
        cands = [(c.config, c.time_s) for c in top_k_gemm(problem, hw, coeffs, k=k, space=space)]
        if path is not None:
            atomic_write(path, json.dumps({"problem": dataclasses.asdict(problem), "accelerator": hw.name,
                                           "candidates": [{"config": c, "time_s": t} for c, t in cands]}).encode())
    if not cands:
        return None, math.inf
    if timer is None or len(cands) == 1:
        return cands[0]
    return pick_measured("gemm", problem, device_name or hw.name, cands, timer, use_disk=use_disk)


def pick_measured(kernel: str, problem, device_name: str, cands: list[tuple[dict, float]], timer,
                  use_disk: bool = True) -> tuple[dict, float]:
    """The fastest of ``cands`` (``(config, model seconds)``, the model's order) as ``timer``
    measures them on ``device_name``, cached per (``kernel``, ``problem``, device, candidate
    set): a later compile reads the winner instead of timing again. A config whose timing
    raises or is not finite loses; when every one fails the model's first pick stands (and is
    not cached). Ties of measured time keep the model's order (its own tie-break)."""
    path = None
    if use_disk:
        key = cache_key(f"{kernel}-measured", problem, device_name, [c for c, _ in cands])
        path = cache_dir() / "backend" / f"{kernel}-measured" / f"{key}.json"
        if path.exists():
            try:
                i = int(json.loads(path.read_text())["winner"])
                return cands[i]
            except Exception:  # noqa: BLE001 - a bad entry is measured again
                path.unlink(missing_ok=True)
    measured = []
    for cfg, _ in cands:
        try:
            t = float(timer(dict(cfg)))
        except Exception as e:  # noqa: BLE001 - a config that cannot run loses
            log.warning("sftensor: timing %s config %s failed (%s: %s)", kernel, cfg, type(e).__name__, e)
            t = math.inf
        measured.append(t if math.isfinite(t) and t > 0 else math.inf)
    best = min(range(len(cands)), key=lambda i: (measured[i], i))
    if not math.isfinite(measured[best]):
        return cands[0]
    if path is not None:
        atomic_write(path, json.dumps({"kernel": kernel, "problem": dataclasses.asdict(problem),
                                        "device": device_name, "winner": best,
                                        "candidates": [{"config": c, "model_s": t, "measured_s": m}
                                                       for (c, t), m in zip(cands, measured)]},
                                       default=str).encode())
    return cands[best]


def device_gemm_timer(problem, device: torch.device) -> Callable[[dict], float]:
    """``config -> seconds`` of the generated Triton GEMM for ``problem`` on ``device`` (a CUDA
    device): random operands of the problem's shapes, dtype and storage order, timed with
    ``triton.testing.do_bench`` (median, ms -> s). Needs the codegen and a GPU.

    Raises:
        RuntimeError: the codegen GEMM is not available.
    """
    impl = _codegen_gemm()
    if impl is None:
        raise RuntimeError("the codegen GEMM is unavailable (triton missing?)")
    from triton.testing import do_bench

    dtype = getattr(torch, problem.dtype if problem.dtype in ("bfloat16", "float16", "float32") else "bfloat16")
    bs = (problem.batch,) if problem.batch > 1 else ()
    tf32 = torch.get_float32_matmul_precision() != "highest"
    operands: list = []  # built at the first timing: a cached winner allocates nothing

    def timer(config: dict) -> float:
        if not operands:
            a = torch.randn(*bs, problem.k, problem.m, device=device, dtype=dtype).transpose(-1, -2) \
                if problem.a_transposed else torch.randn(*bs, problem.m, problem.k, device=device, dtype=dtype)
            b = torch.randn(*bs, problem.n, problem.k, device=device, dtype=dtype).transpose(-1, -2) \
                if problem.b_transposed else torch.randn(*bs, problem.k, problem.n, device=device, dtype=dtype)
            operands.extend((a, b))
        a, b = operands
        return do_bench(lambda: impl(a, b, config=dict(config), allow_tf32=tf32), return_mode="median") * 1e-3

    return timer


# ------------------------------------------------------------------------------------------------
# the rewrite
# ------------------------------------------------------------------------------------------------


def rewrite_gemms(gm: fx.GraphModule, target, *, space: dict | None = None, force: bool = False,
                  fuse_epilogues: bool = True, use_disk_cache: bool = True, timer_for=None,
                  device_name: str | None = None) -> list[GemmSite]:
    """Replace every :func:`find_gemm_sites` site of ``gm`` by a :func:`sftensor_gemm` call
    with the searched config for ``target`` (a :class:`sftctl.compiler.target.Target`); in place (``gm`` is recompiled). Every other node stays.

    ``timer_for``: ``problem -> (config -> seconds)`` on the device (``device_name``): the
    model's top candidates are timed there at first compile (:func:`search_cached`); None keeps
    the model's pick.

    Returns the rewritten sites (with ``problem``, ``config``, ``predicted_s``). A site whose
    problem has no feasible schedule is left as ATen.
    """
    sites = find_gemm_sites(gm, fuse_epilogues=fuse_epilogues, force=force)
    chosen: dict[Any, tuple[dict | None, float]] = {}
    done = []
    replaced: dict[fx.Node, fx.Node] = {}  # an absorbed site's final node -> its new value
    for site in sites:
        site.problem = gemm_problem(site)
        if site.problem not in chosen:
            timer = timer_for(site.problem) if timer_for is not None else None
            chosen[site.problem] = search_cached(site.problem, target, space, use_disk_cache, timer=timer,
                                                 device_name=device_name)
        site.config, site.predicted_s = chosen[site.problem]
        if site.config is None:
            continue
        for field in ("a", "b", "bias", "residual"):  # operands that an earlier rewrite replaced
            setattr(site, field, replaced.get(getattr(site, field), getattr(site, field)))
        replaced[site.final] = _replace(gm.graph, site)
        done.append(site)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _replace(graph: fx.Graph, site: GemmSite) -> fx.Node:
    out_val = _val(site.start)
    final_val = _val(site.final)
    with graph.inserting_before(site.final):
        residual = site.residual
        if residual is not None and site.view_shape is not None:
            residual = graph.call_function(aten.reshape.default, (residual, list(out_val.shape)))
            residual.meta["val"] = out_val
        bias = site.bias
        if bias is not None and _val(bias).dim() == 2:
            bias = graph.call_function(aten.reshape.default, (bias, [-1]))
            bias.meta["val"] = _val(site.bias).reshape(-1)
        new = graph.call_function(sftensor_gemm, (site.a, site.b), {
            "bias": bias, "residual": residual, "activation": site.activation, "alpha": site.alpha,
            "out_dtype": None, "config": dict(site.config)})
        new.meta["val"] = out_val if site.view_shape is None else final_val
        new.meta["sftensor"] = {"problem": dataclasses.asdict(site.problem), "config": dict(site.config),
                                "replaced": [n.name for n in site.chain]}
        if site.view_shape is not None:
            gemm_out = new
            gemm_out.meta["val"] = out_val
            new = graph.call_function(aten.view.default, (gemm_out, list(site.view_shape)))
            new.meta["val"] = final_val
    site.final.replace_all_uses_with(new)
    for n in reversed(site.chain):
        graph.erase_node(n)
    return new


# ------------------------------------------------------------------------------------------------
# IR report (the torch frontend's lowering, tolerant of ops it cannot lower)
# ------------------------------------------------------------------------------------------------


def lower_fx_to_ir(gm: fx.GraphModule):
    """Lower an ATen FX graph to the IR as far as the torch frontend can.

    Placeholders become ``input`` nodes (role ``graph_input``); an op without a lowering (or whose
    lowering fails) becomes an ``input`` of role ``opaque`` with its value's shape and dtype, so its
    consumers still lower. Returns ``(graph, stats)`` with ``stats`` = ``{"fx_ops", "lowered",
    "opaque", "opaque_ops"}`` (``opaque_ops``: ATen op name -> count).
    """
    import torch.utils._pytree as pytree

    from sftctl.compiler.frontends.torch import _Lowering, ir_dtype

    class _Tolerant(_Lowering):
        def opaque(self, n: fx.Node):
            def one(v):
                if isinstance(v, torch.Tensor) and v.dtype in (torch.float64, torch.float32, torch.bfloat16,
                                                               torch.float16, torch.int64, torch.int32, torch.bool):
                    return self.add("input", [], _concrete(v.shape) or (), ir_dtype(v.dtype), role="opaque",
                                    name=n.name)
                return None
            v = n.meta.get("val")
            return [one(x) for x in v] if isinstance(v, (list, tuple)) else one(v)

    low = _Tolerant(gm)
    stats: dict[str, Any] = {"fx_ops": 0, "lowered": 0, "opaque": 0, "opaque_ops": {}}
    outputs: list[int] = []
    for n in gm.graph.nodes:
        low._node = n
        if n.op == "placeholder":
            v = n.meta.get("val")
            low.env[n] = (low.add("input", [], _concrete(v.shape) or (), ir_dtype(v.dtype), role="graph_input",
                                  name=n.name)
                          if isinstance(v, torch.Tensor) and v.dtype in _IR_OK else None)
        elif n.op == "call_function":
            if n.target is not operator.getitem:
                stats["fx_ops"] += 1
            try:
                low.env[n] = low._call(n)
                if n.target is not operator.getitem:
                    stats["lowered"] += 1
            except Exception:  # noqa: BLE001 - anything unlowerable stays opaque
                low.env[n] = low.opaque(n)
                name = str(getattr(n.target, "__name__", n.target))
                stats["opaque"] += 1
                stats["opaque_ops"][name] = stats["opaque_ops"].get(name, 0) + 1
        elif n.op == "output":
            for a in pytree.tree_leaves(n.args[0]):
                i = low.env.get(a) if isinstance(a, fx.Node) else None
                if isinstance(i, int):
                    outputs.append(i)
        else:
            low.env[n] = None
    g = low.g
    g.outputs = outputs
    g.output_roles = [f"out{i}" for i in range(len(outputs))]
    graph, _ = g.compact([])
    return graph, stats


_IR_OK = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)


def analyze_ir(gm: fx.GraphModule, target, matmul_precision: str | None = None) -> dict:
    """The IR view of an ATen graph: lowering stats, fused kernels by kind, and the model's
    predicted seconds on ``target`` of the part that lowered, priced by the compiler's one costing
    loop (:func:`~sftctl.compiler.step.cost_kernels`, as ``compile_graph`` prices a step).
    ``matmul_precision``: as ``compile_graph`` takes it; default torch's current
    ``torch.get_float32_matmul_precision()``. Never raises: ``{"error": ...}`` instead."""
    try:
        graph, stats = lower_fx_to_ir(gm)
        kernels = fuse(graph)
        costs = cost_kernels(graph, kernels, target,
                             matmul_precision=matmul_precision or torch.get_float32_matmul_precision())
        kinds: dict[str, int] = {}
        for k in kernels:
            kinds[k.kind] = kinds.get(k.kind, 0) + 1
        return {**stats, "ir_nodes": len(graph.nodes), "kernels": kinds, "predicted_s": costs.time_s}
    except Exception as e:  # noqa: BLE001 - a report, never a reason to fail compilation
        return {"error": f"{type(e).__name__}: {e}"}


# ------------------------------------------------------------------------------------------------
# the backend
# ------------------------------------------------------------------------------------------------

_warned_no_gpu = False


def _warn_no_gpu() -> None:
    global _warned_no_gpu
    if not _warned_no_gpu:
        _warned_no_gpu = True
        log.info(NO_GPU_MESSAGE)
        warnings.warn(NO_GPU_MESSAGE, RuntimeWarning, stacklevel=3)


def _device_of(example_inputs: Sequence[Any]) -> torch.device | None:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            if x.device.type == "cuda":
                return x.device
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return None


@dataclasses.dataclass
class GraphReport:
    """What the backend did to one ATen graph (``kind``: ``forward``/``backward``/``inference``)."""

    kind: str
    accelerator: str
    sites: list[dict]
    ir: dict
    fx_nodes: int


class SftensorBackend:
    """A configured ``sftensor`` backend: ``torch.compile(model, backend=SftensorBackend(...))``.

    Args:
        force: rewrite graphs whose inputs are not on CUDA (CPU tests under
            ``TRITON_INTERPRET=1``); default ``$SFTCTL_SFTENSOR_FORCE``.
        accelerator: catalog name to schedule for; default: the inputs' GPU (see
            :meth:`Target.for_device`, which has the one default for a forced CPU run).
        space: restricts the schedule space per key (as ``search_gemm``'s ``space``).
        fuse_epilogues: absorb bias / activation / residual nodes into the GEMM.
        use_disk_cache: cache searches on disk (default: unless ``$SFTCTL_SFTENSOR_NO_CACHE``).
        analyze: build the IR report of every graph (default: unless ``$SFTCTL_SFTENSOR_ANALYZE=0``).

    ``reports`` collects a :class:`GraphReport` per compiled ATen graph (the last 64).
    """

    def __init__(self, force: bool | None = None, accelerator: str | None = None, space: dict | None = None,
                 fuse_epilogues: bool = True, use_disk_cache: bool | None = None, analyze: bool | None = None):
        self.force = settings.get("SFTCTL_SFTENSOR_FORCE") if force is None else force
        self.accelerator = accelerator
        self.space = space
        self.fuse_epilogues = fuse_epilogues
        self.use_disk_cache = (not settings.get("SFTCTL_SFTENSOR_NO_CACHE")) if use_disk_cache is None else use_disk_cache
        self.analyze = settings.get("SFTCTL_SFTENSOR_ANALYZE") if analyze is None else analyze
        self.reports: list[GraphReport] = []
        self.__name__ = BACKEND_NAME

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        """Dynamo's entry: eager on CPU (unless forced), else AOTAutograd with :meth:`compile_aten`."""
        device = _device_of(example_inputs)
        if not self.force and (device is None or device.type != "cuda"):
            _warn_no_gpu()
            return gm.forward
        from torch._dynamo.backends.common import aot_autograd

        def fw(g, ex):
            return self.compile_aten(g, ex, kind="forward")

        def bw(g, ex):
            return self.compile_aten(g, ex, kind="backward")

        def inference(g, ex):
            return self.compile_aten(g, ex, kind="inference")

        return aot_autograd(fw_compiler=fw, bw_compiler=bw, inference_compiler=inference)(gm, example_inputs, **kwargs)

    def target(self, example_inputs: Sequence[Any]):
        """The :class:`sftctl.compiler.target.Target` this graph is scheduled for: ``accelerator``,
        else the inputs' device (:meth:`Target.for_device`)."""
        return load_target(self.accelerator) if self.accelerator else Target.for_device(_device_of(example_inputs))

    def compile_aten(self, gm: fx.GraphModule, example_inputs: Sequence[Any], kind: str = "forward") -> Callable:
        """Rewrite one ATen graph's GEMMs (see the module docstring); returns a boxed callable."""
        from functorch.compile import make_boxed_func

        target = self.target(example_inputs)
        hw = target.hw
        ir = analyze_ir(gm, target) if self.analyze else {}
        device = _device_of(example_inputs)
        timer_for, device_name = None, None
        if device is not None and device.type == "cuda" and _codegen_gemm() is not None:
            timer_for = functools.partial(device_gemm_timer, device=device)
            device_name = torch.cuda.get_device_name(device)
        sites = rewrite_gemms(gm, target, space=self.space, force=self.force, fuse_epilogues=self.fuse_epilogues,
                              use_disk_cache=self.use_disk_cache, timer_for=timer_for, device_name=device_name)
        report = GraphReport(kind=kind, accelerator=hw.name, fx_nodes=len(gm.graph.nodes), ir=ir, sites=[
            {"replaced": [n.name for n in s.chain], "epilogue": s.epilogue, "problem": dataclasses.asdict(s.problem),
             "config": s.config, "predicted_s": s.predicted_s} for s in sites])
        with _lock:
            self.reports.append(report)
            del self.reports[:-64]
        log.info("sftensor: %s graph for %s: %d GEMM sites rewritten, IR %s", kind, hw.name, len(sites), ir)
        return make_boxed_func(gm.forward)


#: The default backend instance behind the name ``sftensor``.
DEFAULT_BACKEND = SftensorBackend()


def sftensor(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
    """The ``sftensor`` torch.compile backend (Dynamo's ``(gm, example_inputs) -> callable``).

    See the module docstring; configured by environment variables (:class:`SftensorBackend`).
    """
    return DEFAULT_BACKEND(gm, example_inputs, **kwargs)


def register() -> bool:
    """Register ``sftensor`` with Dynamo's backend registry unless it is known already (as a
    registered function, or as a discovered entry point, which Dynamo loads itself). Returns
    True when this call registered it. Imports ``torch._dynamo`` (about a second)."""
    from torch._dynamo.backends import registry

    if BACKEND_NAME in registry._COMPILER_FNS or registry._BACKENDS.get(BACKEND_NAME) is not None:
        return False
    registry.register_backend(sftensor, name=BACKEND_NAME)
    return True
