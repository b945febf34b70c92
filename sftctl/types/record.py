"""The records' base: :class:`Record` (``to_dict()``/``from_dict()`` of a frozen dataclass)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, TypeVar

T = TypeVar("T", bound="Record")


class Record:
    """Mixin: JSON serialization of a frozen dataclass (enums as their values, nested records as dicts)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        """Build from ``to_dict()``'s output; unknown keys are ignored, missing ones take defaults.

        Raises:
            TypeError: a field without a default is missing.
        """
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
