"""A stream's manifest: everything a fresh process needs to resume it, stored beside its blocks.

It records the model's KV geometry (to refuse a different model), the prompt and its mask, the generation
settings, the tokens generated so far, and which blocks are durable. While a stream generates, the
manifest is written once and then extended by its *progress log*: with each block the store accepts, the
streamer writes one small progress record (`ProgressKey`: the block's name, the positions now durable,
the tokens and generator state since the previous record) in the same request as the block. So what a
step writes does not grow with the generation, and nothing ever claims a position whose KV is not
durable. `load_manifest` reads the manifest and folds its log in; a writer that rewrites the manifest
whole (a resume, a finished stream) starts a new log (`Manifest.log`), and records of older logs are
ignored, so a crash between the rewrite and their removal cannot apply them twice.

A manifest belongs to one *run*: one `generate` call, named by a run id that is also written into the name
of every block the run streams (`BlockKey.run`). A manifest names only blocks of its own stream and run,
and `Manifest.from_bytes` checks that together with the rest of the schema (`check_manifest`), so a resume
never mixes the blocks of two generations.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Sequence
from typing import Any, TypeGuard

import attrs

from .blocks import DTYPE_CODES, BlockKey, ProgressKey, check_run, shown
from .errors import ConfigError, CorruptBlock
from .store import Store

#: Format 4 added `replicate_within_ms` and `prompt_streaming`; a format 3 manifest reads as one whose
#: blocks leave only when full, prompt layer by layer (what format 3's writers did). Format 3 added the
#: progress log (`log`, and progress records beside the blocks); format 2 added `run` (and run ids in block
#: names). Older manifests are refused: a format 2 stream's progress is in its manifest alone, and a format
#: 1 stream's blocks carry no run, so nothing tells them from another generation's under the same stream id.
FORMAT = 4
#: Fields a format 3 manifest lacks, with the values that describe how format 3's writers streamed.
FORMAT_3_DEFAULTS: dict[str, Any] = {"replicate_within_ms": None, "prompt_streaming": "layerwise"}
#: The fields of a progress record, with the type each must have.
PROGRESS_FIELDS: dict[str, type] = {"block": str, "durable_positions": int, "tokens": list, "rng": str}
#: What a sampled stream records to resume exactly: the seed, the sampling settings in effect, the library
#: versions whose sampling it reproduces, and the device type whose generator drew the samples.
SAMPLING_FIELDS: dict[str, type] = {"seed": int, "settings": dict, "versions": dict, "device": str}
#: The geometry the engine records, by field, with the type each must have.
GEOMETRY_FIELDS: dict[str, type] = {"architecture": str, "layers": int, "kv_heads": int, "head_dim": int,
                                    "dtype": str, "batch": int}


@attrs.frozen
class Manifest:
    stream_id: str
    run: str  # the run id of the generate call that wrote this manifest and every block it names
    geometry: dict[str, Any]  # layers, kv_heads, head_dim, dtype, batch, architecture
    input_ids: list[list[int]]
    attention_mask: list[list[int]]
    max_new_tokens: int
    eos_token_id: list[int]
    pad_token_id: int | None
    replicate_every: int
    # per row, the tokens after the prompt (one empty row per prompt row before the first token)
    generated: list[list[int]] = attrs.field(
        default=attrs.Factory(lambda self: [[] for _ in self.input_ids], takes_self=True))
    blocks: list[str] = attrs.field(factory=list)  # durable blocks, in the order they became durable
    durable_positions: int = 0  # positions [0, n) of every layer are durable
    finished: bool = False
    sampling: dict[str, Any] | None = None  # None: greedy; else seed, settings, versions, device
    rng: str = ""  # sampled streams: the generator's state right after the last token in `generated` (base64)
    log: int = 0  # the progress log that extends this manifest (`progress_key`)
    # How far the durable replica may lag: a block leaves with at most `replicate_every` decode steps, and
    # (when not None) at the end of the first step ending `replicate_within_ms` after its first was buffered.
    replicate_within_ms: float | None = None
    prompt_streaming: str = "layerwise"  # "layerwise" or "after": how the prompt's blocks left

    @property
    def prompt_length(self) -> int:
        return len(self.input_ids[0])

    @property
    def block_keys(self) -> list[BlockKey]:
        return [BlockKey.parse(name) for name in self.blocks]

    def to_bytes(self) -> bytes:
        return json.dumps({"format": FORMAT, **attrs.asdict(self)}, separators=(",", ":")).encode()

    def progress_key(self, step: int) -> ProgressKey:
        """The name of record `step` of this manifest's progress log."""
        return ProgressKey(self.stream_id, self.run, self.log, step)

    def with_progress(self, records: Sequence[bytes]) -> Manifest:
        """This manifest extended by its progress log's records (steps 0, 1, ... in order), checked whole.

        Each record appends its tokens to every row and its block to `blocks`, and moves `durable_positions`
        (never back) and, when it carries one, the generator state. CorruptBlock for a damaged record or a
        result that breaks the manifest's schema.
        """
        fields = attrs.asdict(self)
        generated, blocks = fields["generated"], fields["blocks"]
        schema = _Schema(self.stream_id)
        for step, data in enumerate(records):
            record = schema.progress(data, str(self.progress_key(step)), rows=len(generated))
            for row, tokens in zip(generated, record["tokens"], strict=True):
                row.extend(tokens)
            blocks.append(record["block"])
            if record["durable_positions"] < fields["durable_positions"]:
                raise schema.fail(f"durable_positions of {self.progress_key(step)}",
                                  f"goes back from {fields['durable_positions']} to {record['durable_positions']}")
            fields["durable_positions"] = record["durable_positions"]
            has_tokens = bool(record["tokens"][0])  # rows are equally long (checked)
            if bool(record["rng"]) != (self.sampling is not None and has_tokens):
                raise schema.fail(f"rng of {self.progress_key(step)}", "must be given exactly when the record holds "
                                  "tokens of a sampled stream (the generator's state after them)")
            fields["rng"] = record["rng"] or fields["rng"]
        return Manifest(**check_manifest({"format": FORMAT, **fields}, self.stream_id))

    @classmethod
    def from_bytes(cls, data: bytes, stream_id: str) -> Manifest:
        """The manifest `data` holds, checked against the whole schema (`check_manifest`)."""
        try:
            fields = json.loads(data)
        except (ValueError, RecursionError) as error:
            raise CorruptBlock(f"the manifest of stream {stream_id} cannot be read: {error}") from None
        return cls(**check_manifest(fields, stream_id))

    def check_geometry(self, geometry: dict[str, Any]) -> None:
        """ConfigError naming every difference between this stream's model and `geometry`."""
        differences = [f"{name}: stream has {self.geometry.get(name)!r}, model has {value!r}"
                       for name, value in geometry.items() if self.geometry.get(name) != value]
        if differences:
            raise ConfigError(f"stream {self.stream_id} was produced by another model ({'; '.join(differences)}); "
                              "resume it with the model that started it")


