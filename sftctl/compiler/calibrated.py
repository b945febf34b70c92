"""The shipped calibrations: reading ``calibrations/<accelerator>.json`` (the fitted cost-model
coefficients and the peers' measured library efficiencies). No fitting here: that is the tool
``python -m sftctl.compiler.calibration``, which writes these files and which no module imports.

:func:`sftctl.compiler.target.load_target` is the one reader of these files for the compiler.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from sftctl.catalog.accelerators import calibrated_from
from sftctl.compiler.costmodel import Coefficients
from sftctl.compiler.hardware import find_accelerator, get_accelerator, load_accelerators

CALIBRATION_DIR = Path(__file__).resolve().parent / "calibrations"
DATA_DIR = CALIBRATION_DIR / "data"



def carries_over() -> dict[str, str]:
    """Accelerator -> the accelerator whose calibration it uses (the same die: H100 <- H200), from
    the catalog's ``calibration`` column (:func:`sftctl.catalog.accelerators.calibrated_from`)."""
    return {n: src for n in load_accelerators() if (src := calibrated_from(n))}


def calibration_path(name: str) -> Path:
    return CALIBRATION_DIR / f"{name.lower()}.json"


@functools.lru_cache(maxsize=None)
def _load_json(path: str) -> dict | None:
    p = Path(path)
    if not p.exists():
        return None
    return json.loads(p.read_text())


def calibration_for(name: str) -> dict | None:
    """The shipped calibration document of accelerator ``name``: the file its catalog entry's
    ``calibration`` names (its own, or its die's: :func:`carries_over`); None when it names none
    or the catalog does not know it."""
    acc = find_accelerator(name)
    return _load_json(str(CALIBRATION_DIR / acc.calibration)) if acc is not None and acc.calibration else None


def coefficient_overrides(name: str) -> dict:
    """Fitted coefficient values for accelerator ``name`` ({} when not calibrated)."""
    doc = calibration_for(name)
    return dict(doc["coefficients"]) if doc else {}


@dataclasses.dataclass(frozen=True)
class PeerEfficiency:
    """What the field's own kernels measured on an accelerator (for eager / torch.compile models).

    Attributes:
        accelerator: catalog name asked for; ``measured_on``: where the numbers come from.
        cublas_bf16_flops_per_s: shape name -> cuBLAS (``torch.mm``) bf16 FLOP/s measured.
        cublas_bf16_fraction_of_peak: the same over the dense bf16 datasheet peak (carries
            over between accelerators of one die).
        eager_row_bytes_per_s: kernel -> torch eager bytes/s (read + write) per measured shape
            ``{kernel: {"MxN": bytes/s}}``, scaled by the HBM peak ratio for another accelerator.
        eager_row_fraction_of_hbm_peak: the same as fractions of the datasheet HBM peak.
        copy_bytes_per_s: device-to-device copy bandwidth (read + write), scaled likewise.
    """

    accelerator: str
    measured_on: str
    cublas_bf16_flops_per_s: dict
    cublas_bf16_fraction_of_peak: dict
    eager_row_bytes_per_s: dict
    eager_row_fraction_of_hbm_peak: dict
    copy_bytes_per_s: float


def peer_efficiency(accelerator) -> PeerEfficiency | None:
    """Measured cuBLAS GEMM efficiency and torch-eager row-kernel bandwidth for ``accelerator``
    (an ``Accelerator`` or catalog name), from the peers of the calibration its catalog entry's
    ``peers`` names, as the same fractions of its own peaks (its die's, or carried over from
    another's, as the entry's source says). None when it names none. E.g. H200: cuBLAS bf16
    4096^3 = 784 TFLOP/s (0.79 of 989.4)."""
    hw = get_accelerator(accelerator) if isinstance(accelerator, str) else accelerator
    doc = _load_json(str(CALIBRATION_DIR / hw.peers)) if hw.peers else None
    if not doc or "peers" not in doc:
        return None
    p = doc["peers"]
    peak = hw.matrix_peak("bfloat16")
    return PeerEfficiency(
        accelerator=hw.name, measured_on=doc["accelerator"],
        cublas_bf16_flops_per_s={k: v * peak for k, v in p["cublas_bf16_fraction_of_peak"].items()},
        cublas_bf16_fraction_of_peak=dict(p["cublas_bf16_fraction_of_peak"]),
        eager_row_bytes_per_s={k: {s: f * hw.hbm_bytes_per_s for s, f in v.items()}
                               for k, v in p["eager_row_fraction_of_hbm_peak"].items()},
        eager_row_fraction_of_hbm_peak={k: dict(v) for k, v in p["eager_row_fraction_of_hbm_peak"].items()},
        copy_bytes_per_s=p["copy_fraction_of_hbm_peak"] * hw.hbm_bytes_per_s)


def load_coefficients(path: Path, hw):
    """Coefficients of ``hw`` with a calibration file's values (over :meth:`Coefficients.uncalibrated`:
    a fit under evaluation). Raises ValueError if malformed, OSError if unreadable."""
    try:
        doc = json.loads(Path(path).read_text())
        values = doc["coefficients"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a calibration file ({e})") from None
    fields = {f.name for f in dataclasses.fields(Coefficients)}
    unknown = set(values) - fields
    if unknown:
        raise ValueError(f"{path}: unknown coefficients {sorted(unknown)}")
    return dataclasses.replace(Coefficients.uncalibrated(hw), **values)
