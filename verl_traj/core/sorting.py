"""One stable sort over several integer keys: ``np.lexsort``'s order at ``argsort``'s cost. Pure module (numpy)."""

from __future__ import annotations

import numpy as np

__all__ = ["lex_order"]

_ROOM = 1 << 62  # the packed key stays below this (int64 with headroom)


def lex_order(*keys: np.ndarray) -> np.ndarray:
    """``np.lexsort(keys)``: the stable order by the LAST key first, then the one before, and so on.

    Args:
        keys: ``[N]`` integer arrays (any sign). Where the product of their value ranges fits in 62 bits they are
            packed into one int64 key and sorted once (several times faster than lexsort at 10^6 rows);
            otherwise ``np.lexsort`` runs. Same result either way.
    Returns:
        ``[N]`` int64 positions.
    """
    if not keys or keys[0].size == 0:
        return np.lexsort(keys) if keys else np.zeros(0, dtype=np.int64)
    packed = np.zeros(keys[0].shape, dtype=np.int64)
    stride = 1
    for key in keys:  # first key least significant
        low, high = int(key.min()), int(key.max())
        packed += (key.astype(np.int64) - low) * stride
        stride *= high - low + 1
        if stride >= _ROOM:
            return np.lexsort(keys).astype(np.int64)
    return np.argsort(packed, kind="stable")
