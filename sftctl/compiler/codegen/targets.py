"""Compile the codegen kernels for real GPU targets without a GPU, and read their resources.

Triton compiles ahead of time for any target it has a backend for:
``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(...))`` runs the
whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin via the ``ptxas`` Triton ships, or ->
AMDGCN -> hsaco) on the CPU. :data:`TARGETS` names the five we check: ``sm_90`` (H100/H200),
``sm_80`` (A100), ``sm_89`` (L4), ``sm_75`` (T4) on the ``cuda`` backend (warp 32) and
``gfx942`` (MI300X) on ``hip`` (wavefront 64).

Resources per kernel (:class:`KernelResources`):

* CUDA: registers per thread, spill bytes (spill stores) and static shared memory from
  ``ptxas -v`` (Triton runs it with ``-v``; we capture its log through
  ``knobs.nvidia.dump_ptxas_log``), falling back to ``cuobjdump --dump-resource-usage`` on the
  cubin (``REG``, ``LOCAL``, ``SHARED``; the binary lives in ``triton/backends/nvidia/bin``);
  shared memory is Triton's dynamic allocation ``metadata.shared`` (plus any static smem).
* HIP: the AMDGPU code object metadata in the ``amdgcn`` text: ``.vgpr_count`` (arch VGPRs +
  AGPRs, the unified file of CDNA3), ``.vgpr_spill_count`` (x 4 bytes), ``.group_segment_fixed_size``
  (LDS bytes); ``metadata.shared`` when larger.

Results are cached on disk under ``<compiler cache>/codegen/resources`` keyed by the kernel
source's SHA-256, function, signature, constexprs, attributes, target, warps, stages and the
Triton version.

:func:`occupancy` and :func:`fits` turn resources into resident blocks per SM with the
:class:`~sftctl.compiler.hardware.Accelerator`'s per-SM limits (registers per SM, registers per
thread, shared memory per SM and per block, warps and blocks per SM) and the allocation
granularities in :data:`ALLOCATION` (sources there). :func:`gemm_measurer` plugs measured
resources into ``search.gemm.search_gemm(measure=...)``: a config whose compiled kernel does not
fit is infeasible before it is scored, and the measured registers and shared memory replace the
model's estimates in its occupancy term.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from sftctl.compiler.cache import cache_key
from sftctl.compiler.codegen import _runtime as rt

__all__ = ["ALLOCATION", "KernelResources", "TARGETS", "compile_resources", "elementwise_resources",
           "fits", "gemm_measurer", "gemm_resources", "layer_norm_resources", "occupancy",
           "target_for", "gpu_target"]

#: Target name -> (Triton backend, arch, warp size).
TARGETS: dict[str, tuple[str, int | str, int]] = {
    "sm_90": ("cuda", 90, 32),     # H100, H200 (compute capability 9.0)
    "sm_80": ("cuda", 80, 32),     # A100
    "sm_89": ("cuda", 89, 32),     # L4
    "sm_75": ("cuda", 75, 32),     # T4
    "gfx942": ("hip", "gfx942", 64),  # MI300X (CDNA3)
}

#: Allocation granularities per target family, with their sources:
#:  * ``reg_unit``: registers are allocated per thread in multiples of this. NVIDIA: 256
#:    registers per warp = 8 per thread ("CUDA Occupancy Calculator", register allocation unit
#:    size 256, granularity warp, for compute capability 7.x-9.0). CDNA3: VGPRs in blocks of 8
#:    (AMD "CDNA3 Instruction Set Architecture" reference guide, VGPR allocation; LLVM
#:    AMDGPUUsage, gfx90a/gfx942 VGPR allocation granule 8).
#:  * ``smem_unit``: shared memory allocation unit per block: 128 B on cc 8.x/9.0, 256 B on cc
#:    7.5 (CUDA Occupancy Calculator, "shared memory allocation unit size"); LDS on GFX7-GFX11
#:    in 128-dword (512 B) blocks (LLVM AMDGPUUsage, ``COMPUTE_PGM_RSRC2.LDS_SIZE``).
#:  * ``smem_reserved``: shared memory the runtime reserves per block: 1 KiB on cc 8.x/9.0
#:    (CUDA C++ Programming Guide, "Compute Capability 8.x / 9.0 -- Shared Memory": "1 KB of
#:    shared memory is reserved for system use"), none on cc 7.5 and on AMD.
ALLOCATION = {
    "cuda_ge80": {"reg_unit": 8, "smem_unit": 128, "smem_reserved": 1024},
    "cuda_75": {"reg_unit": 8, "smem_unit": 256, "smem_reserved": 0},
    "hip": {"reg_unit": 8, "smem_unit": 512, "smem_reserved": 0},
}


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """What one compiled kernel needs per block on one target.

    Attributes:
        target: a :data:`TARGETS` name.
        registers: 32-bit registers per thread (NVIDIA) / VGPRs per lane incl. AGPRs (AMD).
        spill_bytes: bytes of register spill stores per thread (NVIDIA, ``ptxas -v``) or
            ``4 * vgpr_spill_count`` (AMD).
        shared_bytes: shared memory / LDS per block, bytes (without the runtime's reservation).
        num_warps: warps (wavefronts) per block.
        compile_s: wall seconds the compile took (of the original compile when ``cached``).
        kernel: kernel function name.
        warp_size: threads per warp (32) or wavefront (64).
        cached: read from the disk cache.
    """

    target: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    num_warps: int
    compile_s: float
    kernel: str = ""
    warp_size: int = 32
    cached: bool = False

    @property
    def threads(self) -> int:
        return self.num_warps * self.warp_size


def gpu_target(target: str):
    """``triton.backends.compiler.GPUTarget`` of a :data:`TARGETS` name.

    Raises:
        ValueError: unknown target name.
    """
    from triton.backends.compiler import GPUTarget

    try:
        backend, arch, warp = TARGETS[target]
    except KeyError:
        raise ValueError(f"unknown target {target!r}; known: {sorted(TARGETS)}") from None
    return GPUTarget(backend, arch, warp)


def target_for(hw) -> str:
    """The Triton target name of an :class:`~sftctl.compiler.hardware.Accelerator`
    (``triton_arch`` 90 -> ``sm_90``, ``gfx942`` -> ``gfx942``).

    Raises:
        ValueError: the accelerator has no Triton target (``cpu``).
    """
    if hw.triton_backend == "cuda" and isinstance(hw.triton_arch, int):
        return f"sm_{hw.triton_arch}"
    if hw.triton_backend == "hip" and hw.triton_arch:
        return str(hw.triton_arch)
    raise ValueError(f"{hw.name} has no Triton GPU target")


def _family(target: str) -> str:
    backend, arch, _ = TARGETS.get(target, (None, None, None))
    if backend is None:
        backend = "hip" if target.startswith("gfx") else "cuda"
        arch = int(target.split("_")[1]) if backend == "cuda" else target
    if backend == "hip":
        return "hip"
    return "cuda_ge80" if int(arch) >= 80 else "cuda_75"


# --------------------------------------------------------------------------------------------
# Compilation and resource extraction


def _cache_path(key: str) -> Path:
    from sftctl import settings

    env = settings.get("SFTCTL_CODEGEN_CACHE")
    if env:
        base = Path(env).expanduser()
    else:
        from sftctl.compiler.cache import cache_dir

        base = cache_dir() / "codegen"
    return base / "resources" / f"{key}.json"


def _nvidia_bin(tool: str) -> str | None:
    import triton

    p = Path(triton.__file__).resolve().parent / "backends" / "nvidia" / "bin" / tool
    return str(p) if p.exists() else None


def _parse_ptxas_log(log: str) -> dict:
    out = {}
    m = re.search(r"Used (\d+) registers", log)
    if m:
        out["registers"] = int(m.group(1))
    m = re.search(r"(\d+) bytes spill stores", log)
    if m:
        out["spill_bytes"] = int(m.group(1))
    m = re.search(r"(\d+) bytes smem", log)
    if m:
        out["smem"] = int(m.group(1))
    return out


def _cuobjdump(cubin: bytes) -> dict:
    tool = _nvidia_bin("cuobjdump")
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        name = f.name
    try:
        text = subprocess.run([tool, "--dump-resource-usage", name], capture_output=True, text=True,
                              timeout=60).stdout
    finally:
        os.unlink(name)
    out = {}
    # LOCAL: local memory per thread, which for Triton kernels (no local arrays) is spill space
    for key, field in (("REG", "registers"), ("LOCAL", "spill_bytes"), ("SHARED", "smem")):
        m = re.search(rf"\b{key}:(\d+)", text)
        if m:
            out[field] = int(m.group(1))
    return out


def _amdgcn_resources(text: str) -> dict:
    def num(key):
        m = re.search(rf"^\s*\.{key}:\s*(\d+)", text, re.M)
        return int(m.group(1)) if m else None

    vgpr, agpr = num("vgpr_count"), num("agpr_count")
    out = {"registers": vgpr if vgpr is not None else 0}
    if agpr and vgpr is not None and vgpr < agpr:  # older metadata: arch VGPRs only
        out["registers"] = vgpr + agpr
    out["spill_bytes"] = 4 * (num("vgpr_spill_count") or 0)
    out["smem"] = num("group_segment_fixed_size") or 0
    return out


def compile_resources(fn, signature: dict, constexprs: dict, target: str, *, num_warps: int = 4,
                      num_stages: int = 3, attrs: dict | None = None, source_file: str | None = None,
                      use_cache: bool = True) -> KernelResources:
    """Compile ``fn`` (a compiled-mode ``JITFunction``) for ``target`` and read its resources.

    Args:
        fn: the kernel (``_runtime.builtin_kernels(stem, interpret=False).<name>`` or a
            generated kernel's ``.kernel(False)``).
        signature: argument name -> Triton type (``"*bf16"``, ``"i32"``, ``"fp32"``,
            ``"constexpr"``) for every argument.
        constexprs: name -> value for the ``constexpr`` arguments.
        attrs: ``{(arg index,): [["tt.divisibility", 16]]}`` specialisations.
        source_file: the kernel's source file (cache key); default ``fn``'s file.

    Raises:
        ValueError: unknown target. Triton's ``CompilationError`` / ``PTXASError`` propagate
        (a schedule the backend rejects).
    """
    import triton

    tgt = gpu_target(target)
    src_path = source_file or fn.fn.__code__.co_filename
    src_hash = hashlib.sha256(Path(src_path).read_bytes()).hexdigest()
    # the compiled kernel's resources depend on its source and Triton, not on the rest of the
    # compiler: keyed without the compiler's fingerprint
    key = cache_key("kernel-resources", {
        "src": src_hash, "fn": fn.__name__, "sig": signature, "ce": {k: repr(v) for k, v in constexprs.items()},
        "attrs": repr(sorted((attrs or {}).items())), "target": target, "warps": num_warps,
        "stages": num_stages, "triton": triton.__version__}, fingerprint=False)
    path = _cache_path(key)
    if use_cache and path.exists():
        try:
            d = json.loads(path.read_text())
            return KernelResources(**d, cached=True)
        except (OSError, ValueError, TypeError):
            path.unlink(missing_ok=True)

    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    t0 = time.perf_counter()
    log = io.StringIO()
    with contextlib.ExitStack() as stack:
        if tgt.backend == "cuda":
            # Triton's own cache would skip ptxas (and its log): compile for real, once; our
            # resource cache above answers repeats.
            stack.enter_context(triton.knobs.compilation.scope())
            triton.knobs.compilation.always_compile = True
            stack.enter_context(triton.knobs.nvidia.scope())
            triton.knobs.nvidia.dump_ptxas_log = True
            stack.enter_context(contextlib.redirect_stdout(log))
        k = triton.compile(src, target=tgt, options={"num_warps": num_warps, "num_stages": num_stages})
    compile_s = time.perf_counter() - t0
    shared_meta = int(getattr(k.metadata, "shared", 0) or 0)
    if tgt.backend == "cuda":
        info = _parse_ptxas_log(log.getvalue())
        if "registers" not in info:
            info = {**_cuobjdump(k.asm["cubin"]), **info}
    else:
        info = _amdgcn_resources(k.asm["amdgcn"])
    res = KernelResources(
        target=target, registers=int(info.get("registers", 0)), spill_bytes=int(info.get("spill_bytes", 0)),
        shared_bytes=max(shared_meta, int(info.get("smem", 0))), num_warps=num_warps,
        compile_s=compile_s, kernel=fn.__name__, warp_size=tgt.warp_size)
    if use_cache:
        d = dataclasses.asdict(res)
        d.pop("cached")
        rt.write_source(path, json.dumps(d))
    return res


def _int_sig(names, ty="i32"):
    return {n: ty for n in names}


def gemm_resources(config: dict, target: str, dtype: str = "bfloat16", *, out_dtype: str | None = None,
                   activation: str = "none", has_bias: bool = False, has_residual: bool = False,
                   a_transposed: bool = False, b_transposed: bool = False,
                   use_cache: bool = True) -> KernelResources:
    """Resources of the main :func:`~sftctl.compiler.codegen.gemm.gemm` kernel for ``config``.

    Operands are specialised as a typical launch does: 16-byte aligned pointers, the
    contiguous dimension's stride 1 (A row-major unless ``a_transposed``; B row-major ``K x N``
    unless ``b_transposed``), other strides multiples of 16. Split-K configs compile the
    partial-tile variant (fp32 workspace output). Raises as :func:`compile_resources`.
    """
    from sftctl.compiler.codegen.gemm import gemm_constexprs, normalize_config

    cfg = normalize_config(config)
    dt = rt.triton_type(dtype)
    odt = rt.triton_type(out_dtype or dtype) if cfg["split_k"] == 1 else "fp32"
    fn = rt.builtin_kernels("gemm", interpret=False).gemm_kernel
    ce = gemm_constexprs(cfg, dot_dtype=dtype, activation=activation, has_bias=has_bias,
                         has_residual=has_residual, has_alpha=False)
    if cfg["split_k"] > 1:
        ce.update(HAS_BIAS=False, HAS_RESIDUAL=False, ACTIVATION=0)
    sig = {"a_ptr": f"*{dt}", "b_ptr": f"*{dt}", "c_ptr": f"*{odt}", "bias_ptr": f"*{dt}",
           "res_ptr": f"*{odt}"}
    ints = ["M", "N", "K", "stride_ab", "stride_am", "stride_ak", "stride_bb", "stride_bk", "stride_bn",
            "stride_cs", "stride_cb", "stride_cm", "stride_cn", "stride_rb", "stride_rm", "stride_rn",
            "stride_bias"]
    sig.update(_int_sig(ints))
    sig["alpha"] = "fp32"
    unit = {"stride_ak" if not a_transposed else "stride_am": 1,
            "stride_bn" if not b_transposed else "stride_bk": 1, "stride_cn": 1, "stride_rn": 1,
            "stride_bias": 1}
    for name in unit:
        sig[name] = "constexpr"
    for name in ce:
        sig[name] = "constexpr"
    names = list(fn.arg_names)
    div16 = [n for n in names if sig[n].startswith("*") or (n.startswith("stride") and sig[n] == "i32")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return compile_resources(fn, sig, {**ce, **unit}, target, num_warps=cfg["num_warps"],
                             num_stages=cfg["num_stages"], attrs=attrs, use_cache=use_cache)


def elementwise_resources(chain, target: str, *, rank: int = 1, dtype: str = "bfloat16",
                          out_dtype: str | None = None, config: dict | None = None,
                          use_cache: bool = True) -> KernelResources:
    """Resources of a generated elementwise kernel (all inputs ``dtype``, contiguous, same
    shape, collapsed to ``rank`` dims). Raises as :func:`compile_resources`."""
    from sftctl.compiler.codegen.elementwise import DEFAULT_CONFIG, generated_kernel

    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    gk = generated_kernel(chain, rank, frozenset(), ["float"] * len(chain.inputs))
    fn = gk.kernel(False)
    dt, odt = rt.triton_type(dtype), rt.triton_type(out_dtype or dtype)
    sig = {}
    for n in gk.arg_names:
        if n.startswith("in"):
            sig[n] = f"*{dt}"
        elif n.startswith("out"):
            sig[n] = f"*{odt}"
        elif n == "BLOCK":
            sig[n] = "constexpr"
        else:
            sig[n] = "i32"
    ce = {"BLOCK": cfg["BLOCK"]}
    # contiguous operands: the innermost stride of every operand is 1
    for n in gk.arg_names:
        if n.startswith("s") and n.endswith(f"_{rank - 1}"):
            sig[n] = "constexpr"
            ce[n] = 1
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(gk.arg_names) if sig[n].startswith("*")}
    return compile_resources(fn, sig, ce, target, num_warps=cfg["num_warps"], num_stages=1, attrs=attrs,
                             source_file=gk.path, use_cache=use_cache)


def layer_norm_resources(target: str, n: int = 4096, dtype: str = "bfloat16", *, config: dict | None = None,
                         use_cache: bool = True) -> KernelResources:
    """Resources of the layer-norm forward kernel for rows of ``n`` elements (weight and bias).
    Raises as :func:`compile_resources`."""
    from sftctl.compiler.codegen.reduction import row_config

    cfg = row_config(n, config)
    fn = rt.builtin_kernels("reduction", interpret=False).norm_fwd_kernel
    dt = rt.triton_type(dtype)
    sig = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "b_ptr": f"*{dt}", "y_ptr": f"*{dt}",
           "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "n_cols": "i32", "stride_xr": "i32",
           "stride_yr": "i32", "eps": "fp32", "IS_RMS": "constexpr", "HAS_W": "constexpr",
           "HAS_B": "constexpr", "BLOCK_N": "constexpr"}
    ce = {"IS_RMS": False, "HAS_W": True, "HAS_B": True, "BLOCK_N": cfg["BLOCK_N"]}
    names = list(fn.arg_names)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items() if v.startswith("*")}
    return compile_resources(fn, sig, ce, target, num_warps=cfg["num_warps"], num_stages=1, attrs=attrs,
                             use_cache=use_cache)


# --------------------------------------------------------------------------------------------
# Occupancy


def _limits(hw, target: str | None):
    fam = _family(target or target_for(hw))
    return ALLOCATION[fam]


def occupancy(resources: KernelResources, hw) -> int:
    """Resident blocks per SM/CU of a kernel with ``resources`` on ``hw`` (0: does not fit).

    ``min(max_blocks_per_sm, max_warps_per_sm // warps, blocks by registers, blocks by shared
    memory)`` as the CUDA Occupancy Calculator computes it: registers per warp
    ``ceil(regs / reg_unit) * reg_unit * warp_size``, blocks by registers
    ``(regs_per_sm // regs_per_warp) // warps``; shared memory per block rounded up to
    ``smem_unit`` after adding ``smem_reserved`` (:data:`ALLOCATION`). On CDNA3 the same formula
    with 131072 VGPR lanes per CU (4 SIMDs x 512 VGPRs x 64 lanes) gives waves per CU
    ``4 * floor(512 / vgprs)``.
    """
    lim = _limits(hw, resources.target)
    if resources.registers > hw.regs_per_thread_max:
        return 0
    if resources.num_warps * resources.warp_size > 1024 or resources.num_warps > hw.max_warps_per_sm:
        return 0
    unit = lim["reg_unit"]
    regs = max(1, -(-resources.registers // unit) * unit)
    regs_per_warp = regs * resources.warp_size
    by_regs = (hw.regs_per_sm // regs_per_warp) // resources.num_warps
    smem = resources.shared_bytes + lim["smem_reserved"]
    smem = -(-smem // lim["smem_unit"]) * lim["smem_unit"] if smem else 0
    if smem > hw.smem_bytes_per_block:
        return 0
    by_smem = hw.smem_bytes_per_sm // smem if smem else hw.max_blocks_per_sm
    by_warps = hw.max_warps_per_sm // resources.num_warps
    return int(max(0, min(hw.max_blocks_per_sm, by_warps, by_regs, by_smem)))


def fits(resources: KernelResources, hw) -> bool:
    """Whether one block of the kernel can be resident on an SM/CU of ``hw``: registers per
    thread <= ``hw.regs_per_thread_max`` (255 on NVIDIA, CUDA C++ Programming Guide "Technical
    Specifications per Compute Capability"; 512 on CDNA3), threads <= 1024, shared memory plus
    the runtime's reservation <= ``hw.smem_bytes_per_block`` and at least one resident block."""
    return occupancy(resources, hw) >= 1


def gemm_measurer(problem, hw, *, use_cache: bool = True):
    """A ``measure(config) -> KernelResources | None`` for ``search_gemm(..., measure=...)``:
    compiles the GEMM kernel of ``problem`` (dtype, transposes) for ``hw``'s target; a config
    the backend refuses to compile gives None (infeasible)."""
    target = target_for(hw)
    dtype = problem.dtype if problem.dtype in ("float32", "float16", "bfloat16") else "bfloat16"
    out_dtype = None if problem.out_dtype == "same" else problem.out_dtype

    def measure(config: dict):
        try:
            return gemm_resources(config, target, dtype, out_dtype=out_dtype,
                                  a_transposed=problem.a_transposed, b_transposed=problem.b_transposed,
                                  use_cache=use_cache)
        except Exception:  # noqa: BLE001 the backend rejects the schedule (e.g. out of resources at compile)
            return None

    return measure
