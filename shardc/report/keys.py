"""A pytree leaf's name from its key path, as plans, reports and exported modules write it:
the root, then ``.key`` for string dict keys and attributes, ``[i]`` for sequence indices and
other keys (``state.params.blocks[3].attn.q.kernel``). The exported partition rules carry
``_key``'s source, so an exported module names leaves exactly as shardc does."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

__all__ = ["key_path"]


def _key(k) -> str:
    if isinstance(k, DictKey):
        return f".{k.key}" if isinstance(k.key, str) and k.key.isidentifier() \
            else f"[{k.key!r}]"
    if isinstance(k, GetAttrKey):
        return f".{k.name}"
    if isinstance(k, SequenceKey):
        return f"[{k.idx}]"
    if isinstance(k, FlattenedIndexKey):
        return f"[{k.key}]"
    return jax.tree_util.keystr((k,))


def key_path(root: str, path: Sequence) -> str:
    """``root`` followed by the keys of a ``tree_flatten_with_path`` path."""
    return root + "".join(_key(k) for k in path)
