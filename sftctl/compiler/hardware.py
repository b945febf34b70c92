"""Accelerator hardware facts used by the cost model.

The facts are owned by :mod:`sftctl.catalog.accelerators` (the table ``accelerators.yaml`` with
a source for every number, its loader and lookups); this module is the compiler's name for them,
so compiler code says ``from sftctl.compiler.hardware import Accelerator, get_accelerator``
and never opens the catalog's files by path. The catalog does not import the compiler.
"""

from __future__ import annotations

from sftctl.catalog.accelerators import Accelerator, find_accelerator, get_accelerator, load_accelerators

__all__ = ["Accelerator", "find_accelerator", "get_accelerator", "load_accelerators"]
