"""The compiler's disk cache: where it lives and how every entry is keyed.

Directory (:func:`cache_dir`): ``platformdirs.user_cache_dir("sftctl")/compiler``, i.e.
``$XDG_CACHE_HOME/sftctl/compiler`` (``~/.cache/sftctl/compiler``) on Linux and
``~/Library/Caches/sftctl/compiler`` on macOS. Not under ``$SFTCTL_HOME``: everything here is
derived and may be deleted at any time. Its parts:

* ``traces/<key>.pkl``: traced IR graphs (``driver.trace_model``);
* ``steps/<key>.json``: compiled steps (``driver.compile_for``);
* ``backend/gemm/<key>.json``: the ``sftensor`` backend's schedule searches (the model's top k);
* ``backend/gemm-measured/<key>.json``: the winner of those timed on a device, per (kernel,
  problem, device name);
* ``codegen/``: generated kernel sources and compiled kernels' resources
  (``$SFTCTL_CODEGEN_CACHE`` overrides this part).

Keys (:func:`cache_key`): one function for every entry, a hash of what the entry depends on
plus, by default, the compiler's own source (:func:`compiler_fingerprint`), so a change to the
compiler can never serve a stale entry. The tests (tests/test_compiler_cache.py) check that a key
changes when anything it hashes changes, and only then.

Imports nothing heavy (no numpy, torch).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import numbers
import os
from pathlib import Path

__all__ = ["atomic_write", "cache_dir", "cache_key", "compiler_fingerprint"]

#: Bumped by hand for changes the source hash cannot see (none so far); part of every key.
COMPILER_VERSION = "0.1.0"


def cache_dir() -> Path:
    """``platformdirs.user_cache_dir("sftctl")/compiler``, created if missing (see the module doc)."""
    import platformdirs

    d = Path(platformdirs.user_cache_dir("sftctl", appauthor=False)) / "compiler"
    d.mkdir(parents=True, exist_ok=True)
    return d


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (readers never see half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@functools.lru_cache(maxsize=1)
def compiler_fingerprint() -> str:
    """``COMPILER_VERSION`` plus a hash of every ``.py``, ``.json`` and ``.jsonl`` file of ``sftctl/compiler``
    (paths and bytes: the code and the shipped calibrations it prices with, e.g.
    ``calibrations/attention.json``), so any change to the compiler or its data invalidates cached
    traces and plans (a forgotten version bump cannot serve stale results). Read once per process."""
    h = hashlib.sha256(COMPILER_VERSION.encode())
    root = Path(__file__).resolve().parent
    for py in sorted([*root.rglob("*.py"), *root.rglob("*.json"), *root.rglob("*.jsonl")]):
        h.update(str(py.relative_to(root)).encode() + py.read_bytes())
    return f"{COMPILER_VERSION}+{h.hexdigest()[:12]}"


def _plain(obj):
    """JSON form of the non-JSON values a key may hash (``json.dumps``'s ``default``)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # the fields that define equality: an Accelerator's ``sources`` (compare=False) are
        # documentation, not facts the cached result depends on
        return {"__type__": type(obj).__name__,
                **{f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.compare}}
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, bytes):
        return hashlib.sha256(obj).hexdigest()
    if isinstance(obj, numbers.Integral):  # numpy integers
        return int(obj)
    if isinstance(obj, numbers.Real):  # numpy floats
        return float(obj)
    raise TypeError(f"cache_key: cannot hash a {type(obj).__name__} (give its data, not the object)")


def cache_key(*parts, fingerprint: bool = True) -> str:
    """The disk-cache key of an entry that depends on ``parts`` (32 hex digits of SHA-256).

    ``parts``: JSON values, dataclasses (their comparing fields, recursively: GemmProblem,
    Accelerator without ``sources``, Coefficients), sets, paths, bytes (hashed). Dict key order
    does not matter; a tuple and a list with the same items are the same. Put a word naming the
    kind of entry first (``"step"``, ``"trace"``, ...) so two kinds never share a key.
    ``fingerprint``: include :func:`compiler_fingerprint` (default); False only for entries that
    name everything they depend on themselves (a compiled kernel's resources: its source's bytes
    and the Triton version).

    Raises:
        TypeError: a part of a type that has no stable JSON form (an arbitrary object).
    """
    doc = [list(parts), compiler_fingerprint() if fingerprint else None]
    blob = json.dumps(doc, sort_keys=True, default=_plain, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]
