"""Accelerator hardware facts: the one place that owns them.

Every number carries its source in ``Accelerator.sources`` (datasheet, whitepaper, or our own
measurement file). Peak FLOP/s are *dense* (no 2:4 sparsity).

The table is ``accelerators.yaml`` next to this module: :func:`load_accelerators` reads it (once),
:func:`get_accelerator` looks one up by name in any case. The ``cpu`` entry is this machine: its
core count comes from ``os.cpu_count()`` at load time.

An entry is the accelerator's one record: besides its facts it names the measured tables that
price it (:data:`TABLE_FIELDS`: its die, GEMM table and model, library tiles, collective links,
calibration, peers and accuracy files), so adding an accelerator is an entry here, its offerings
and its rows in the data files those fields name; no code names an accelerator.

Both sides read the facts here: the catalog (:func:`sftctl.catalog.accelerator_names`) and the
compiler (``sftctl.compiler.hardware`` re-exports :class:`Accelerator` and the lookups for the
cost model). Nothing else opens the YAML file, and this module imports neither the compiler nor
anything heavy (PyYAML only when the table is first read).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator model (frozen; its dict fields make it unhashable: key it by its fields).

    Attributes:
        name: catalog name, e.g. ``H100``, ``A100-80GB``, ``MI300X``, ``cpu``.
        vendor: ``nvidia``, ``amd`` or ``cpu``.
        sm_count: streaming multiprocessors (NVIDIA) or compute units (AMD); cores for ``cpu``.
        clock_hz: boost clock the peak figures assume, Hz.
        matrix_flops_per_s: dense peak FLOP/s of the matrix units per input dtype
            (keys ``float32`` (TF32 where the hardware has no FP32 matrix path), ``bfloat16``,
            ``float16``; ``float8`` where supported).
        vector_flops_per_s: peak FLOP/s of the non-matrix (CUDA core / SIMD) units per dtype
            (keys ``float32``, ``bfloat16``/``float16`` where different).
        hbm_bytes_per_s: peak DRAM bandwidth, bytes/s.
        l2_bytes: last-level on-chip cache, bytes.
        smem_bytes_per_sm: shared memory (LDS) per SM/CU usable by resident blocks, bytes.
        smem_bytes_per_block: most shared memory one block may allocate, bytes.
        regs_per_sm: 32-bit registers per SM/CU.
        regs_per_thread_max: most registers one thread may use.
        max_warps_per_sm: most resident warps (wavefronts) per SM/CU.
        max_blocks_per_sm: most resident blocks per SM/CU.
        warp_size: threads per warp (32) or wavefront (64 on CDNA).
        memory_bytes: device memory capacity, bytes.
        memory_latency_s: DRAM load latency, seconds (for pipeline-depth modelling).
        launch_overhead_s: host-side cost of one kernel launch, seconds.
        triton_backend: ``cuda`` or ``hip`` (None for ``cpu``).
        triton_arch: compute capability as int (90) or gfx name (``gfx942``); None for ``cpu``.
        sources: field name -> where the number comes from.

    The measured tables that price it (the compiler reads these; None where there is none):

    Attributes:
        die: the chip as XLA's measured tables key it (``sm_90`` for H100 and H200, ``gfx950``):
            accelerators of one die share its measured GEMM and collective records (the
            collectives' measured links are those of its accelerators).
        gemm_table: the key in ``compiler/calibrations/data/xla/matmul.json`` of its die's
            measured library GEMMs (cuBLAS, hipBLASLt): they price its GEMMs.
        gemm_model: the table whose fitted coefficients the analytical GEMM model uses where no
            measured table of its own covers a GEMM (another die, a dtype the table lacks, a
            what-if copy): its vendor's reference table (``sm_90``, ``gfx950``).
        gemm_tiles: the library's (BM, BN) tile shapes the GEMM model searches (a named set of the
            YAML's ``gemm_tile_sets``, resolved on load).
        collective_link: the in-host link of ``compiler/calibrations/collectives.json`` its
            collectives run over (NVLink/NVSwitch, xGMI); ``pcie_link`` the one of its PCIe-only
            hosts (an offering whose in-host bandwidth says PCIe).
        calibration: the file in ``compiler/calibrations/`` with its fitted cost-model
            coefficients (its own or its die's); ``peers`` the one whose measured library kernels
            (cuBLAS, torch eager) price the eager and ``default`` modes, as fractions of its peaks.
        accuracy: the file in ``compiler/calibrations/accuracy/`` saying how far to trust a step.
    """

    name: str
    vendor: str
    sm_count: int
    clock_hz: float
    matrix_flops_per_s: dict[str, float]
    vector_flops_per_s: dict[str, float]
    hbm_bytes_per_s: float
    l2_bytes: int
    smem_bytes_per_sm: int
    smem_bytes_per_block: int
    regs_per_sm: int
    regs_per_thread_max: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    warp_size: int
    memory_bytes: int
    memory_latency_s: float
    launch_overhead_s: float
    triton_backend: str | None
    triton_arch: int | str | None
    sources: dict[str, str] = dataclasses.field(default_factory=dict, hash=False, compare=False)
    die: str | None = None
    gemm_table: str | None = None
    gemm_model: str | None = None
    gemm_tiles: tuple[tuple[int, int], ...] = ()
    collective_link: str | None = None
    pcie_link: str | None = None
    calibration: str | None = None
    peers: str | None = None
    accuracy: str | None = None

    def matrix_peak(self, dtype: str) -> float:
        """Dense matrix-unit FLOP/s for ``dtype`` (float16 falls back to bfloat16 and back)."""
        table = self.matrix_flops_per_s
        for key in (dtype, {"float16": "bfloat16", "bfloat16": "float16"}.get(dtype, dtype), "float32"):
            if key in table:
                return table[key]
        raise KeyError(f"{self.name}: no matrix peak for {dtype}")

    def vector_peak(self, dtype: str) -> float:
        """Non-matrix FLOP/s for ``dtype`` (falls back to float32)."""
        return self.vector_flops_per_s.get(dtype, self.vector_flops_per_s["float32"])


