"""`PrefixReuse`: one model's prompts read from and kept in a `PrefixCache`, for a batch of prompts in a cache.

A batch reuses the chunks that every one of its rows finds (the shortest row's hit), leaving at least one prompt
token to compute so that the model gives the first token's logits; the rest of each prompt is then prefilled chunk
by chunk at the same boundaries (`prefill_chunk_size` = the chunk), so that a prompt read from the cache gives
exactly the tokens of the same prompt computed from its first position. Afterwards each row's whole prompt chunks
that were not read are kept, built from the cache on the writer thread. A batch with left padding neither reads nor
keeps chunks: a padded row's chunk boundaries are not its own positions' (it runs as without a cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from transformers import DynamicCache

from ..blocks import KVSpec, dtype_name
from ..errors import ConfigError
from ..store import Store
from .keys import CHUNK_POSITIONS, PrefixIdentity, check_salt
from .tiers import PrefixCache

Tiers = str | Store | Sequence[str | Store] | PrefixCache


class PrefixReuse:
    """Reads and keeps the prompt chunks of a model (`identity`, and `spec`: its KV's geometry, every layer) in
    `tiers` (URLs, stores or a ready `PrefixCache`), of its `layers` (global [first, stop); None: all of them, a
    pipeline stage its own)."""

    def __init__(self, identity: PrefixIdentity, spec: KVSpec, tiers: Tiers,
                 layers: tuple[int, int] | None = None) -> None:
        self.identity = identity
        self.layers = layers if layers is not None else (0, spec.layers)
        spec = attrs.evolve(spec, layers=self.layers[1] - self.layers[0])
        self.cache = tiers if isinstance(tiers, PrefixCache) else PrefixCache(tiers, spec)
        self._owned = not isinstance(tiers, PrefixCache)

    @classmethod
    def of(cls, model: Any, tiers: Tiers, chunk: int = CHUNK_POSITIONS) -> PrefixReuse:
        """All of a loaded Hugging Face `model`'s layers, in chunks of `chunk` positions."""
        return cls(PrefixIdentity.of(model, chunk), kv_spec_of(model), tiers)

    @property
    def chunk(self) -> int:
        return self.identity.chunk

    def generate_options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`prefill_chunk_size` for `model.generate`: the chunk (a caller's other value is refused, as it would
        cut prompts at other boundaries than the cached chunks')."""
        asked = kwargs.get("prefill_chunk_size")
        if asked is not None and asked != self.chunk:
            raise ConfigError(f"prefill_chunk_size={asked!r} with a prefix cache of {self.chunk}-position chunks: "
                              "prompts are prefilled chunk by chunk at the cache's boundaries (leave it out)")
        return {**kwargs, "prefill_chunk_size": self.chunk}

    def generate(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, salt: str,
                 **kwargs: Any) -> tuple[torch.Tensor, int]:
        """`model.generate(input_ids, ...)` from the chunks found (a fresh cache), keeping the new ones; the
        output and how many positions were read."""
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        cache = DynamicCache(config=model.config)
        restored = self.restore(input_ids, mask, cache, salt)
        out = model.generate(input_ids, attention_mask=mask, cache=cache, **self.generate_options(kwargs))
        self.keep(input_ids, mask, cache, restored, salt)
        return out, restored

    def restore(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache,
                salt: str = "") -> int:
        """Fill the empty `cache` with the chunks every row of `input_ids` finds (see the module) and return
        how many positions that is (0: none, or a padded batch)."""
        check_salt(salt)
        if not bool(attention_mask.to(torch.bool).all()):
            return 0
        most = self.most_read(input_ids.shape[1])
        rows: list[list[torch.Tensor]] = []
        for row in input_ids.tolist():
            rows.append(self.read(self.identity.digests(row, salt)[:most]))
            most = min(most, len(rows[-1]))
            if most == 0:
                return 0
        return fill(cache, [blocks[:most] for blocks in rows], input_ids.device)

    def most_read(self, length: int) -> int:
        """The most chunks a prompt of `length` positions reads: at least one position is left to compute, for
        the first token's logits."""
        return (length - 1) // self.chunk

    def read(self, digests: Sequence[str]) -> list[torch.Tensor]:
        """The leading chunks named `digests` that the tiers hold (this model's layers of each, a block)."""
        return self.cache.read(self.identity.keys_of(digests, self.layers))

    def keep(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache, restored: int,
             salt: str = "") -> None:
        """Keep each row's whole prompt chunks past `restored` positions, from `cache` (which holds them), on the
        writer thread."""
        if not bool(attention_mask.to(torch.bool).all()):
            return
        for index, row in enumerate(input_ids.tolist()):
            self.keep_row(self.identity.digests(row, salt), cache, index, restored)

    def keep_row(self, digests: Sequence[str], cache: DynamicCache, row: int, restored: int) -> None:
        """Keep the chunks named `digests` past `restored` positions from row `row` of `cache` (which holds them),
        on the writer thread."""
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        self.cache.write([(key, _block_of(layers, row, key.tokens))
                          for key in self.identity.keys_of(digests, self.layers)[restored // self.chunk:]])

    def close(self) -> None:
        if self._owned:
            self.cache.close()


def kv_spec_of(model: Any) -> KVSpec:
    """The geometry of one row of `model`'s KV cache (every layer, its dtype)."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVSpec(layers=int(config.num_hidden_layers), kv_heads=int(heads), head_dim=int(head_dim),
                  dtype=dtype_name(model.dtype))


def fill(cache: DynamicCache, rows: Sequence[Sequence[torch.Tensor]], device: torch.device | str) -> int:
    """Fill the empty `cache` with the chunks read for each of its rows (as many for each, in order) and return how
    many positions that is."""
    kv = torch.cat([torch.cat(list(blocks), dim=4) for blocks in rows], dim=2).to(device)
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0], kv[layer, 1], layer)
    return int(kv.shape[4])


def _block_of(layers: list[tuple[torch.Tensor, torch.Tensor]], row: int, tokens: tuple[int, int]) -> Any:
    """A function that builds row `row`'s positions `tokens` of every layer as one block (on the writer thread)."""
    def build() -> torch.Tensor:
        first, stop = tokens
        return torch.stack([torch.stack((keys[row:row + 1, :, first:stop], values[row:row + 1, :, first:stop]))
                            for keys, values in layers])
    return build
