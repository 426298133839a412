"""Mesh axis names as a PartitionSpec entry or an axis rule writes them: one name, several,
or none."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["axis_tuple"]


def axis_tuple(entry: str | Iterable[str] | None) -> tuple[str, ...]:
    """``entry``'s mesh axis names, in order.

    Args:
        entry: One axis name, several, or None.

    Returns:
        ``(entry,)`` for one name, the names for several, ``()`` for None.
    """
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)