FIELDS = frozenset(field.name for field in attrs.fields(Manifest))


def check_manifest(fields: object, stream_id: str) -> dict[str, Any]:
    """The fields of a decoded manifest of `stream_id` (its JSON, `format` included) as `Manifest` takes them.

    Checks every field's type and shape, and how fields agree with each other. ConfigError for a format
    this SDK does not read; CorruptBlock, naming the field and what is wrong, for anything else.
    """
    schema = _Schema(stream_id)
    if not isinstance(fields, dict):
        raise schema.fail("", f"is a JSON {_json_type(fields)}, not an object")
    if "format" not in fields:
        raise schema.fail("format", "is missing")
    version = fields["format"]
    if not _is_int(version):
        raise schema.fail("format", f"must be an integer, got {shown(version)}")
    if version not in (3, FORMAT):
        raise ConfigError(f"stream {stream_id} was written by manifest format {version}; this SDK reads formats "
                          f"3 and {FORMAT}. Finish it with the SDK that started it, or delete it with "
                          f"engine.forget({stream_id!r}) (or generate(..., replace=True))")
    given = {name: value for name, value in fields.items() if name != "format"}
    if version == 3:
        if extra := sorted(given.keys() & FORMAT_3_DEFAULTS.keys()):
            raise schema.fail(extra[0], "is not a field of manifest format 3")
        given.update(FORMAT_3_DEFAULTS)
    missing, extra = sorted(FIELDS - given.keys()), sorted(given.keys() - FIELDS)
    if missing:
        raise schema.fail(missing[0], f"is missing (missing: {', '.join(missing)})")
    if extra:
        raise schema.fail(extra[0], f"is not a field of manifest format {FORMAT} (unknown: {', '.join(extra)})")

    if given["stream_id"] != stream_id:
        raise schema.fail("stream_id", f"is {shown(given['stream_id'])}: the manifest belongs to another stream")
    run = given["run"]
    if not isinstance(run, str) or not run:
        raise schema.fail("run", f"must be a run id of 1-32 lowercase hex digits, got {shown(run)}")
    try:
        check_run(run)
    except ConfigError:
        raise schema.fail("run", f"must be a run id of 1-32 lowercase hex digits, got {shown(run)}") from None

    rows, prompt = schema.rows("input_ids", given["input_ids"])
    schema.rows("attention_mask", given["attention_mask"], shape=(rows, prompt), values=(0, 1))
    schema.geometry(given["geometry"], rows)
    max_new_tokens = schema.integer("max_new_tokens", given["max_new_tokens"], minimum=1)
    schema.integer("replicate_every", given["replicate_every"], minimum=1)
    within = given["replicate_within_ms"]
    if within is not None and (isinstance(within, bool) or not isinstance(within, (int, float))
                               or not 0 < within < math.inf):
        raise schema.fail("replicate_within_ms", f"must be a positive, finite number of milliseconds or null, got "
                          f"{shown(within)}")
    if given["prompt_streaming"] not in ("layerwise", "after"):
        raise schema.fail("prompt_streaming", f"must be \"layerwise\" or \"after\", got "
                          f"{shown(given['prompt_streaming'])}")
    eos = given["eos_token_id"]
    if not isinstance(eos, list):
        raise schema.fail("eos_token_id", f"must be a list of token ids, got {shown(eos)}")
    for index, token in enumerate(eos):
        schema.integer(f"eos_token_id[{index}]", token)
    if given["pad_token_id"] is not None:
        schema.integer("pad_token_id", given["pad_token_id"])
    _, generated = schema.rows("generated", given["generated"], shape=(rows, None), empty_rows=True)
    if generated > max_new_tokens:
        raise schema.fail("generated", f"holds {generated} tokens per row, more than max_new_tokens={max_new_tokens}")
    length = prompt + generated
    durable = schema.integer("durable_positions", given["durable_positions"])
    if durable > length:
        raise schema.fail("durable_positions", f"is {durable}, past the {length} positions of prompt and tokens")
    schema.blocks(given["blocks"], run, given["geometry"]["layers"], length)
    if not isinstance(given["finished"], bool):
        raise schema.fail("finished", f"must be true or false, got {shown(given['finished'])}")
    schema.sampling(given["sampling"], given["rng"])
    schema.integer("log", given["log"])
    return given


