"""How an accelerator is recognized, wherever sftctl meets one: the one reader of the
``identity:`` column of ``accelerators.yaml``.

* a CUDA/ROCm device (:func:`identify`: torch's device name, its memory, its compute capability);
* a Kubernetes node's labels (:func:`from_node_labels`: GPU Feature Discovery, GKE, Karpenter,
  AMD's node labeller);
* a Compute Engine accelerator type (:func:`gce_accelerator_type`, :func:`from_gce_accelerator_type`);
* a Slurm GPU type (:func:`from_slurm_gres`: ``gres.conf`` ``Type=``).

(:func:`calibrated_from`, the accelerator whose calibration another uses, is read off the entry's
``calibration`` field by :mod:`sftctl.catalog.accelerators` and re-exported here.)

An entry's ``identity`` keys (every one optional)::

    cuda_names: [H100]             tokens of torch.cuda.get_device_name(): a token matches where no
                                   letter or digit precedes it and no digit follows (GH200 is no H200,
                                   L40S no L4)
    device_memory_gib: [lo, hi]    parts that share a name told apart by their memory: the size the
                                   name carries ("80GB"), else the device's memory, in [lo, hi)
                                   (None: open; an unknown size counts as the largest)
    compute_capability: "9.0"      the CUDA compute capability
    identify_by_capability: true   an unknown name of that capability is this accelerator (GH200 -> H100)
    kubernetes_labels: {label: [values]}   node label values that say a node has this GPU
    gce_accelerator_type: nvidia-h100-80gb
    slurm_gres: [h100_80gb]        GPU type names clusters use besides the catalog name itself

Adding an accelerator is an entry in ``accelerators.yaml`` (facts, identity, the measured tables
it names), its rows in ``offerings.csv``, and, where it has measured data, its rows in those
data files: nothing here changes.
Imports nothing heavy and nothing of the compiler.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sftctl.catalog.accelerators import Accelerator, calibrated_from, find_accelerator, load_accelerators, load_identities

__all__ = ["calibrated_from", "from_gce_accelerator_type", "from_node_labels", "from_slurm_gres",
           "gce_accelerator_type", "identify", "kubernetes_labels"]

_GB = re.compile(r"(\d+)\s*GB", re.IGNORECASE)


def _token(text: str, token: str) -> bool:
    return re.search(rf"(?<![A-Z0-9]){re.escape(token.upper())}(?![0-9])", text.upper()) is not None


def _in_range(gib: float, bounds) -> bool:
    lo, hi = (list(bounds) + [None, None])[:2]
    return (lo is None or gib >= lo) and (hi is None or gib < hi)


def identify(device: Any = None, *, name: str | None = None, memory_bytes: int | None = None,
             capability: tuple[int, int] | str | None = None) -> Accelerator | None:
    """The catalog accelerator of a device, or None when nothing identifies it.

    ``device``: what ``torch.cuda.get_device_properties(i)`` returns (``name``, ``total_memory``,
    ``major``, ``minor``), a device name (``"NVIDIA H100 80GB HBM3"``), or None with the keywords.
    Names first (``cuda_names``, told apart by ``device_memory_gib``), then the compute
    capability (``identify_by_capability``).
    """
    if isinstance(device, str):
        name = device
    elif device is not None:
        name = getattr(device, "name", name)
        memory_bytes = getattr(device, "total_memory", memory_bytes)
        if getattr(device, "major", None) is not None:
            capability = (device.major, device.minor)
    ids = load_identities()
    if name:
        sized = _GB.search(name)
        gib = float(sized.group(1)) if sized else (memory_bytes / 2**30 if memory_bytes else float("inf"))
        hits = [n for n, i in ids.items() if any(_token(name, t) for t in i.get("cuda_names") or ())]
        hits = [n for n in hits if _in_range(gib, ids[n].get("device_memory_gib") or (None, None))]
        if hits:
            return find_accelerator(hits[0])
    if capability is not None:
        cc = capability if isinstance(capability, str) else ".".join(str(int(x)) for x in capability)
        for n, i in ids.items():
            if i.get("compute_capability") == cc and i.get("identify_by_capability"):
                return find_accelerator(n)
    return None


def kubernetes_labels() -> dict[str, dict[str, Any]]:
    """Catalog accelerator -> ``{node label: [values that identify it]}``, plus ``"vendor"`` (a str)."""
    accs = load_accelerators()
    return {n: {"vendor": accs[n].vendor, **{k: [str(v) for v in vs] for k, vs in i["kubernetes_labels"].items()}}
            for n, i in load_identities().items() if i.get("kubernetes_labels") and n in accs}


def from_node_labels(labels: Mapping[str, str], keys: tuple[str, ...], memory_label: str | None = None,
                     name_label: str | None = None) -> tuple[str, str] | None:
    """``(catalog accelerator, the label value it was read from)`` of a Kubernetes node, trying
    ``keys`` in order; ``("", value)`` for a GPU label no entry knows; None without one. A value
    of ``name_label`` is told apart by ``memory_label`` where an entry lists memories (Karpenter's
    A100 40 GB and 80 GB)."""
    table = kubernetes_labels()
    for key in keys:
        value = labels.get(key)
        if not value:
            continue
        for acc, t in table.items():
            if value in t.get(key, ()) and (key != name_label or memory_label not in t
                                            or labels.get(memory_label) in t[memory_label]):
                return acc, value
        return "", value
    return None


def gce_accelerator_type(accelerator: str) -> str | None:
    """The Compute Engine accelerator type of a catalog accelerator (``nvidia-h100-80gb``), or None."""
    acc = find_accelerator(accelerator)
    return load_identities().get(acc.name, {}).get("gce_accelerator_type") if acc else None


def from_gce_accelerator_type(gce_type: str) -> str:
    """The catalog accelerator of a Compute Engine accelerator type, or ``""``."""
    return next((n for n, i in load_identities().items() if i.get("gce_accelerator_type") == gce_type), "")


def from_slurm_gres(gpu_type: str) -> str:
    """The catalog accelerator of a Slurm GPU type (``h100`` -> ``H100``, ``a100_80gb`` ->
    ``A100-80GB``), or ``""``: an entry's ``slurm_gres`` names, else the catalog name with case,
    ``-`` and ``_`` ignored."""
    key = gpu_type.lower()
    for n, i in load_identities().items():
        if key in [str(g).lower() for g in i.get("slurm_gres") or ()]:
            return n
    norm = re.sub(r"[-_]", "", key)
    return next((n for n in load_accelerators() if re.sub(r"[-_]", "", n.lower()) == norm), "")