# ------------------------------------------------------------------------------------------------
# The accelerator table: accelerators.yaml next to this module

ACCELERATORS_YAML = Path(__file__).resolve().with_name("accelerators.yaml")

_FIELDS = tuple(f.name for f in dataclasses.fields(Accelerator))
#: the fields naming an accelerator's measured tables (strings or null in the YAML; gemm_tiles a
#: set of ``gemm_tile_sets``): every entry writes each of them, and sources each one it sets
TABLE_FIELDS = ("die", "gemm_table", "gemm_model", "gemm_tiles", "collective_link", "pcie_link", "calibration",
                "peers", "accuracy")
_INT_FIELDS = (
    "sm_count", "l2_bytes", "smem_bytes_per_sm", "smem_bytes_per_block", "regs_per_sm",
    "regs_per_thread_max", "max_warps_per_sm", "max_blocks_per_sm", "warp_size", "memory_bytes",
)
_FLOAT_FIELDS = ("clock_hz", "hbm_bytes_per_s", "memory_latency_s", "launch_overhead_s")
_RATE_FIELDS = ("matrix_flops_per_s", "vector_flops_per_s")
# Entry keys that are not Accelerator fields: per-SM FLOP/clock rates the peaks are built from,
# and how the accelerator is recognized (sftctl.catalog.identity).
_EXTRA_KEYS = ("derivation", "identity")