class _Schema:
    """The checks of `check_manifest`; each failure is a CorruptBlock naming the field."""

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id

    def fail(self, field: str, problem: str) -> CorruptBlock:
        what = f"field {field!r} " if field else ""
        return CorruptBlock(f"the manifest of stream {self.stream_id} is invalid: {what}{problem}; it must not be "
                            f"used (delete the stream with engine.forget({self.stream_id!r}))")

    def integer(self, field: str, value: object, minimum: int = 0) -> int:
        if not _is_int(value):
            raise self.fail(field, f"must be an integer, got {shown(value)}")
        if value < minimum:
            raise self.fail(field, f"must be at least {minimum}, got {value}")
        return value

    def rows(self, field: str, value: object, shape: tuple[int, int | None] | None = None,
             values: tuple[int, int] | None = None, empty_rows: bool = False) -> tuple[int, int]:
        """(rows, width) of a list of equally long lists of ints >= 0 (within `values` when given)."""
        if not isinstance(value, list) or not all(isinstance(row, list) for row in value):
            raise self.fail(field, f"must be a list of rows (lists of integers), got {shown(value)}")
        if not value:
            raise self.fail(field, "has no rows")
        width = len(value[0])
        low, high = values if values is not None else (0, None)
        for index, row in enumerate(value):
            if len(row) != width:
                raise self.fail(field, f"is ragged: row {index} has {len(row)} entries, row 0 has {width}")
            if all(type(item) is int for item in row) and (not row or (min(row) >= low and  # the usual case, fast
                                                                       (high is None or max(row) <= high))):
                continue
            for column, item in enumerate(row):  # find the entry that is wrong, and say what is wrong with it
                self.integer(f"{field}[{index}][{column}]", item, minimum=low)
                if high is not None and item > high:
                    raise self.fail(f"{field}[{index}][{column}]", f"must be {low} or {high}, got {item}")
        if width == 0 and not empty_rows:
            raise self.fail(field, "has empty rows")
        if shape is not None:
            expected_rows, expected_width = shape
            if len(value) != expected_rows:
                raise self.fail(field, f"has {len(value)} rows, input_ids has {expected_rows}")
            if expected_width is not None and width != expected_width:
                raise self.fail(field, f"has rows of {width} entries, input_ids has {expected_width}")
        return len(value), width

    def progress(self, data: bytes, name: str, rows: int) -> dict[str, Any]:
        """The fields of progress record `name`, checked on their own (`check_manifest` checks the sum)."""
        try:
            record = json.loads(data)
        except (ValueError, RecursionError) as error:
            raise self.fail(name, f"cannot be read: {error}") from None
        if not isinstance(record, dict) or record.keys() != PROGRESS_FIELDS.keys():
            raise self.fail(name, f"must hold exactly {', '.join(PROGRESS_FIELDS)}; got {shown(record)}")
        for field, kind in PROGRESS_FIELDS.items():
            if not isinstance(record[field], kind) or isinstance(record[field], bool):
                raise self.fail(f"{field} of {name}", f"must be a {kind.__name__}, got {shown(record[field])}")
        self.rows(f"tokens of {name}", record["tokens"], shape=(rows, None), empty_rows=True)
        return record

    def geometry(self, value: object, rows: int) -> None:
        if not isinstance(value, dict):
            raise self.fail("geometry", f"must be an object, got {shown(value)}")
        missing, extra = sorted(GEOMETRY_FIELDS.keys() - value.keys()), sorted(value.keys() - GEOMETRY_FIELDS.keys())
        if missing or extra:
            raise self.fail("geometry", f"must hold exactly {', '.join(GEOMETRY_FIELDS)}; "
                                        f"missing {missing or 'none'}, unknown {extra or 'none'}")
        for name, kind in GEOMETRY_FIELDS.items():
            if kind is int:
                self.integer(f"geometry.{name}", value[name], minimum=1)
            elif not isinstance(value[name], str) or not value[name]:
                raise self.fail(f"geometry.{name}", f"must be a non-empty string, got {shown(value[name])}")
        if value["dtype"] not in DTYPE_CODES:
            raise self.fail("geometry.dtype", f"{value['dtype']!r} is not a dtype blocks hold")
        if value["batch"] != rows:
            raise self.fail("geometry.batch", f"is {value['batch']}, but input_ids has {rows} rows")

    def sampling(self, value: object, rng: object) -> None:
        """`sampling` is null for greedy streams, with no generator state; else its fields, and a state."""
        if not isinstance(rng, str):
            raise self.fail("rng", f"must be a string, got {shown(rng)}")
        if value is None:
            if rng:
                raise self.fail("rng", "is set, but the stream is greedy (sampling is null)")
            return
        if not isinstance(value, dict) or value.keys() != SAMPLING_FIELDS.keys():
            raise self.fail("sampling", f"must be null or hold exactly {', '.join(SAMPLING_FIELDS)}; got "
                                        f"{shown(value)}")
        for name, kind in SAMPLING_FIELDS.items():
            if not isinstance(value[name], kind) or isinstance(value[name], bool):
                raise self.fail(f"sampling.{name}", f"must be a {kind.__name__}, got {shown(value[name])}")
        for name, setting in value["settings"].items():
            if not isinstance(setting, (int, float, str)) and setting is not None:
                raise self.fail(f"sampling.settings.{name}", f"must be a number, a string or null, got "
                                                             f"{shown(setting)}")
        if not all(isinstance(version, str) for version in value["versions"].values()):
            raise self.fail("sampling.versions", f"must map names to version strings, got {shown(value['versions'])}")
        try:
            base64.b64decode(rng, validate=True)
        except ValueError:
            raise self.fail("rng", "is not base64") from None
        if not rng:
            raise self.fail("rng", "is empty, but the stream samples: its generator state is needed to resume")

    def blocks(self, value: object, run: str, layers: int, length: int) -> None:
        if not isinstance(value, list):
            raise self.fail("blocks", f"must be a list of block names, got {shown(value)}")
        for index, name in enumerate(value):
            field = f"blocks[{index}]"
            if not isinstance(name, str):
                raise self.fail(field, f"must be a block name, got {shown(name)}")
            try:
                key = BlockKey.parse(name)
            except ConfigError as error:
                raise self.fail(field, f"is not a block name: {error}") from None
            if key.stream_id != self.stream_id:
                raise self.fail(field, f"names {name!r}, a block of stream {key.stream_id}, not of this stream")
            if key.run != run:
                raise self.fail(field, f"names {name!r}, a block of run {key.run or '(none)'}, not of this "
                                       f"manifest's run {run}: blocks of two generations must never be mixed")
            if key.layers[1] > layers or key.tokens[1] > length:
                raise self.fail(field, f"names {name!r}, outside the stream's {layers} layers x {length} positions")


