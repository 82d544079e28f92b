from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dejavu_sdk as dv
from dejavu_sdk.blocks import DTYPE_CODES, MAX_INDEX_DIGITS, check_key

STREAM_IDS = st.text(alphabet="abcXYZ019_.:@+=,~-", min_size=1, max_size=40).filter(lambda s: s not in (".", ".."))
RUNS = st.one_of(st.just(""), st.text(alphabet="0123456789abcdef", min_size=1, max_size=32))
LIMIT = 10**MAX_INDEX_DIGITS


@given(STREAM_IDS, st.integers(0, LIMIT - 2), st.integers(1, 10**4), st.integers(0, LIMIT - 2), st.integers(1, 10**5),
       RUNS)
def test_a_key_parses_back_from_its_string(stream_id: str, a: int, layers: int, t0: int, tokens: int,
                                           run: str) -> None:
    key = dv.BlockKey(stream_id, layers=(a, min(a + layers, LIMIT - 1)), tokens=(t0, min(t0 + tokens, LIMIT - 1)),
                      run=run)
    assert dv.BlockKey.parse(str(key)) == key
    assert str(dv.BlockKey.parse(str(key))) == str(key)


def test_string_form_is_stable() -> None:
    assert str(dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 512))) == "req-1/L0-1.T0-512"
    assert str(dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 512), run="3f9a")) == "req-1/r3f9a.L0-1.T0-512"
    assert dv.BlockKey.parse("req-1/r3f9a.L0-1.T0-512") == dv.BlockKey("req-1", layers=(0, 1), tokens=(0, 512),
                                                                       run="3f9a")


@pytest.mark.parametrize("text", [
    "req/L01-2.T0-5",  # leading zeros: a second spelling of req/L1-2.T0-5
    "req/L1-2.T00-5",
    "req/L1-2.T0-05",
    "req/L00-1.T0-5",
    "req/L1-2.T0-\u0665",  # Arabic-Indic five: int() reads it, str(key) never writes it
    "req/L\u0661-2.T0-5",
    "req/L1-2.T0-\uff15",  # fullwidth five
    "req/L1-2.T0-" + "9" * 5000,  # past Python's int-string limit: a ConfigError, not a raw ValueError
    "req/L0-1.T0-" + "9" * 13,  # past the 12-digit bound
    "req/L0-1.T+0-5",
    "req/L0-1.T 0-5",
    "req/L0-1.T0-5\n",
    "req/r.L0-1.T0-5",  # an empty run is written without the r. part
    "req/rABC.L0-1.T0-5",  # runs are lowercase hex
    "req/rxyz.L0-1.T0-5",
    "req/r" + "a" * 33 + ".L0-1.T0-5",
    "req/r0a.r0a.L0-1.T0-5",
])
def test_parse_accepts_only_the_canonical_spelling(text: str) -> None:
    with pytest.raises(dv.ConfigError, match="canonical spelling"):
        dv.BlockKey.parse(text)


def test_a_huge_name_gets_a_short_error() -> None:
    with pytest.raises(dv.ConfigError) as raised:
        dv.BlockKey.parse("req/L1-2.T0-" + "9" * 5000)
    assert len(str(raised.value)) < 600


@pytest.mark.parametrize("run", ["ABC", "xyz", "a" * 33, 7, None, "a.b"])
def test_bad_runs_are_refused(run: object) -> None:
    with pytest.raises(dv.ConfigError, match="run"):
        dv.BlockKey("s", layers=(0, 1), tokens=(0, 1), run=run)  # type: ignore[arg-type]


def test_indices_are_bounded_so_every_key_has_a_name_parse_accepts() -> None:
    top = dv.BlockKey("s", layers=(0, 1), tokens=(LIMIT - 2, LIMIT - 1))
    assert dv.BlockKey.parse(str(top)) == top
    with pytest.raises(dv.ConfigError, match="tokens"):
        dv.BlockKey("s", layers=(0, 1), tokens=(0, LIMIT))


@pytest.mark.parametrize("stream_id", ["", "a/b", "a b", "a\\b", ".", "..", "tab\t", "x" * 201, 7, None])
def test_unsafe_stream_ids_are_refused(stream_id: object) -> None:
    with pytest.raises(dv.ConfigError, match="stream_id"):
        dv.BlockKey(stream_id, layers=(0, 1), tokens=(0, 1))  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [(1, 1), (2, 1), (-1, 3), (0,), "01", (0.0, 1.0), (True, 2), None, (0, 10**12)])
def test_empty_inverted_or_malformed_ranges_are_refused(bad: object) -> None:
    with pytest.raises(dv.ConfigError, match="layers"):
        dv.BlockKey("s", layers=bad, tokens=(0, 1))  # type: ignore[arg-type]
    with pytest.raises(dv.ConfigError, match="tokens"):
        dv.BlockKey("s", layers=(0, 1), tokens=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["req-1", "req-1/L0-1", "req-1/L0-1.T5-5", "a/b/L0-1.T0-1", "req-1/L0-1.T0-1x"])
