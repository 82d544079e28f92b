"""The KV-block data model: block keys, the geometry of a model's cache, and the dtypes blocks may hold.

One *stream* is the KV cache of one request or microbatch on one worker. Its full cache has the shape
`[L, 2, B, H_kv, S, D]`; a *block* is any rectangle of it (layers `[a, b)` x positions `[t0, t1)`),
named by a `BlockKey`. Stores, transports and the cache manager all speak in these terms.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from typing import Any, cast

import attrs
import torch

from .errors import ConfigError

#: Every dtype a block may hold, by the stable name written into block headers. Codes never change.
DTYPE_CODES: dict[str, int] = {
    "float32": 1, "float16": 2, "bfloat16": 3, "float64": 4,
    "int8": 5, "uint8": 6, "int16": 7, "int32": 8, "int64": 9, "bool": 10,
    "float8_e4m3fn": 11, "float8_e5m2": 12, "uint16": 13, "uint32": 14, "uint64": 15,
}
DTYPE_NAMES: dict[int, str] = {code: name for name, code in DTYPE_CODES.items()}

_STREAM_ID = re.compile(r"[A-Za-z0-9_.:@+=,~-]{1,200}")
_RUN_ID = re.compile(r"[0-9a-f]{1,32}")  # a run id: uuid4().hex[:16] in the engine
#: Layer and position numbers in a key stay below 10**12, so their text is at most 12 ASCII digits. That is
#: far beyond any model (10**12 positions of KV would be petabytes per layer), and it keeps parsing cheap
#: and total: a record name read from a store or a peer can never make `int()` hit Python's digit limit.
MAX_INDEX_DIGITS = 12
INDEX_LIMIT = 10**MAX_INDEX_DIGITS
_NUMBER = rf"[0-9]{{1,{MAX_INDEX_DIGITS}}}"  # ASCII only: `\d` would also match other scripts' digits
_KEY_TEXT = re.compile(
    rf"(?P<stream>[^/]+)/(?:r(?P<run>[0-9a-f]{{1,32}})\.)?L(?P<a>{_NUMBER})-(?P<b>{_NUMBER})\.T(?P<t0>{_NUMBER})-(?P<t1>{_NUMBER})"
)
_CANONICAL = ("the canonical spelling is 'stream/La-b.Tt0-t1' or 'stream/r<run>.La-b.Tt0-t1', exactly as str(key) "
              f"writes it: ASCII digits without leading zeros, numbers below 10**{MAX_INDEX_DIGITS}, "
              "a run of 1-32 lowercase hex digits")


def dtype_name(dtype: torch.dtype | str) -> str:
    """The header name of `dtype` (a torch dtype or its name); ConfigError if blocks cannot hold it."""
    try:
        name = str(dtype).removeprefix("torch.")
    except Exception as error:  # an int past Python's digit limit, or an object whose __str__ fails
        raise ConfigError(f"dtype {shown(dtype)} is not a dtype; supported: {', '.join(DTYPE_CODES)}") from error
    if name not in DTYPE_CODES:
        raise ConfigError(f"dtype {name!r} cannot be stored in a block; supported: {', '.join(DTYPE_CODES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a header name."""
    return getattr(torch, dtype_name(name))


def check_stream_id(stream_id: object) -> str:
    """Return `stream_id` if it is safe in every store's names (file paths, S3 keys, LMDB keys).

    A str subclass comes back as a plain str, so its own `__format__` or `__eq__` never reaches a key's name.
    """
    text = str.__str__(stream_id) if isinstance(stream_id, str) else ""
    if not _STREAM_ID.fullmatch(text) or text in (".", ".."):
        raise ConfigError(
            f"invalid stream_id {shown(stream_id)}: use 1-200 characters from letters, digits and _.:@+=,~- "
            "(no '/', spaces or other separators; not '.' or '..')"
        )
    return text


def check_run(run: object) -> str:
    """Return `run` as a plain str if it is a valid run id ("" for none, else 1-32 lowercase hex digits)."""
    text = str.__str__(run) if isinstance(run, str) else None
    if text is None or (text and not _RUN_ID.fullmatch(text)):
        raise ConfigError(f"invalid run {shown(run)}: use '' (no run) or 1-32 lowercase hex digits, "
                          "e.g. uuid4().hex[:16]")
    return text


def check_key(key: object) -> BlockKey:
    """Return `key` if it is a BlockKey; ConfigError otherwise."""
    if not isinstance(key, BlockKey):
        raise ConfigError(f"expected a dejavu_sdk.BlockKey, got {type(key).__name__} {shown(key)}")
    return key