def load_manifest(store: Store, stream_id: str) -> Manifest:
    """The stream's manifest with its progress log folded in: where the generation stands.

    BlockNotFound if the stream has no manifest; otherwise as `with_stored_progress`.
    """
    return with_stored_progress(store, Manifest.from_bytes(store.read_manifest(stream_id), stream_id))


def with_stored_progress(store: Store, manifest: Manifest) -> Manifest:
    """`manifest` (as stored in `store`) extended by the records of its progress log stored there.

    CorruptBlock if a record is damaged or missing (the log is written in order, so a gap is damage, not a
    crash), or if the result breaks the manifest's schema.
    """
    steps = sorted(key.step for key in store.progress_keys(manifest.stream_id)
                   if (key.run, key.log) == (manifest.run, manifest.log))
    missing = next((step for step, found in enumerate(steps) if step != found), None)
    if missing is not None:
        raise _Schema(manifest.stream_id).fail(str(manifest.progress_key(missing)), "is missing, but later records "
                                               "of its progress log are stored")
    return manifest.with_progress([store.read_progress(manifest.progress_key(step)) for step in steps])


def encode_progress(block: str, durable_positions: int, tokens: list[list[int]], rng: str) -> bytes:
    """A progress record (JSON): `block` is durable, and so are positions [0, durable_positions) of every layer;
    `tokens` (per row) follow the previous record's, and `rng` is the generator state after them ("" for
    none: greedy, or no new token). Unchecked: it runs every decode step, and `with_progress` checks it.

    Written with the interpreter's own formatting, not the json module: `block` is a block name and `rng`
    base64, neither of which JSON escapes, and a list of ints prints as JSON. The streamer thread writes one
    per step, waking into caches where only code the model's thread also runs is warm.
    """
    return f'{{"block":"{block}","durable_positions":{durable_positions:d},"tokens":{tokens!r},"rng":"{rng}"}}'.encode()


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: object) -> str:
    names = {list: "list", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
    return names.get(type(value), type(value).__name__)