def test_parse_refuses_what_is_not_a_key(text: str) -> None:
    with pytest.raises(dv.ConfigError):
        dv.BlockKey.parse(text)


def test_keys_are_frozen_ordered_and_hashable() -> None:
    a = dv.BlockKey("s", layers=(0, 1), tokens=(0, 4))
    b = dv.BlockKey("s", layers=(1, 2), tokens=(0, 4))
    assert sorted([b, a]) == [a, b]
    assert len({a, b, dv.BlockKey("s", layers=[0, 1], tokens=[0, 4])}) == 2
    with pytest.raises(AttributeError):
        a.stream_id = "t"  # type: ignore[misc]


def test_named_constructors() -> None:
    assert dv.BlockKey.for_layer("s", 3, 0, 512) == dv.BlockKey("s", layers=(3, 4), tokens=(0, 512))
    assert dv.BlockKey.for_layer("s", 3, 40, 2) == dv.BlockKey("s", layers=(3, 4), tokens=(40, 42))
    assert dv.BlockKey.for_decode_steps("s", (0, 30), 512, 4) == dv.BlockKey("s", layers=(0, 30), tokens=(512, 516))
    assert dv.BlockKey.for_layer("s", 3, 0, 8, run="ab") == dv.BlockKey("s", layers=(3, 4), tokens=(0, 8), run="ab")
    assert dv.BlockKey.for_decode_steps("s", (0, 2), 8, run="ab") == dv.BlockKey("s", layers=(0, 2), tokens=(8, 9),
                                                                                 run="ab")


def test_runs_keep_blocks_apart_under_one_stream() -> None:
    store = dv.open_store("memory://")
    one, two = (dv.BlockKey("s", layers=(0, 1), tokens=(0, 2), run=run) for run in ("a1", "b2"))
    store.flush(one, torch.zeros(2))
    store.flush(two, torch.ones(2))
    assert str(one) != str(two)
    assert torch.equal(store.fetch(one), torch.zeros(2))
    assert store.keys("s") == [one, two]  # every run of the stream
    assert store.delete("s") == 2


def test_kvspec_gives_block_shapes_and_sizes() -> None:
    spec = dv.KVSpec(layers=30, kv_heads=3, head_dim=64, dtype=torch.bfloat16, batch=2)
    key = dv.BlockKey("s", layers=(4, 6), tokens=(10, 17))
    assert spec.dtype == "bfloat16"
    assert spec.block_shape(key) == (2, 2, 2, 3, 7, 64)
    assert spec.shape(30, 5) == (30, 2, 2, 3, 5, 64)
    with pytest.raises(dv.ConfigError, match="30 layers"):
        spec.block_shape(dv.BlockKey("s", layers=(29, 31), tokens=(0, 1)))


@pytest.mark.parametrize(("field", "value"), [("layers", 0), ("kv_heads", -1), ("head_dim", 1.5), ("batch", True)])
def test_kvspec_refuses_bad_geometry(field: str, value: object) -> None:
    arguments = {"layers": 2, "kv_heads": 2, "head_dim": 8, field: value}
    with pytest.raises(dv.ConfigError, match=field):
        dv.KVSpec(**arguments)


def test_kvspec_refuses_unsupported_dtypes() -> None:
    with pytest.raises(dv.ConfigError, match="complex64"):
        dv.KVSpec(layers=1, kv_heads=1, head_dim=1, dtype=torch.complex64)
    assert all(getattr(torch, name).itemsize > 0 for name in DTYPE_CODES)


class _Hostile:
    """An argument whose every protocol method fails: no raw error may come out of a key for it."""

    def __iter__(self):
        raise RuntimeError("__iter__")

    def __index__(self):
        raise RuntimeError("__index__")

    def __int__(self):
        raise RuntimeError("__int__")

    def __repr__(self):
        raise RuntimeError("__repr__")


def _failing_after_one():
    yield 0
    raise RuntimeError("next")


def _type_name(value: object) -> str:
    return type(value).__name__


HUGE = 10**5000  # past Python's int-string limit: repr() and f-strings raise ValueError


@pytest.mark.parametrize("bad", [
    (0, HUGE), (HUGE, HUGE + 1), (-HUGE, 1), (0, 1, HUGE), (0, 2**64), (-1, 1), (0, LIMIT), (LIMIT - 1, LIMIT),
    (3, 3), (3, 2), (), (0,), (0, 1, 2), 5, None, "01", {0: 1}.items(),
    (True, 2), (False, True), (0.0, 1.0), (0, float("inf")), (0, float("nan")), (np.int64(0), np.int64(1)),
    (np.float64(0), np.float64(1)), (torch.tensor(0), torch.tensor(1)), ("0", "1"), (None, 1),
    _Hostile(), (_Hostile(), 1), (0, _Hostile()), _failing_after_one(), itertools.count(),
], ids=_type_name)
def test_hostile_ranges_raise_config_error(bad: object) -> None:
    with pytest.raises(dv.ConfigError, match="tokens"):
        dv.BlockKey("s", layers=(0, 1), tokens=bad)  # type: ignore[arg-type]
    with pytest.raises(dv.ConfigError, match="layers"):
        dv.BlockKey.for_decode_steps("s", bad, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [HUGE, -HUGE, 2**64, LIMIT, -1, True, 1.0, np.int64(1), np.float64(1), "1", None,
                                 (1,), _Hostile()], ids=_type_name)
