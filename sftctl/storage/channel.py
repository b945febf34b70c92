"""Old home of the controller <-> node channel; it lives in :mod:`sftctl.protocol` now.

``StorageChannel`` is :class:`sftctl.protocol.NodeChannel` under its former name, kept so code
written against it still imports; new code uses :mod:`sftctl.protocol`.
"""

from __future__ import annotations

from sftctl.protocol import LaunchRequest, NodeChannel, is_secret_name

StorageChannel = NodeChannel

__all__ = ["LaunchRequest", "NodeChannel", "StorageChannel", "is_secret_name"]
