"""The manifest schema: one check (`check_manifest`, used by `Manifest.from_bytes`) turns every structurally
invalid manifest into a typed error naming the field, never a raw TypeError or ValueError."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from typing import Any

import attrs
import pytest

import dejavu_sdk as dv
from dejavu_sdk.manifest import FORMAT, Manifest, encode_progress, load_manifest

RUN = "0123456789abcdef"
OTHER_RUN = "fedcba9876543210"


def _valid() -> Manifest:
    return Manifest(
        stream_id="req-1", run=RUN,
        geometry={"architecture": "LlamaForCausalLM", "layers": 2, "kv_heads": 1, "head_dim": 8,
                  "dtype": "float32", "batch": 2},
        input_ids=[[5, 6, 7], [0, 8, 9]], attention_mask=[[1, 1, 1], [0, 1, 1]], max_new_tokens=4,
        eos_token_id=[2], pad_token_id=2, replicate_every=1, generated=[[10, 11], [12, 2]],
        blocks=[f"req-1/r{RUN}.L0-1.T0-3", f"req-1/r{RUN}.L1-2.T0-3", f"req-1/r{RUN}.L0-2.T3-4"],
        durable_positions=4,
    )


def _edited(edit: Callable[[dict[str, Any]], None]) -> bytes:
    fields = json.loads(_valid().to_bytes())
    edit(fields)
    return json.dumps(fields).encode()


def _set(name: str, value: object) -> Callable[[dict[str, Any]], None]:
    def edit(fields: dict[str, Any]) -> None:
        target, _, leaf = name.rpartition(".")
        (fields[target] if target else fields)[leaf] = value
    return edit


def _delete(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(fields: dict[str, Any]) -> None:
        target, _, leaf = name.rpartition(".")
        del (fields[target] if target else fields)[leaf]
    return edit


def test_a_valid_manifest_round_trips() -> None:
    manifest = _valid()
    assert Manifest.from_bytes(manifest.to_bytes(), "req-1") == manifest


def _record(block: str = f"req-1/r{RUN}.L0-2.T4-5", durable: int = 5, tokens: object = ([3], [2]),
            rng: object = "") -> bytes:
    return json.dumps({"block": block, "durable_positions": durable, "tokens": list(tokens), "rng": rng}).encode()


def test_progress_records_extend_the_manifest_in_order() -> None:
    manifest = _valid()
    progressed = manifest.with_progress([_record(), _record(f"req-1/r{RUN}.L0-2.T5-6", 6, ([4], [2]))])
    assert progressed.generated == [[10, 11, 3, 4], [12, 2, 2, 2]]
    assert progressed.blocks == [*manifest.blocks, f"req-1/r{RUN}.L0-2.T4-5", f"req-1/r{RUN}.L0-2.T5-6"]
    assert progressed.durable_positions == 6
    assert manifest.with_progress([]) == manifest
    assert manifest.generated == [[10, 11], [12, 2]]  # unchanged: a new manifest comes back


BAD_RECORDS: list[tuple[Any, ...]] = [  # (test id, records, what the error says)
    ("not json", [b"{"], "cannot be read"),
    ("not an object", [b"[1]"], "must hold exactly"),
    ("missing field", [json.dumps({"block": "x", "tokens": [[1], [2]], "rng": ""}).encode()], "must hold exactly"),
    ("tokens of one row", [_record(tokens=([3],))], "tokens of"),
    ("ragged tokens", [_record(tokens=([3, 4], [2]))], "tokens of"),
    ("token not an int", [_record(tokens=(["3"], [2]))], "tokens of"),
    ("rng not a string", [_record(rng=None)], "rng of"),
    ("rng in a greedy stream", [_record(rng="AAAA")], "rng of"),
    ("durable goes back", [_record(durable=3)], "goes back"),
    ("block of another run", [_record(block=f"req-1/r{OTHER_RUN}.L0-2.T4-5")], "blocks[3]"),
    ("past max_new_tokens", [_record(), _record(durable=5, tokens=([1, 1], [1, 1]))], "max_new_tokens"),
]


@pytest.mark.parametrize(("records", "detail"), [case[1:] for case in BAD_RECORDS],
                         ids=[case[0] for case in BAD_RECORDS])
def test_a_damaged_progress_record_is_corrupt(records: list[bytes], detail: str) -> None:
    with pytest.raises(dv.CorruptBlock, match=re.escape(detail)):
        _valid().with_progress(records)


def test_a_sampled_streams_record_with_tokens_must_carry_the_generator_state() -> None:
    sampled = attrs.evolve(_valid(), sampling={"seed": 1, "settings": {}, "versions": {}, "device": "cpu"}, rng="AAAA")
    assert sampled.with_progress([_record(rng="BBBB")]).rng == "BBBB"
    assert sampled.with_progress([_record(tokens=([], []), durable=4)]).rng == "AAAA"  # no tokens, no new state
    with pytest.raises(dv.CorruptBlock, match="rng of"):  # tokens without the state after them
        sampled.with_progress([_record(rng="")])


def test_load_manifest_reads_its_own_log_only_and_refuses_a_gap() -> None:
    store = dv.open_store("memory://")
    manifest = _valid()
    store.write_manifest("req-1", manifest.to_bytes())
    store.put_progress(manifest.progress_key(0), _record())
    store.put_progress(attrs.evolve(manifest, log=1).progress_key(0), _record(durable=3))  # a newer log: ignored
    store.put_progress(attrs.evolve(manifest, run=OTHER_RUN).progress_key(1), b"{")  # another run: ignored
    assert load_manifest(store, "req-1").generated == [[10, 11, 3], [12, 2, 2]]
    store.put_progress(manifest.progress_key(2), _record(f"req-1/r{RUN}.L0-2.T6-7", 7))
    with pytest.raises(dv.CorruptBlock, match=re.escape(f"req-1/r{RUN}.progress0.step1") + ".* is missing"):
        load_manifest(store, "req-1")


def test_a_manifest_with_no_tokens_yet_is_valid() -> None:
    settings = {name: value for name, value in attrs.asdict(_valid()).items()
                if name not in ("generated", "blocks", "durable_positions")}
    fresh = Manifest(**settings)
    assert fresh.generated == [[], []]  # one empty row per prompt row
    assert Manifest.from_bytes(fresh.to_bytes(), "req-1") == fresh


BAD: list[tuple[Any, ...]] = [  # (test id, edit, the field the error names, what else it says)
    ("no format", _delete("format"), "format"),
    ("format as string", _set("format", "2"), "format"),
    ("missing run", _delete("run"), "run"),
    ("missing generated", _delete("generated"), "generated"),
    ("extra field", _set("priority", 3), "priority"),
    ("wrong stream id", _set("stream_id", "req-2"), "stream_id"),
    ("stream id not a string", _set("stream_id", 7), "stream_id"),
    ("empty run", _set("run", ""), "run"),
    ("run not hex", _set("run", "XYZ"), "run"),
    ("input_ids not rows", _set("input_ids", [1, 2, 3]), "input_ids"),
    ("input_ids no rows", _set("input_ids", []), "input_ids"),
    ("ragged input_ids", _set("input_ids", [[5, 6, 7], [8, 9]]), "input_ids"),
    ("str token", _set("input_ids", [[5, "6", 7], [0, 8, 9]]), "input_ids[0][1]"),
    ("float token", _set("input_ids", [[5, 6.0, 7], [0, 8, 9]]), "input_ids[0][1]"),
    ("bool token", _set("input_ids", [[5, True, 7], [0, 8, 9]]), "input_ids[0][1]"),
    ("negative token", _set("input_ids", [[5, -6, 7], [0, 8, 9]]), "input_ids[0][1]"),
    ("mask of another shape", _set("attention_mask", [[1, 1], [1, 1]]), "attention_mask"),
    ("mask with 2", _set("attention_mask", [[1, 2, 1], [0, 1, 1]]), "attention_mask[0][1]"),
    ("ragged generated", _set("generated", [[10, 11], [12]]), "generated"),
    ("generated rows", _set("generated", [[10, 11]]), "generated"),
    ("generated past max", _set("generated", [[1] * 5, [1] * 5]), "generated"),
    ("max_new_tokens str", _set("max_new_tokens", "4"), "max_new_tokens"),
    ("max_new_tokens bool", _set("max_new_tokens", True), "max_new_tokens"),
    ("max_new_tokens zero", _set("max_new_tokens", 0), "max_new_tokens"),
    ("replicate_every negative", _set("replicate_every", -1), "replicate_every"),
    ("replicate_within_ms zero", _set("replicate_within_ms", 0), "replicate_within_ms"),
    ("replicate_within_ms str", _set("replicate_within_ms", "5"), "replicate_within_ms"),
    ("replicate_within_ms bool", _set("replicate_within_ms", True), "replicate_within_ms"),
    ("replicate_within_ms infinite", _set("replicate_within_ms", float("inf")), "replicate_within_ms"),
    ("prompt_streaming auto", _set("prompt_streaming", "auto"), "prompt_streaming"),
    ("prompt_streaming null", _set("prompt_streaming", None), "prompt_streaming"),
    ("eos not a list", _set("eos_token_id", 2), "eos_token_id"),
    ("eos str", _set("eos_token_id", ["2"]), "eos_token_id[0]"),
    ("pad str", _set("pad_token_id", "2"), "pad_token_id"),
    ("pad negative", _set("pad_token_id", -1), "pad_token_id"),
    ("durable str", _set("durable_positions", "4"), "durable_positions"),
    ("durable bool", _set("durable_positions", False), "durable_positions"),
    ("durable negative", _set("durable_positions", -1), "durable_positions"),
    ("durable past the tokens", _set("durable_positions", 6), "durable_positions"),
    ("finished int", _set("finished", 1), "finished"),
    ("log negative", _set("log", -1), "log"),
    ("log str", _set("log", "0"), "log"),
    ("geometry list", _set("geometry", [2, 1, 8]), "geometry"),
    ("geometry missing key", _delete("geometry.dtype"), "geometry"),
    ("geometry extra key", _set("geometry.rope", 1), "geometry"),
    ("geometry layers str", _set("geometry.layers", "2"), "geometry.layers"),
    ("geometry layers bool", _set("geometry.layers", True), "geometry.layers"),
    ("geometry dtype", _set("geometry.dtype", "complex64"), "geometry.dtype"),
    ("geometry batch", _set("geometry.batch", 3), "geometry.batch"),
    ("blocks not a list", _set("blocks", "req-1/L0-1.T0-3"), "blocks"),
    ("block not a name", _set("blocks", [3]), "blocks[0]"),
    ("block not a key", _set("blocks", ["../../etc/passwd"]), "blocks[0]"),
    ("block of another stream", _set("blocks", [f"req-2/r{RUN}.L0-1.T0-3"]), "blocks[0]", "stream req-2"),
    ("block of another run", _set("blocks", [f"req-1/r{OTHER_RUN}.L0-1.T0-3"]), "blocks[0]", "run"),
    ("block of no run", _set("blocks", ["req-1/L0-1.T0-3"]), "blocks[0]", "run"),
    ("block past the layers", _set("blocks", [f"req-1/r{RUN}.L0-3.T0-3"]), "blocks[0]", "outside"),
    ("block past the tokens", _set("blocks", [f"req-1/r{RUN}.L0-2.T5-6"]), "blocks[0]", "outside"),
]


@pytest.mark.parametrize(("edit", "field", "detail"),
                         [(edit, field, rest[0] if rest else "") for _, edit, field, *rest in BAD],
                         ids=[case[0] for case in BAD])
def test_structurally_invalid_manifests_are_corrupt_and_name_the_field(edit, field: str, detail: str) -> None:
    with pytest.raises(dv.CorruptBlock, match=re.escape(f"field {field!r}") + (f".*{detail}" if detail else "")):
        Manifest.from_bytes(_edited(edit), "req-1")


@pytest.mark.parametrize(("data", "kind"), [(b"[1, 2]", "list"), (b'"manifest"', "string"), (b"null", "null"),
                                            (b"3", "number"), (b"true", "boolean")])
def test_json_that_is_not_an_object_is_corrupt(data: bytes, kind: str) -> None:
    with pytest.raises(dv.CorruptBlock, match=f"req-1 is invalid: is a JSON {kind}, not an object"):
        Manifest.from_bytes(data, "req-1")


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b"[" * 100_000, b'{"format": ' + b"9" * 5000 + b"}"],
                         ids=["empty", "truncated", "not utf-8", "deeply nested", "huge number"])
def test_unreadable_bytes_are_corrupt(data: bytes) -> None:
    with pytest.raises(dv.CorruptBlock, match="req-1"):
        Manifest.from_bytes(data, "req-1")


@pytest.mark.parametrize("version", [1, 2, FORMAT + 1, 0])
def test_other_formats_are_refused_with_a_config_error(version: int) -> None:
    data = _edited(_set("format", version))
    with pytest.raises(dv.ConfigError, match=f"format {version}; this SDK reads formats 3 and {FORMAT}"):
        Manifest.from_bytes(data, "req-1")


def test_a_format_3_manifest_reads_as_full_blocks_and_layerwise_prompts() -> None:
    """Format 3 had neither field: its writers sent blocks only when full, and prompts layer by layer."""
    old = json.loads(attrs.evolve(_valid(), replicate_within_ms=5.0, prompt_streaming="after").to_bytes())
    del old["replicate_within_ms"], old["prompt_streaming"]
    old["format"] = 3
    manifest = Manifest.from_bytes(json.dumps(old).encode(), "req-1")
    assert (manifest.replicate_within_ms, manifest.prompt_streaming) == (None, "layerwise")
    assert attrs.evolve(manifest, replicate_within_ms=None, prompt_streaming="layerwise") == manifest
    old["prompt_streaming"] = "after"  # a field format 3 did not have is damage, not an option
    with pytest.raises(dv.CorruptBlock, match="prompt_streaming"):
        Manifest.from_bytes(json.dumps(old).encode(), "req-1")


def test_the_format_is_checked_before_the_fields() -> None:
    """A format-1 manifest (no run, blocks without runs) is an old format, not a damaged new one."""
    old = json.loads(_valid().to_bytes())
    del old["run"]
    old.update(format=1, blocks=["req-1/L0-1.T0-3"])
    with pytest.raises(dv.ConfigError, match="forget"):
        Manifest.from_bytes(json.dumps(old).encode(), "req-1")


def test_an_encoded_progress_record_is_the_json_it_describes() -> None:
    """The streamer formats records without the json module: they must still parse to exactly these fields."""
    state = base64.b64encode(bytes(range(256)) * 3).decode()  # holds '+', '/' and '=' padding
    for tokens, rng in (([[3], [2]], ""), ([[7, 8, 9], [0, 1, 49151]], state), ([[]], "")):
        record = encode_progress(f"req-1/r{RUN}.L0-2.T4-5", 5, tokens, rng)
        assert json.loads(record) == {"block": f"req-1/r{RUN}.L0-2.T4-5", "durable_positions": 5,
                                      "tokens": tokens, "rng": rng}
    assert _valid().with_progress([encode_progress(f"req-1/r{RUN}.L0-2.T4-5", 5, [[3], [2]], "")]).generated == \
        _valid().with_progress([_record()]).generated