@pytest.mark.parametrize("make", [
    lambda n: dv.BlockKey.for_layer("s", n, 0, 1),
    lambda n: dv.BlockKey.for_layer("s", 0, n, 1),
    lambda n: dv.BlockKey.for_layer("s", 0, 0, n),
    lambda n: dv.BlockKey.for_decode_steps("s", (0, 1), n),
    lambda n: dv.BlockKey.for_decode_steps("s", (0, 1), 0, n),
    lambda n: dv.ProgressKey("s", "ab", n, 0),
    lambda n: dv.ProgressKey("s", "ab", 0, n),
], ids=["layer", "first", "count", "decode-first", "decode-count", "progress-log", "progress-step"])
def test_hostile_numbers_raise_config_error(make, bad: object) -> None:
    with pytest.raises(dv.ConfigError):
        make(bad)


@pytest.mark.parametrize("bad", [HUGE, (HUGE,), b"s", ["s"], 1.5, _Hostile(), "s" * 10**6], ids=_type_name)
@pytest.mark.parametrize("make", [
    lambda text: dv.BlockKey(text, layers=(0, 1), tokens=(0, 1)),
    lambda text: dv.BlockKey("s", layers=(0, 1), tokens=(0, 1), run=text),
    lambda text: dv.ProgressKey(text, "ab", 0, 0),
    lambda text: dv.ProgressKey("s", text, 0, 0),
    dv.BlockKey.parse,
    dv.ProgressKey.parse,
    check_key,
], ids=["stream_id", "run", "progress-stream_id", "progress-run", "parse", "progress-parse", "check_key"])
def test_hostile_names_raise_config_error(make, bad: object) -> None:
    with pytest.raises(dv.ConfigError) as raised:
        make(bad)
    assert len(str(raised.value)) < 600


class _OddInt(int):
    """An int subclass with its own spelling and equality: a key must hold and write the plain number."""

    def __format__(self, spec: str) -> str:
        return "x"

    def __repr__(self) -> str:
        raise RuntimeError("__repr__")

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = int.__hash__


class _OddStr(str):
    def __format__(self, spec: str) -> str:
        return "x/y"

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = str.__hash__


def test_subclasses_of_int_and_str_become_plain_values_that_round_trip() -> None:
    key = dv.BlockKey(_OddStr("s"), layers=[_OddInt(2), _OddInt(3)], tokens=iter((_OddInt(5), 9)),
                      run=_OddStr("ab"))
    assert str(key) == "s/rab.L2-3.T5-9"
    assert dv.BlockKey.parse(_OddStr(str(key))) == key
    assert [type(value) for value in (key.stream_id, key.run, *key.layers, *key.tokens)] == [str, str] + [int] * 4
    assert str(dv.BlockKey.for_layer("s", _OddInt(1), _OddInt(4), _OddInt(2))) == "s/L1-2.T4-6"
    progress = dv.ProgressKey(_OddStr("s"), "ab", _OddInt(1), _OddInt(2))
    assert str(progress) == "s/rab.progress1.step2"
    assert dv.ProgressKey.parse(str(progress)) == progress
    with pytest.raises(dv.ConfigError, match="canonical"):
        dv.BlockKey.parse(_OddStr("s/L01-2.T0-1"))


def test_the_largest_accepted_numbers_round_trip() -> None:
    top = dv.BlockKey("s" * 200, layers=(LIMIT - 2, LIMIT - 1), tokens=(LIMIT - 2, LIMIT - 1), run="f" * 32)
    assert dv.BlockKey.parse(str(top)) == top
    assert dv.BlockKey.for_layer("s", LIMIT - 2, LIMIT - 2, 1) == dv.BlockKey("s", layers=(LIMIT - 2, LIMIT - 1),
                                                                             tokens=(LIMIT - 2, LIMIT - 1))
    progress = dv.ProgressKey("s", "ab", LIMIT - 1, LIMIT - 2)
    assert dv.ProgressKey.parse(str(progress.next_step())) == progress.next_step()
    with pytest.raises(dv.ConfigError, match="full"):
        progress.next_step().next_step()


@pytest.mark.parametrize(("field", "value"), [("layers", -HUGE), ("head_dim", _Hostile()), ("dtype", HUGE),
                                              ("dtype", _Hostile())], ids=_type_name)
def test_kvspec_refuses_hostile_values_with_config_error(field: str, value: object) -> None:
    with pytest.raises(dv.ConfigError):
        dv.KVSpec(**{"layers": 2, "kv_heads": 2, "head_dim": 8, field: value})
