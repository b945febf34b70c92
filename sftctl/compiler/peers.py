"""The peer model: what the field's own library kernels (cuBLAS, torch's eager kernels, copies)
achieve on an accelerator, for pricing the ``eager`` and ``default`` execution modes
(:mod:`sftctl.compiler.modes`). Solved from the shipped calibration's peers
(:func:`sftctl.compiler.calibrated.peer_efficiency`: the calibration the accelerator's catalog
entry names as ``peers``, today ``sftctl/compiler/calibrations/data/h200/peers.jsonl`` for every
GPU, as fractions of its own peaks); the constants below are the same solve, used for an
accelerator whose entry names no peers (see :mod:`sftctl.compiler.modes` for the arithmetic and
each number's source).
"""

from __future__ import annotations

import dataclasses
import json
import math

from sftctl.catalog.identity import calibrated_from
from sftctl.compiler.calibrated import DATA_DIR, peer_efficiency
from sftctl.compiler.hardware import Accelerator, get_accelerator

H200_HBM_BYTES_PER_S = 4.8e12  # NVIDIA H200 datasheet (the catalog's figure), for the fractions below
#: torch copy_ of 2 GiB on the H200 (read + write), peers.jsonl: 4.24 TB/s, the practical ceiling
COPY_HBM_FRACTION = 4.241e12 / H200_HBM_BYTES_PER_S

#: cuBLAS (see the module docstring; solved from peers.jsonl's two bf16 torch.mm timings).
CUBLAS_TILE = (128, 128)
CUBLAS_MMA_EFFICIENCY = 0.875
CUBLAS_WAVE_S = 1.47e-6
CUBLAS_SOURCE = ("H200 torch.mm (cuBLAS) bf16, calibrations/data/h200/peers.jsonl: 4096^3 175.4 us (784 TFLOP/s), "
                 "8192x2304x768 47.7 us (608 TFLOP/s); torch 2.11 + CUDA 13.0, triton do_bench median")


@dataclasses.dataclass(frozen=True)
class EagerKernelClass:
    """A class of torch eager memory-bound kernels: achieved bandwidth as a fraction of HBM peak
    and a fixed GPU time per kernel (ramp-up, tail, event), both from two measured sizes."""

    hbm_fraction: float
    fixed_s: float
    source: str


# (bytes, seconds) pairs from calibrations/data/h200/peers.jsonl -> bandwidth = dB/dt, fixed = t - B/bw
EAGER_KERNELS = {
    # layer norm bf16: 8192x768 21.65 us, 65536x1024 155.55 us (read + write x, 8 B/row stats)
    "layernorm": EagerKernelClass(1.817e12 / H200_HBM_BYTES_PER_S, 7.8e-6,
                                  "torch eager F.layer_norm bf16 on H200, peers.jsonl"),
    # softmax bf16: 8192x768 19.39 us, 65536x1024 108.96 us
    "softmax": EagerKernelClass(2.715e12 / H200_HBM_BYTES_PER_S, 10.1e-6,
                                "torch eager softmax bf16 on H200, peers.jsonl"),
    # bias + GELU as eager runs it, two kernels (add, gelu), 8 B/element: 8192x768 30.16 us,
    # 65536x1024 243.81 us -> 2.28 TB/s and 4.0 us per kernel: elementwise ops with
    # transcendental math (GELU, its backward, exp, erf, tanh)
    "elementwise": EagerKernelClass(2.278e12 / H200_HBM_BYTES_PER_S, 4.0e-6,
                                    "torch eager x + b then F.gelu, bf16 on H200, peers.jsonl"),
    # plain elementwise ops (casts, adds, multiplies, where): torch's copy_ of 2 GiB reaches
    # 4.24 TB/s (peers.jsonl), with the elementwise class's 4.0 us per kernel
    "copy": EagerKernelClass(COPY_HBM_FRACTION, 4.0e-6,
                             "torch eager copy_ of 2 GiB on H200 (4.24 TB/s), peers.jsonl"),
}

@dataclasses.dataclass(frozen=True)
class PeerModel:
    """The eager/library kernel coefficients for one accelerator, solved from the shipped
    calibration's peers (:func:`sftctl.compiler.calibrated.peer_efficiency`: cuBLAS and torch
    eager kernels measured on the H200; an accelerator of the same die gets the same fractions of
    its own peaks; any other accelerator the H200's fractions, stated in ``source``)."""

    cublas_efficiency: float
    cublas_wave_s: float
    classes: dict = dataclasses.field(hash=False)  # klass -> EagerKernelClass
    copy_fraction: float
    source: str


