"""A stream's manifest: everything a fresh process needs to resume it, stored beside its blocks.

It records the model's KV geometry (to refuse a different model), the prompt and its mask, the generation
settings, the tokens generated so far, and which blocks are durable. The streamer rewrites it after each
block the store has accepted, so it never claims a position whose KV is not durable.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs

from .blocks import BlockKey
from .errors import ConfigError, CorruptBlock

FORMAT = 1
_PROGRESS = frozenset({"generated", "blocks", "durable_positions", "finished"})


@attrs.frozen
class Manifest:
    stream_id: str
    geometry: dict[str, Any]  # layers, kv_heads, head_dim, dtype, batch, architecture
    input_ids: list[list[int]]
    attention_mask: list[list[int]]
    max_new_tokens: int
    eos_token_id: list[int]
    pad_token_id: int | None
    replicate_every: int
    generated: list[list[int]] = attrs.field(factory=list)  # per row, the tokens after the prompt
    blocks: list[str] = attrs.field(factory=list)  # durable blocks, in the order they became durable
    durable_positions: int = 0  # positions [0, n) of every layer are durable
    finished: bool = False

    @property
    def prompt_length(self) -> int:
        return len(self.input_ids[0])

    @property
    def block_keys(self) -> list[BlockKey]:
        return [BlockKey.parse(name) for name in self.blocks]

    def to_bytes(self) -> bytes:
        return json.dumps({"format": FORMAT, **attrs.asdict(self)}, separators=(",", ":")).encode()

    def progress_writer(self) -> Callable[[list[list[int]], list[str], int], bytes]:
        """A fast serializer for this manifest as generation progresses: the fixed fields are encoded once,
        and each call encodes only the tokens, the durable blocks and the durable positions."""
        fixed = {"format": FORMAT, **attrs.asdict(self, filter=lambda field, _: field.name not in _PROGRESS)}
        prefix = json.dumps(fixed, separators=(",", ":"))[:-1]

        def encode(generated: list[list[int]], blocks: list[str], durable_positions: int) -> bytes:
            progress = json.dumps({"generated": generated, "blocks": blocks, "durable_positions": durable_positions,
                                   "finished": False}, separators=(",", ":"))
            return f"{prefix},{progress[1:]}".encode()

        return encode

    @classmethod
    def from_bytes(cls, data: bytes, stream_id: str) -> Manifest:
        try:
            fields = json.loads(data)
            version = fields.pop("format")
        except (ValueError, KeyError, AttributeError) as error:
            raise CorruptBlock(f"the manifest of stream {stream_id} cannot be read: {error}") from None
        if version != FORMAT:
            raise ConfigError(f"stream {stream_id} was written by manifest format {version}; this SDK reads {FORMAT}")
        return cls(**fields)

    def check_geometry(self, geometry: dict[str, Any]) -> None:
        """ConfigError naming every difference between this stream's model and `geometry`."""
        differences = [f"{name}: stream has {self.geometry.get(name)!r}, model has {value!r}"
                       for name, value in geometry.items() if self.geometry.get(name) != value]
        if differences:
            raise ConfigError(f"stream {self.stream_id} was produced by another model ({'; '.join(differences)}); "
                              "resume it with the model that started it")
