"""Prefix forests of token sequences and their flat depth-first packing (plain torch + numpy)."""

from .forest import PrefixForest
from .packed import CHUNK_SIZE, PackedForest

__all__ = ["CHUNK_SIZE", "PackedForest", "PrefixForest"]
