"""Prompt prefixes served from the KV tiers: content-keyed chunks (`keys`) kept in tiers of stores (`tiers`)."""

from .keys import CHUNK_POSITIONS, PrefixIdentity
from .tiers import PrefixCache

__all__ = ["CHUNK_POSITIONS", "PrefixCache", "PrefixIdentity"]
