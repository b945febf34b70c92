"""Schedule search for streaming kernels: row kernels (softmax, norms, cross-entropy, row
reductions) and elementwise chains, scored by the cost model.

The spaces are small (a row kernel: :data:`ROW_WARPS` at the row's block width; an elementwise
kernel: :data:`ELEMENTWISE_BLOCKS` x :data:`ELEMENTWISE_WARPS`), so the search scores every
point with :func:`~sftctl.compiler.costmodel.row_kernel_time_s` /
:func:`~sftctl.compiler.costmodel.elementwise_time_s` (vectorized) and returns the fastest. Ties
(equal to 9 significant digits) go to the schedule launching the fewest threads (each thread
pays its index, mask and address instructions once), then the fewest blocks (each block costs
the SM a launch), never to the enumeration order (:func:`_pick`). Results are memoized per
(kind, sizes, accelerator, coefficients).

On the H200 measurements (``calibrations/data/h200``) the model orders these configs with
Spearman 0.92-0.97 (row kernels) and picks a config within 1.05x of the best measured; the old
fixed rule (4 or 8 warps) ran 1.1-1.8x slower than the best there.
"""

from __future__ import annotations

import functools

import numpy as np

from sftctl.compiler.costmodel import Coefficients, elementwise_time_s, row_kernel_time_s
from sftctl.compiler.hardware import Accelerator

ROW_WARPS = (1, 2, 4, 8, 16, 32)
ELEMENTWISE_BLOCKS = (256, 512, 1024, 2048, 4096, 8192)
ELEMENTWISE_WARPS = (1, 2, 4, 8, 16)
#: The block width of a row kernel: the row rounded up to a power of two, at most this many
#: elements (16 KiB of fp32 per program in registers); longer rows loop over chunks.
MAX_ROW_BLOCK = 4096


def row_block(n: int) -> int:
    """BLOCK_N of a row of ``n`` elements: next power of two, within [16, MAX_ROW_BLOCK]."""
    b = 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
    return max(16, min(b, MAX_ROW_BLOCK))


class _Key:
    """Hashable wrapper of an Accelerator (its dict fields are not hashable) for the memo."""

    def __init__(self, hw: Accelerator) -> None:
        from sftctl.compiler.search.gemm import _hw_key

        self.hw, self.key = hw, _hw_key(hw)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Key) and self.key == other.key


def _pick(t: np.ndarray, threads: np.ndarray, blocks: np.ndarray) -> int:
    """Index of the fastest of ``t`` (seconds per candidate), ties broken by fewer ``threads``
    launched in all, then fewer ``blocks`` (see the module's docstring)."""
    from sftctl.compiler.search.gemm import _tie_time

    key = np.asarray([_tie_time(float(x)) if np.isfinite(x) else np.inf for x in t])
    return int(np.lexsort((blocks, threads, key))[0])


@functools.lru_cache(maxsize=4096)
def _row_search(kind: str, rows: int, cols: int, dtype: str, hwk: _Key, coeffs: Coefficients):
    hw = hwk.hw
    block = row_block(cols)
    W = np.asarray(ROW_WARPS, dtype=float)
    cfg = {"ROWS": np.ones_like(W), "BLOCK_N": np.full_like(W, block), "num_warps": W}
    t = np.asarray(row_kernel_time_s(kind, rows, cols, cfg, hw, coeffs, dtype=dtype), dtype=float)
    i = _pick(t, rows * W * hw.warp_size, np.full_like(W, rows))
    return {"BLOCK_N": block, "num_warps": int(W[i])}, float(t[i])


def search_row_config(kind: str, rows: int, cols: int, hw: Accelerator, coeffs: Coefficients,
                      dtype: str = "bfloat16") -> tuple[dict, float]:
    """``({"BLOCK_N", "num_warps"}, predicted seconds)`` of the fastest row-kernel schedule for a
    ``rows x cols`` input (one row per program). ``kind``: ``softmax``, ``layernorm``, ``rmsnorm``
    (row sums / max / cross-entropy are priced as ``softmax``: two reductions per row)."""
    c = coeffs
    cfg, t = _row_search(kind, max(int(rows), 1), max(int(cols), 1), dtype, _Key(hw), c)
    return dict(cfg), t


@functools.lru_cache(maxsize=4096)
def _ew_search(n: int, bytes_per_element: float, instr: float, hwk: _Key, coeffs: Coefficients):
    hw = hwk.hw
    grid_b, grid_w = np.meshgrid(np.asarray(ELEMENTWISE_BLOCKS, float), np.asarray(ELEMENTWISE_WARPS, float), indexing="ij")
    B, W = grid_b.reshape(-1), grid_w.reshape(-1)
    t = np.asarray(elementwise_time_s(n, {"BLOCK": B, "num_warps": W}, hw, coeffs, kind="elementwise",
                                      bytes_per_element=bytes_per_element, instr_per_element=instr), dtype=float)
    blocks = np.ceil(n / B)
    i = _pick(t, blocks * W * hw.warp_size, blocks)
    return {"BLOCK": int(B[i]), "num_warps": int(W[i])}, float(t[i])


def search_elementwise_config(n_elements: int, hw: Accelerator, coeffs: Coefficients,
                              bytes_per_element: float = 4.0, instr_per_element: float | None = None
                              ) -> tuple[dict, float]:
    """``({"BLOCK", "num_warps"}, predicted seconds)`` of the fastest schedule of an elementwise
    kernel over ``n_elements`` moving ``bytes_per_element`` DRAM bytes per element (inputs +
    outputs) with ``instr_per_element`` instructions (default: the model's ``elementwise``)."""
    from sftctl.compiler.costmodel import STREAM_KERNELS

    c = coeffs
    instr = float(instr_per_element if instr_per_element is not None else STREAM_KERNELS["elementwise"]["instr"])
    cfg, t = _ew_search(max(int(n_elements), 1), float(bytes_per_element), instr, _Key(hw), c)
    return dict(cfg), t


def target_for_tensor(x):
    """The :class:`sftctl.compiler.target.Target` a tensor's kernels are scheduled for (the
    codegen's kernels, launched outside any compile, price their configs against it): that of its
    device, :meth:`sftctl.compiler.target.Target.for_device`."""
    from sftctl.compiler.target import Target

    return Target.for_device(getattr(x, "device", None))