def _number(value, where: str, kind=float):
    """``value`` as ``kind``; YAML 1.1 reads ``1.83e9`` (unsigned exponent) as a string, so parse strings."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{where}: expected a number, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value.replace("_", ""))
        except ValueError:
            raise ValueError(f"{where}: expected a number, got {value!r}") from None
    if kind is int:
        if float(value) != int(value):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    return float(value)


def _rates(table, where: str) -> dict[str, float]:
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{where}: expected a non-empty mapping dtype -> FLOP/s")
    return {str(k): _number(v, f"{where}.{k}") for k, v in table.items()}


def _host_cache_bytes(level: int, data: bool) -> int | None:
    """A cache size of this machine from os.sysconf or Linux sysfs; None when neither says."""
    name = {1: "SC_LEVEL1_DCACHE_SIZE", 2: "SC_LEVEL2_CACHE_SIZE", 3: "SC_LEVEL3_CACHE_SIZE"}[level]
    if name in os.sysconf_names:
        try:
            size = os.sysconf(name)
            if size and size > 0:
                return int(size)
        except (OSError, ValueError):
            pass
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return None
    for entry in entries:
        d = os.path.join(base, entry)
        try:
            with open(os.path.join(d, "level")) as f:
                lvl = int(f.read().strip())
            with open(os.path.join(d, "type")) as f:
                typ = f.read().strip()
            with open(os.path.join(d, "size")) as f:
                text = f.read().strip().upper()
        except (OSError, ValueError):
            continue
        if lvl != level or typ == "Instruction" or (data and typ not in ("Data", "Unified")):
            continue
        mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
        try:
            return int(text.rstrip("KMG")) * mult
        except ValueError:
            return None
    return None


def _host_memory_bytes() -> int | None:
    try:
        size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(size) if size > 0 else None
    except (OSError, ValueError, AttributeError):
        return None


def _probe_host(entry: dict, sources: dict[str, str]) -> None:
    """Fill the ``cpu`` entry with what this machine reports (the YAML values are the fallbacks)."""
    cores = os.cpu_count()
    if cores:
        entry["sm_count"] = cores
        sources["sm_count"] = f"os.cpu_count() = {cores} at load time (logical CPUs)"
    llc = _host_cache_bytes(3, data=False) or _host_cache_bytes(2, data=False)
    if llc:
        entry["l2_bytes"] = llc
        sources["l2_bytes"] = f"last-level cache {llc} bytes, read from the OS at load time"
    l1d = _host_cache_bytes(1, data=True)
    if l1d:
        entry["smem_bytes_per_sm"] = entry["smem_bytes_per_block"] = l1d
        sources["smem_bytes_per_sm"] = f"L1 data cache {l1d} bytes per core, read from the OS at load time"
    mem = _host_memory_bytes()
    if mem:
        entry["memory_bytes"] = mem
        sources["memory_bytes"] = f"physical memory {mem} bytes, os.sysconf at load time"
    # FLOP/s for the whole host: per-core rates (documented assumptions) x cores x clock.
    deriv = entry.get("derivation") or {}
    clock = _number(entry["clock_hz"], "cpu.clock_hz")
    for field, key in (("matrix_flops_per_s", "matrix_flops_per_clk_per_sm"),
                       ("vector_flops_per_s", "vector_flops_per_clk_per_sm")):
        per_clk = _rates(deriv.get(key), f"cpu.derivation.{key}")
        entry[field] = {k: v * int(entry["sm_count"]) * clock for k, v in per_clk.items()}


def _build(entry: dict, tile_sets: dict[str, tuple[tuple[int, int], ...]]) -> Accelerator:
    if not isinstance(entry, dict) or "name" not in entry:
        raise ValueError(f"{ACCELERATORS_YAML.name}: every entry needs a name")
    name = str(entry["name"])
    unknown = set(entry) - set(_FIELDS) - set(_EXTRA_KEYS)
    missing = set(_FIELDS) - set(entry) - {"sources"}
    if unknown or missing:
        raise ValueError(f"{name}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
    entry = dict(entry)
    sources = {str(k): str(v) for k, v in (entry.get("sources") or {}).items()}
    if entry["vendor"] == "cpu":
        _probe_host(entry, sources)
    kwargs: dict = {"name": name, "vendor": str(entry["vendor"]), "sources": sources}
    for f in _INT_FIELDS:
        kwargs[f] = _number(entry[f], f"{name}.{f}", int)
    for f in _FLOAT_FIELDS:
        kwargs[f] = _number(entry[f], f"{name}.{f}")
    for f in _RATE_FIELDS:
        kwargs[f] = _rates(entry[f], f"{name}.{f}")
    kwargs["triton_backend"] = None if entry["triton_backend"] is None else str(entry["triton_backend"])
    arch = entry["triton_arch"]
    kwargs["triton_arch"] = arch if arch is None or isinstance(arch, int) else str(arch)
    for f in TABLE_FIELDS:
        value = entry[f]
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name}.{f}: expected a name or null, got {value!r}")
        if value is not None and not sources.get(f, "").strip():
            raise ValueError(f"{name}.{f}: no source; add sources.{f} saying where {value!r} comes from")
        kwargs[f] = value
    tiles = entry["gemm_tiles"]
    if tiles is not None and tiles not in tile_sets:
        raise ValueError(f"{name}.gemm_tiles: unknown tile set {tiles!r}; known: {', '.join(tile_sets)}")
    kwargs["gemm_tiles"] = tile_sets[tiles] if tiles is not None else ()
    return Accelerator(**kwargs)


def _tile_sets(doc: dict) -> dict[str, tuple[tuple[int, int], ...]]:
    """The YAML's ``gemm_tile_sets``: name -> ((BM, BN), ...); raises ValueError when malformed."""
    out = {}
    for name, spec in (doc.get("gemm_tile_sets") or {}).items():
        tiles = spec.get("tiles") if isinstance(spec, dict) else None
        if not tiles or not all(isinstance(t, list) and len(t) == 2 and all(isinstance(x, int) and x > 0 for x in t)
                                for t in tiles) or not str(spec.get("source", "")).strip():
            raise ValueError(f"{ACCELERATORS_YAML.name}: gemm_tile_sets.{name} needs tiles: [[BM, BN], ...] "
                             "of positive integers and a source")
        out[str(name)] = tuple((int(a), int(b)) for a, b in tiles)
    return out


