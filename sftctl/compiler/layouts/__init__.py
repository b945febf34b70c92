"""Parallel layouts (issue 38): data x tensor x pipeline x context x expert degrees, the data
dimension plain (DDP), ZeRO-1 or FSDP (ZeRO-3), micro-batch count, activation checkpointing and
pipeline schedule (1F1B or interleaved), each priced per rank from the sharded GEMM shapes with
the compiler's kernel prices, the calibrated collective model and the pipeline bubble.

* :mod:`.shape`: :class:`TransformerShape` (a decoder-only transformer's dimensions) and
  :func:`shape_from_graph` (read off a traced step's parameters).
* :mod:`.price`: :func:`price` of a :class:`~sftctl.types.layout.Layout` (re-exported here) -> :class:`LayoutPrediction` (seconds per step,
  its interval, bytes per rank, the breakdown); :func:`bubble_fraction`.
* :mod:`.memory`: :func:`memory_per_rank` and :func:`sharded_state`, the memory model the
  planner's data-parallel strategies (:mod:`sftctl.compiler.sharding`) share; :class:`Precision`.
* :mod:`.search`: :func:`search` (every layout of an offering, priced), :func:`choose`.
"""

from sftctl.compiler.layouts.memory import MEGATRON, TORCH_AMP, Precision, memory_per_rank, sharded_state
from sftctl.compiler.layouts.price import LayoutPrediction, Links, bubble_fraction, price
from sftctl.compiler.layouts.search import choose, layouts, search
from sftctl.compiler.layouts.shape import TransformerShape, shape_from_graph
from sftctl.types.layout import Layout

__all__ = ["MEGATRON", "TORCH_AMP", "Layout", "LayoutPrediction", "Links", "Precision", "TransformerShape",
           "bubble_fraction", "choose", "layouts", "memory_per_rank", "price", "search", "shape_from_graph",
           "sharded_state"]