def shown(text: object, limit: int = 120) -> str:
    """`text` for an error message, cut short: names come from stores and peers and may be huge.

    Never raises, so a bad argument always gets its ConfigError: `repr` fails for an int past Python's
    digit limit (10**5000) and for objects whose `__repr__` does.
    """
    try:
        shown = repr(text)
    except Exception:
        return f"an unprintable {type(text).__name__}"
    return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(shown)} characters)"


def _is_int(value: object) -> bool:
    """Whether `value` is a Python int (not a bool, whose True would quietly mean 1; not a numpy scalar)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _range(value: object, what: str) -> tuple[int, int]:
    """`value` as a `(start, stop)` pair of plain ints with `0 <= start < stop < INDEX_LIMIT`; ConfigError otherwise."""
    try:  # three items at most: an endless or huge iterable costs nothing
        pair = tuple(itertools.islice(cast("Iterable[object]", value), 3))
    except Exception as error:  # not iterable, or its __iter__ / __next__ failed
        raise ConfigError(f"{what} must be a (start, stop) pair, got {shown(value)}") from error
    if len(pair) != 2:
        raise ConfigError(f"{what} must be a (start, stop) pair, got {shown(value)}")
    if not (_is_int(pair[0]) and _is_int(pair[1])):
        raise ConfigError(f"{what} must hold integers, got {shown(value)}")
    start, stop = (int.__index__(cast("int", number)) for number in pair)  # plain ints, whatever the subclass
    if not 0 <= start < stop:
        raise ConfigError(f"{what} range {shown(value)} is empty or inverted: need 0 <= start < stop")
    if stop >= INDEX_LIMIT:
        raise ConfigError(f"{what} range {shown(value)} reaches past 10**{MAX_INDEX_DIGITS}, "
                          "the largest index a key names")
    return (start, stop)


@attrs.frozen(order=True)
class BlockKey:
    """Names one block: layers `[a, b)` x token positions `[t0, t1)` of stream `stream_id`.

    `run` ("" by default) names the one generation of the stream that wrote the block: the engine gives each
    `generate` its own run id, so two runs of one stream id never share a block name.
    `str(key)` is a stable name (`"req-1/L0-1.T0-512"`, or `"req-1/r3f9a.L0-1.T0-512"` with a run) that
    `BlockKey.parse` turns back into the key; it is also the label every stored record is verified against.
    """

    stream_id: str = attrs.field(converter=check_stream_id)
    layers: tuple[int, int] = attrs.field(converter=lambda v: _range(v, "layers"))
    tokens: tuple[int, int] = attrs.field(converter=lambda v: _range(v, "tokens"))
    run: str = attrs.field(default="", kw_only=True, converter=check_run)

    @classmethod
    def for_layer(cls, stream_id: str, layer: int, first: int, count: int, run: str = "") -> BlockKey:
        """The block prefill streams once `layer` has processed `count` positions from `first` on."""
        layer, first, count = _index(layer, "layer"), _index(first, "first"), _index(count, "count")
        return cls(stream_id, layers=(layer, layer + 1), tokens=(first, first + count), run=run)

    @classmethod
    def for_decode_steps(cls, stream_id: str, layers: tuple[int, int], first: int, count: int = 1,
                         run: str = "") -> BlockKey:
        """The block decode streams for `count` steps starting at position `first`, over `layers`."""
        first, count = _index(first, "first"), _index(count, "count")
        return cls(stream_id, layers=layers, tokens=(first, first + count), run=run)

    @classmethod
    def parse(cls, text: str) -> BlockKey:
        """The key whose `str()` is exactly `text`; ConfigError for anything else, other spellings included.

        Only the canonical spelling parses, so one block has one name in every store (no `L01`, no
        non-ASCII digits), and no name, however long, costs more than a bounded `int()`.
        """
        text = str.__str__(text) if isinstance(text, str) else text  # a subclass's own __ne__ never decides
        match = _KEY_TEXT.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ConfigError(f"{shown(text)} is not a block key: {_CANONICAL}")
        key = cls(
            match["stream"],
            layers=(int(match["a"]), int(match["b"])),
            tokens=(int(match["t0"]), int(match["t1"])),
            run=match["run"] or "",
        )
        if str(key) != text:
            raise ConfigError(f"{shown(text)} is not the canonical name of block {key}: {_CANONICAL}")
        return key

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def num_tokens(self) -> int:
        return self.tokens[1] - self.tokens[0]

    def __str__(self) -> str:
        (a, b), (t0, t1) = self.layers, self.tokens
        run = f"r{self.run}." if self.run else ""
        return f"{self.stream_id}/{run}L{a}-{b}.T{t0}-{t1}"


_PROGRESS_TEXT = re.compile(
    rf"(?P<stream>[^/]+)/r(?P<run>[0-9a-f]{{1,32}})\.progress(?P<log>{_NUMBER})\.step(?P<step>{_NUMBER})"
)


@attrs.frozen(order=True)
class ProgressKey:
    """Names one progress record: step `step` of progress log `log` of run `run` of stream `stream_id`.

    A generating stream writes one small record per durable block (the tokens and generator state since
    the previous one) instead of rewriting its whole manifest; the manifest names the log that extends it.
    `str(key)` (`"req-1/r3f9a.progress0.step42"`) lives beside the stream's blocks and never parses as a
    `BlockKey`; `ProgressKey.parse` turns it back into the key, and only that canonical spelling parses.
    """

    stream_id: str = attrs.field(converter=check_stream_id)
    run: str = attrs.field(converter=check_run)
    log: int = attrs.field(converter=lambda value: _index(value, "log"))
    step: int = attrs.field(converter=lambda value: _index(value, "step"))

    def __attrs_post_init__(self) -> None:
        if not self.run:
            raise ConfigError("a progress record belongs to a run: pass a run id of 1-32 lowercase hex digits")

    @classmethod
    def parse(cls, text: str) -> ProgressKey:
        """The key whose `str()` is exactly `text`; ConfigError for anything else."""
        text = str.__str__(text) if isinstance(text, str) else text
        match = _PROGRESS_TEXT.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ConfigError(f"{shown(text)} is not a progress record name: the canonical spelling is "
                              "'stream/r<run>.progress<log>.step<step>', as str(ProgressKey) writes it")
        key = cls(match["stream"], match["run"], int(match["log"]), int(match["step"]))
        if str(key) != text:
            raise ConfigError(f"{shown(text)} is not the canonical name of progress record {key}")
        return key

    def next_step(self) -> ProgressKey:
        """The key of the record that follows this one in its log.

        Made without running the field checks again (two regular expressions): only `step` changes, and
        a generating stream takes one such key per decode step on its streamer thread.
        """
        if self.step + 1 >= INDEX_LIMIT:
            raise ConfigError(f"progress log {self.log} of stream {self.stream_id} is full at step {self.step}")
        following = object.__new__(ProgressKey)
        for field, value in (("stream_id", self.stream_id), ("run", self.run), ("log", self.log),
                             ("step", self.step + 1)):
            object.__setattr__(following, field, value)
        return following

    def __str__(self) -> str:
        return f"{self.stream_id}/r{self.run}.progress{self.log}.step{self.step}"


def _index(value: object, what: str) -> int:
    """`value` as a plain int from 0 to `INDEX_LIMIT - 1`, the numbers a key's name can hold; ConfigError otherwise."""
    number = int.__index__(cast("int", value)) if _is_int(value) else -1
    if not 0 <= number < INDEX_LIMIT:
        raise ConfigError(f"{what} must be an integer from 0 to 10**{MAX_INDEX_DIGITS} - 1, got {shown(value)}")
    return number


