"""The compiler's target: one accelerator's facts, its calibrated cost-model coefficients and its
peer model, built once and passed to everything that prices a kernel or a step.

    target = load_target("H200")          # catalog facts + calibrations/h200.json + peers
    target = Target.for_device(x.device)  # the accelerator a tensor's device is (sftensor, codegen)
    compiled = compile_graph(graph, target)

These two are the only lookups from a name or a device to an accelerator in the compiler; the
catalog record (``accelerators.yaml``) names every table that prices it.

Nothing below the front door (:mod:`sftctl.compiler.api`) derives coefficients on its own: a
function that prices takes a :class:`Target` (or, inside the cost model and the schedule search,
its ``hw`` and ``coeffs``), so a fit under evaluation (``target.with_coeffs(fitted)``) reaches
every price it affects. Where the numbers come from:

* ``hw``: :mod:`sftctl.catalog.accelerators` (``accelerators.yaml``, every number sourced);
* ``coeffs``: :meth:`Coefficients.uncalibrated` (vendor defaults, Hopper wgmma) overlaid with the
  shipped calibration the entry names (``calibration``: its own or its die's;
  :mod:`sftctl.compiler.calibrated`);
* ``peers``: :func:`sftctl.compiler.peers.peer_model` (cuBLAS and torch eager kernels as measured
  on the device of the entry's ``peers`` calibration; the eager and ``default`` modes' library
  kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

from sftctl.compiler.calibrated import coefficient_overrides
from sftctl.compiler.costmodel import Coefficients
from sftctl.compiler.hardware import Accelerator, get_accelerator
from sftctl.compiler.peers import PeerModel, peer_model


@dataclasses.dataclass(frozen=True)
class Target:
    """What the compiler prices against: ``hw`` (the catalog's facts), ``coeffs`` (the cost
    model's efficiency coefficients) and ``peers`` (library kernels' measured efficiency).
    Immutable; build it with :func:`load_target`, change the coefficients with
    :meth:`with_coeffs`."""

    hw: Accelerator
    coeffs: Coefficients
    peers: PeerModel

    @property
    def name(self) -> str:
        """The catalog name of the accelerator (``H200``)."""
        return self.hw.name

    def with_coeffs(self, coeffs: Coefficients) -> "Target":
        """The same accelerator and peers priced with other coefficients (a fit under evaluation)."""
        return dataclasses.replace(self, coeffs=coeffs)

    @classmethod
    def for_device(cls, device: Any = None) -> "Target":
        """The :class:`Target` of a torch device (a ``torch.device``, or None): the one device to
        accelerator lookup of the compiler (the ``sftensor`` backend, the codegen's kernels).

        ``$SFTCTL_ACCELERATOR`` (a catalog name) wins for every device. A CUDA/ROCm device is
        identified by the catalog (:func:`sftctl.catalog.identify`: its name, memory and compute
        capability); one the catalog does not know, and any other device (a forced CPU run under
        ``TRITON_INTERPRET=1``), get :data:`DEVICE_DEFAULT`, the unknown GPU with a warning.

        Raises:
            KeyError: an unknown ``$SFTCTL_ACCELERATOR`` (the message lists the known names).
        """
        from sftctl import settings

        override = settings.get("SFTCTL_ACCELERATOR")
        if override:
            return load_target(override)
        if device is not None and getattr(device, "type", None) == "cuda":
            return load_target(_cuda_accelerator(device.index))
        return load_target(DEVICE_DEFAULT)


#: What a device that names no catalog accelerator is scheduled for (:meth:`Target.for_device`: a
#: CPU tensor in a forced ``TRITON_INTERPRET=1`` run, or a GPU the catalog does not know): the
#: H100, the accelerator whose kernels the calibration covers (the H200's calibration carries
#: over to it) and whose schedules suit any recent NVIDIA GPU. The one default of that lookup;
#: ``$SFTCTL_ACCELERATOR`` overrides it.
DEVICE_DEFAULT = "H100"


@functools.lru_cache(maxsize=16)
def _cuda_accelerator(index: int | None) -> str:
    """The catalog name of CUDA device ``index`` (None: the current one), else :data:`DEVICE_DEFAULT`
    with a warning."""
    import torch

    from sftctl.catalog.identity import identify

    idx = index if index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    name = torch.cuda.get_device_name(idx)
    acc = identify(name=name, memory_bytes=int(props.total_memory), capability=(props.major, props.minor))
    if acc is not None:
        return acc.name
    warnings.warn(f"GPU {name!r} is not in the catalog (sftctl/catalog/accelerators.yaml); scheduling for "
                  f"{DEVICE_DEFAULT} (set SFTCTL_ACCELERATOR to choose)", stacklevel=3)
    return DEVICE_DEFAULT


def calibrated_coefficients(hw: Accelerator) -> Coefficients:
    """``hw``'s uncalibrated coefficients overlaid with its shipped calibration (none: unchanged),
    then ``Coefficients.ACCELERATOR[hw.name]`` (a hand override wins over the fit)."""
    c = dataclasses.replace(Coefficients.uncalibrated(hw), **coefficient_overrides(hw.name))
    return dataclasses.replace(c, **Coefficients.ACCELERATOR.get(hw.name, {}))


@functools.lru_cache(maxsize=None)
def _load(name: str) -> Target:
    hw = get_accelerator(name)
    return Target(hw, calibrated_coefficients(hw), peer_model(hw))


def load_target(accelerator: str | Accelerator) -> Target:
    """The :class:`Target` of an accelerator (a catalog name, any case, or an ``Accelerator``),
    with its shipped calibration. Cached per name; an ``Accelerator`` that is not the catalog's
    (a test's or a what-if's changed copy) is built afresh.

    Raises:
        KeyError: a name the catalog does not know (the message lists the known ones).
    """
    if isinstance(accelerator, str):
        return _load(get_accelerator(accelerator).name)
    t = _load(accelerator.name) if _known(accelerator.name) else None
    if t is not None and t.hw == accelerator:
        return t
    return Target(accelerator, calibrated_coefficients(accelerator), peer_model(accelerator))


def _known(name: str) -> bool:
    try:
        get_accelerator(name)
    except KeyError:
        return False
    return True