@functools.lru_cache(maxsize=1)
def _document() -> dict:
    """The YAML document as written (read once)."""
    import yaml  # deferred: keeps ``import sftctl.compiler.hardware`` cheap

    with ACCELERATORS_YAML.open() as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml: 20x faster, same result


def _entries() -> tuple[dict, ...]:
    """The YAML's accelerator entries as written."""
    return tuple(_document()["accelerators"])


def load_identities() -> dict[str, dict]:
    """Each accelerator's ``identity:`` mapping as written in ``accelerators.yaml`` ({} where it
    has none), by catalog name; :mod:`sftctl.catalog.identity` reads it."""
    return {str(e["name"]): dict(e.get("identity") or {}) for e in _entries()}


@functools.lru_cache(maxsize=1)
def load_accelerators() -> dict[str, Accelerator]:
    """Every accelerator in ``accelerators.yaml`` by catalog name (``H100``, ..., ``cpu``).

    The ``cpu`` entry describes this machine: core count from ``os.cpu_count()``, memory and cache
    sizes from the OS where it reports them, FLOP/s derived from documented per-core assumptions.
    Cached: the table is read once per process and the same dict is returned to every caller, so
    treat it as read-only. Raises ValueError on a malformed file.
    """
    table: dict[str, Accelerator] = {}
    tile_sets = _tile_sets(_document())
    for entry in _entries():
        acc = _build(entry, tile_sets)
        if acc.name.lower() in {n.lower() for n in table}:
            raise ValueError(f"{ACCELERATORS_YAML.name}: {acc.name} appears twice")
        table[acc.name] = acc
    return table


def calibrated_from(accelerator: str) -> str | None:
    """The accelerator whose shipped calibration ``accelerator`` uses (the same die: H100 <- H200),
    or None (its own, or none): the entry's ``calibration`` file is named after the accelerator
    it was measured on (``h200.json``)."""
    acc = find_accelerator(accelerator)
    if acc is None or not acc.calibration:
        return None
    src = find_accelerator(Path(acc.calibration).stem)
    return src.name if src is not None and src.name != acc.name else None


def find_accelerator(name: str) -> Accelerator | None:
    """Case-insensitive lookup (``h100``, ``A100-80gb``, ``Mi300x``); None when unknown."""
    key = name.strip().lower()
    for acc_name, acc in load_accelerators().items():
        if acc_name.lower() == key:
            return acc
    return None


def get_accelerator(name: str) -> Accelerator:
    """The accelerator called ``name`` (any case).

    Raises:
        KeyError: unknown name; the message suggests the closest known one and lists them all.
    """
    acc = find_accelerator(name)
    if acc is not None:
        return acc
    names = list(load_accelerators())
    close = suggest_accelerators(name, names)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise KeyError(f"unknown accelerator {name!r}{hint} (known: {', '.join(names)})")


def suggest_accelerators(name: str, names: list[str]) -> list[str]:
    """What an unknown accelerator ``name`` most likely meant, of ``names`` (the catalog's
    spellings): the same chip with a memory suffix (``A100`` -> A100-40GB, A100-80GB; ``h10``
    -> H100), the chip without one (``H100-80GB`` -> H100, which comes in one size), else the
    closest spelling (``B200x`` -> B200). Empty when nothing is close."""
    import difflib
    import re

    lowered = {n.lower(): n for n in names}
    key = name.strip().lower()
    sized = sorted(real for low, real in lowered.items() if key and low.startswith(key))
    if sized:
        return sized
    base = re.sub(r"-\d+\s*gb$", "", key)
    if base != key and base in lowered:
        return [lowered[base]]
    return [lowered[c] for c in difflib.get_close_matches(key, list(lowered), n=1, cutoff=0.5)]