def _positive(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not _is_int(value) or cast("int", value) < 1:
        raise ConfigError(f"KVSpec.{attribute.name} must be a positive integer, got {shown(value)}")


@attrs.frozen
class KVSpec:
    """The geometry of one stream's KV cache: `[layers, 2, batch, kv_heads, positions, head_dim]`."""

    layers: int = attrs.field(validator=_positive)
    kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    dtype: str = attrs.field(default="float16", converter=dtype_name)
    batch: int = attrs.field(default=1, validator=_positive)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    def shape(self, layers: int, tokens: int) -> tuple[int, int, int, int, int, int]:
        """The shape of `layers` layers x `tokens` positions of this cache: `[layers, 2, B, H_kv, tokens, D]`."""
        return (layers, 2, self.batch, self.kv_heads, tokens, self.head_dim)

    def block_shape(self, key: BlockKey) -> tuple[int, ...]:
        """The shape of the block `key` names; ConfigError if its layers lie outside the model."""
        if key.layers[1] > self.layers:
            raise ConfigError(f"{key} reaches layer {key.layers[1]} but the model has {self.layers} layers")
        return self.shape(key.num_layers, key.num_tokens)




#: Blocks, each with the progress record that names it (key, block, progress key, record bytes), to be
#: written in one request: `Store.flush_group_with_progress`.
ProgressGroup = Sequence[tuple[BlockKey, Any, ProgressKey, bytes]]
