"""Prompt prefixes as content-keyed chunks: what a chunk of KV is called, wherever it is kept.

A prompt's KV is cut into chunks of `chunk` positions. Chunk i's name is a hash chain: the digest of chunk i-1's
digest and chunk i's token ids, starting from the model's identity (its architecture, a fingerprint of every weight,
the dtype, the chunk size) and a salt. So a name says, for one model, "the KV of exactly these tokens after exactly
those", and two prompts share chunk i only when they share every token up to its end; a different salt (a tenant's)
gives other names, so one tenant cannot find another's chunks. The name becomes a `BlockKey` of the stage's layers,
so that chunks live as ordinary checksummed records in any store (`memory://`, `lmdb://`, `file://`, `s3://`, a
`tcp://` store server) and each stage of a pipeline keeps its own layers' chunks under the same digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from ..blocks import BlockKey, dtype_name
from ..errors import ConfigError

#: Positions a chunk holds unless the caller chooses (vLLM's and LMCache's chunks are of this order).
CHUNK_POSITIONS = 256
#: What every chunk's stream id starts with: prefix chunks never share a name with a stream's replica blocks.
STREAM_PREFIX = "prefix-"


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest of every parameter and buffer of `model` (names, dtypes, shapes and bytes): two models share
    chunks only when their weights are the same to the last bit."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict(keep_vars=False).items()):
        digest.update(f"{name}:{dtype_name(tensor.dtype)}:{tuple(tensor.shape)};".encode())
        data = tensor.detach().to("cpu").contiguous()  # no copy for a CPU model's (contiguous) weights
        if data.numel():
            digest.update(data.view(torch.uint8).numpy())  # hashed in place: a copy of every weight would cost
    return digest.hexdigest()


def check_chunk(chunk: object) -> int:
    """`chunk`, the positions of a prefix chunk: a positive int."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"a prefix chunk holds a positive number of positions, got {chunk!r}")
    return chunk


def check_salt(salt: object) -> str:
    """`salt`, a str that keeps one tenant's chunks apart from another's."""
    if not isinstance(salt, str):
        raise ConfigError(f"a cache salt is a str, got {type(salt).__name__}")
    return salt


@attrs.frozen
class PrefixIdentity:
    """What a model's chunks are keyed by besides their tokens: `architecture`, `weights` (a fingerprint), `dtype`
    and `chunk` (positions a chunk holds)."""

    architecture: str
    weights: str
    dtype: str
    chunk: int = attrs.field(default=CHUNK_POSITIONS, converter=check_chunk)

    @classmethod
    def of(cls, model: Any, chunk: int = CHUNK_POSITIONS) -> PrefixIdentity:
        """The identity of a loaded Hugging Face model (its config's architectures, its weights, its dtype)."""
        architecture = ",".join(getattr(model.config, "architectures", None) or [type(model).__name__])
        return cls(architecture, weights_fingerprint(model), dtype_name(model.dtype), chunk)

    def digests(self, token_ids: Sequence[int], salt: str = "") -> list[str]:
        """One digest per whole chunk of `token_ids`, each over every token up to that chunk's end."""
        seed = f"{self.architecture}|{self.weights}|{self.dtype}|{self.chunk}|{check_salt(salt)}".encode()
        previous = hashlib.blake2b(seed, digest_size=20).digest()
        ids = np.asarray(list(token_ids), dtype=np.int64)
        digests = []
        for start in range(0, len(ids) - self.chunk + 1, self.chunk):
            previous = hashlib.blake2b(previous + ids[start:start + self.chunk].tobytes(), digest_size=20).digest()
            digests.append(previous.hex())
        return digests

    def keys(self, token_ids: Sequence[int], layers: tuple[int, int], salt: str = "") -> list[BlockKey]:
        """The key of each whole chunk of `token_ids`, for the stage that holds `layers`."""
        return self.keys_of(self.digests(token_ids, salt), layers)

    def keys_of(self, digests: Sequence[str], layers: tuple[int, int]) -> list[BlockKey]:
        """The keys of the leading chunks named `digests` (`digests` gave them), for the stage that holds
        `layers` (global; its own count from 0 in the key, as in its cache): a pipeline's first stage names a
        prompt's chunks, and every stage keys its own layers' by them."""
        return [BlockKey(f"{STREAM_PREFIX}{digest}-L{layers[0]}-{layers[1]}", layers=(0, layers[1] - layers[0]),
                         tokens=(index * self.chunk, (index + 1) * self.chunk))
                for index, digest in enumerate(digests)]
