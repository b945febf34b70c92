"""The compiler's target: one accelerator's facts, its calibrated cost-model coefficients and its
peer model, built once and passed to everything that prices a kernel or a step.

    target = load_target("H200")          # catalog facts + calibrations/h200.json + peers
    compiled = compile_graph(graph, target)

Nothing below the front door (:mod:`sftctl.compiler.api`) derives coefficients on its own: a
function that prices takes a :class:`Target` (or, inside the cost model and the schedule search,
its ``hw`` and ``coeffs``), so a fit under evaluation (``target.with_coeffs(fitted)``) reaches
every price it affects. Where the numbers come from:

* ``hw``: :mod:`sftctl.catalog.accelerators` (``accelerators.yaml``, every number sourced);
* ``coeffs``: :meth:`Coefficients.uncalibrated` (vendor defaults, Hopper wgmma) overlaid with the
  shipped calibration (``calibrations/<name>.json``, or the one of the accelerator it shares a
  die with; :mod:`sftctl.compiler.calibrated`);
* ``peers``: :func:`sftctl.compiler.peers.peer_model` (cuBLAS and torch eager kernels as measured
  on the calibrated device; the eager and ``default`` modes' library kernels).
"""

from __future__ import annotations

import dataclasses
import functools

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