def _solve_cublas(shapes: list[tuple[int, int, int, float]], peak: float, sms: int) -> tuple[float, float] | None:
    """(efficiency, seconds per wave) from two (M, N, K, seconds) cuBLAS timings under the
    128x128-tile wave model: ``waves * (tile FLOPs * SMs / (e * peak) + w) = t``, linear in 1/e, w."""
    if len(shapes) < 2:
        return None
    bm, bn = CUBLAS_TILE
    rows = []
    for m, n, k, t in shapes[:2]:
        waves = math.ceil(math.ceil(m / bm) * math.ceil(n / bn) / sms)
        rows.append((waves * 2.0 * bm * bn * k * sms / peak, waves, t))
    (a1, b1, t1), (a2, b2, t2) = rows
    det = a1 * b2 - a2 * b1
    if det == 0:
        return None
    inv_e = (t1 * b2 - t2 * b1) / det
    w = (a1 * t2 - a2 * t1) / det
    if inv_e <= 0 or w < 0:
        return None
    return 1.0 / inv_e, w


def _solve_stream(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(bytes/s, fixed seconds per kernel) through two (bytes, seconds) points."""
    if len(points) < 2:
        return None
    (b1, t1), (b2, t2) = sorted(points)[:2]
    if t2 <= t1 or b2 <= b1:
        return None
    bw = (b2 - b1) / (t2 - t1)
    return bw, max(0.0, t1 - b1 / bw)


_FALLBACK_SOURCE = "constants in sftctl.compiler.modes (H200 peers.jsonl, solved by hand)"


def peer_model(hw: Accelerator) -> PeerModel:
    """:class:`PeerModel` for accelerator ``hw`` (:func:`sftctl.compiler.target.load_target`, which
    caches per accelerator, is its caller): solved from the calibration its catalog entry names as
    ``peers``. Falls back to this module's constants (the same H200 measurements) when it names
    none or the peers file is missing."""
    fallback = PeerModel(CUBLAS_MMA_EFFICIENCY, CUBLAS_WAVE_S, dict(EAGER_KERNELS), COPY_HBM_FRACTION,
                         _FALLBACK_SOURCE)
    peers = peer_efficiency(hw)
    if peers is None:
        return fallback
    # solve on the device that was measured (its peaks and SMs); efficiencies and bandwidth
    # fractions carry over as fractions of the target's peaks, fixed times as seconds
    measured = get_accelerator(peers.measured_on)
    peers = peer_efficiency(measured) or peers
    path = DATA_DIR / peers.measured_on.lower() / "peers.jsonl"
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return fallback
    peak, hbm = measured.matrix_peak("bfloat16"), measured.hbm_bytes_per_s
    gemms = []
    for r in records:
        f = peers.cublas_bf16_fraction_of_peak.get(r.get("shape_name"))
        if r.get("kernel") == "gemm" and f:
            gemms.append((r["M"], r["N"], r["K"], 2.0 * r["M"] * r["N"] * r["K"] / (f * peak)))
    cublas = _solve_cublas(gemms, peak, measured.sm_count)
    classes = dict(EAGER_KERNELS)
    for kernel, klass, bytes_per_elem, kernels in (("layernorm", "layernorm", 4, 1), ("softmax", "softmax", 4, 1),
                                                   ("bias_gelu", "elementwise", 8, 2)):
        pts: list[tuple[float, float]] = []
        for shape, f in peers.eager_row_fraction_of_hbm_peak.get(kernel, {}).items():
            m, n = (int(x) for x in shape.split("x"))
            t = 4.0 * m * n / (f * hbm)  # the calibration's convention: bf16 read + write
            pts.append((bytes_per_elem * m * n, t))
        solved = _solve_stream(pts)
        if solved:
            bw, fixed = solved
            classes[klass] = EagerKernelClass(bw / hbm, fixed / kernels,
                                              f"{kernel} measured on {peers.measured_on} (calibration peers), "
                                              f"{bytes_per_elem} B/element in {kernels} kernel(s)")
    copy = peers.copy_bytes_per_s / hbm if peers.copy_bytes_per_s else COPY_HBM_FRACTION
    classes["copy"] = EagerKernelClass(copy, classes["elementwise"].fixed_s,
                                       f"copy bandwidth measured on {peers.measured_on} (calibration peers)")
    if cublas is None:
        return fallback
    return PeerModel(cublas[0], cublas[1], classes, copy,
                     f"calibration peers measured on {peers.measured_on} "
                     f"({'same die' if peers.measured_on == hw.name or calibrated_from(hw.name) == peers.measured_on else 'its fractions of peak carried to ' + hw.name})")
