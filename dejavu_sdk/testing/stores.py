"""`StoreTests`: the conformance suite every replica store passes, shipped so third-party stores can too.

Use it from a pytest module:

    class TestMyStore(StoreTests):
        @pytest.fixture
        def store_factory(self, tmp_path):
            return lambda: MyStore(tmp_path / uuid.uuid4().hex)   # each call: a new, empty store

Corruption tests reach under the codec through the store's record interface (`store.records`), and the
declared capabilities of the record store (`atomic_batches`) are checked too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from ..blocks import DTYPE_CODES, BlockKey, ProgressKey, torch_dtype
from ..errors import BlockNotFound, ConfigError, CorruptBlock, DejaVuError, StoreClosed
from ..store import Store
from ..tensors import random_tensor, same_bits
from .stateful import run_store_state_machine

KEY = BlockKey("req-1", layers=(0, 1), tokens=(0, 8))
SHAPES = [(), (0,), (1,), (3, 5), (2, 2, 1, 3, 7, 16), (1, 2, 1, 4, 512, 64), (5 << 20,)]


def rewrite_record(store: Store, key: BlockKey, edit: Callable[[bytearray], bytes | bytearray]) -> None:
    """Replace the stored record of `key` with `edit(record)`, bypassing encoding (to simulate damage)."""
    with store.records.get_record(str(key)) as record:
        data = bytearray(bytes(record))
    store.records.put_records([(str(key), np.frombuffer(bytes(edit(data)), dtype=np.uint8))])


class StoreTests:
    """Behaviour every `Store` must have. Subclasses provide a `store_factory` fixture."""

    @pytest.fixture
    def store(self, store_factory: Callable[[], Store]) -> Iterator[Store]:
        store = store_factory()
        yield store
        store.close()

    @pytest.fixture
    def reopen(self) -> Callable[[Store], Store] | None:
        """A new store on the same location as the given one. Test classes of stores that declare `shared`
        or `persistent` must override this: their promise is checked with it."""
        return None

    # ---- round trips ----------------------------------------------------------------------
    @pytest.mark.parametrize("dtype_name", sorted(DTYPE_CODES))
    def test_every_dtype_round_trips_bit_for_bit(self, store: Store, dtype_name: str) -> None:
        block = random_tensor((2, 2, 1, 3, 5, 8), torch_dtype(dtype_name), seed=len(dtype_name))
        store.flush(KEY, block)
        assert same_bits(store.fetch(KEY), block)

    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    def test_shapes_round_trip(self, store: Store, shape: tuple[int, ...]) -> None:
        block = random_tensor(shape, torch.float16, seed=1)
        store.flush(KEY, block)
        assert same_bits(store.fetch(KEY), block)

    def test_numpy_buffers_and_non_contiguous_tensors_round_trip(self, store: Store) -> None:
        array = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
        store.flush(KEY, array)
        assert same_bits(store.fetch(KEY), torch.from_numpy(array))
        other = BlockKey("req-1", layers=(1, 2), tokens=(0, 8))
        store.flush(other, b"raw bytes")
        assert bytes(store.fetch(other).numpy()) == b"raw bytes"
        strided = random_tensor((4, 6), torch.bfloat16).t()
        store.flush(KEY, strided)
        assert same_bits(store.fetch(KEY), strided)

    def test_fetch_into_out(self, store: Store) -> None:
        block = random_tensor((1, 2, 1, 4, 8, 16), torch.bfloat16, seed=3)
        store.flush(KEY, block)
        out = torch.empty_like(block)
        assert store.fetch(KEY, out=out) is out
        assert same_bits(out, block)
        strided_out = torch.empty(16, 8, 4, 1, 2, 1, dtype=torch.bfloat16).permute(5, 4, 3, 2, 1, 0)
        store.fetch(KEY, out=strided_out)
        assert same_bits(strided_out, block)

    @pytest.mark.parametrize("wrong", ["shape", "dtype", "type"])
    def test_out_of_the_wrong_kind_is_refused_untouched(self, store: Store, wrong: str) -> None:
        store.flush(KEY, random_tensor((2, 3), torch.float32))
        out: Any = {  # deliberately of the wrong kind: fetch must refuse it without writing into it
            "shape": torch.zeros(3, 2),
            "dtype": torch.zeros(2, 3, dtype=torch.float16),
            "type": np.zeros((2, 3), np.float32),
        }[wrong]
        with pytest.raises(ConfigError, match="out"):
            store.fetch(KEY, out=out)
        assert not out.any()

    def test_flush_replaces_the_block(self, store: Store) -> None:
        store.flush(KEY, torch.zeros(4))
        store.flush(KEY, torch.ones(2, 2, dtype=torch.int64))
        assert same_bits(store.fetch(KEY), torch.ones(2, 2, dtype=torch.int64))

    # ---- listing and deleting -------------------------------------------------------------
    def test_keys_and_delete_by_stream(self, store: Store) -> None:
        keys = [BlockKey(stream, layers=(layer, layer + 1), tokens=(0, 4))
                for stream in ("req-1", "req-10", "other") for layer in range(3)]
        for key in keys:
            store.flush(key, torch.full((2,), float(key.layers[0])))
        assert store.keys() == sorted(keys)
        assert store.keys("req-1") == [k for k in keys if k.stream_id == "req-1"]
        assert store.delete("req-1") == 3
        assert store.keys("req-1") == []
        assert store.keys() == sorted(k for k in keys if k.stream_id != "req-1")
        assert store.delete("never-written") == 0
        with pytest.raises(BlockNotFound):
            store.fetch(keys[0])

    def test_manifests_live_beside_blocks(self, store: Store) -> None:
        store.flush(KEY, torch.ones(2))
        store.write_manifest("req-1", b'{"step": 1}')
        store.write_manifest("req-1", b'{"step": 2}')
        assert store.read_manifest("req-1") == b'{"step": 2}'
        assert store.keys("req-1") == [KEY]  # a manifest is not a block
        with pytest.raises(BlockNotFound):
            store.read_manifest("req-2")
        assert store.delete("req-1") == 1
        with pytest.raises(BlockNotFound):
            store.read_manifest("req-1")

    def test_a_block_and_its_progress_record_are_flushed_together(self, store: Store) -> None:
        store.write_manifest(KEY.stream_id, b'{"step": 0}')
        block = random_tensor((3, 5), torch.float16, seed=7)
        key, progress = attrs.evolve(KEY, run="abc"), ProgressKey(KEY.stream_id, "abc", 0, 0)
        store.flush_with_progress(key, block, progress, b'{"step": 1}')
        assert same_bits(store.fetch(key), block)
        assert store.read_progress(progress) == b'{"step": 1}'
        assert store.read_manifest(KEY.stream_id) == b'{"step": 0}'
        assert store.keys(KEY.stream_id) == [key]  # a progress record is not a block
        assert store.progress_keys(KEY.stream_id) == [progress]
        with pytest.raises(ConfigError):
            store.flush_with_progress(str(key), block, progress, b"{}")  # type: ignore[arg-type]  # deliberately a str
        with pytest.raises(ConfigError, match="does not belong"):  # a record of another run than its block
            store.flush_with_progress(key, block, ProgressKey(KEY.stream_id, "abd", 0, 1), b"{}")
        store.put_progress(ProgressKey(KEY.stream_id, "abc", 1, 0), b'{"step": 2}')
        assert [found.log for found in store.progress_keys(KEY.stream_id)] == [0, 1]
        assert store.delete(KEY.stream_id) == 1
        assert store.progress_keys(KEY.stream_id) == []
        with pytest.raises(BlockNotFound):
            store.read_progress(progress)

    # ---- the record interface and its declared capabilities --------------------------------
    def test_records_are_put_listed_and_removed_by_name(self, store: Store) -> None:
        store.flush(KEY, torch.ones(3))
        records = store.records
        with records.get_record(str(KEY)) as record:
            copy = np.frombuffer(bytes(record), dtype=np.uint8)
        names = ["req-2/L0-1.T0-8", "req-2/manifest"]
        records.put_records([(names[0], copy), (names[1], copy)])
        assert sorted(records.names("req-2/")) == names
        assert sorted(records.names("")) == sorted([str(KEY), *names])
        records.remove([names[0], "req-3/L0-1.T0-8"])  # a name never stored is ignored
        assert records.names("req-2/") == [names[1]]
        assert records.allocate(10).nbytes == 10
        for flag in ("atomic_batches", "persistent", "shared", "lends_buffers", "resident"):
            assert isinstance(getattr(records, flag), bool), flag

    def test_a_batch_that_fails_midway_stores_nothing_if_batches_are_atomic(self, store: Store) -> None:
        records = store.records
        with pytest.raises(DejaVuError):
            records.put_records([("req-1/manifest", np.zeros(8, np.uint8)), ("req-1/L0-1.T0-8", None)])
        if records.atomic_batches:  # declared: all of a batch or none of it
            assert records.names("req-1/") == []

    def test_declared_sharing_and_persistence_hold(self, store_factory: Callable[[], Store],
                                                   reopen: Callable[[Store], Store] | None) -> None:
        store = store_factory()
        records = store.records
        if not (records.shared or records.persistent):
            store.close()
            return  # nothing promised beyond this store object
        assert reopen is not None, (f"{type(records).__name__} declares shared or persistent records: give the "
                                    "test class a `reopen` fixture that opens the same location again")
        block, other_key = random_tensor((3, 7), torch.bfloat16, seed=11), BlockKey("req-1", layers=(1, 2),
                                                                                    tokens=(0, 8))
        store.flush(KEY, block)
        store.write_manifest(KEY.stream_id, b'{"step": 1}')
        if records.shared:  # a second store on the same location sees this one's writes, and the other way
            with reopen(store) as second:
                assert same_bits(second.fetch(KEY), block)
                second.flush(other_key, block)
            assert same_bits(store.fetch(other_key), block)
        store.close()
        if records.persistent:  # what was written outlives the store that wrote it
            with reopen(store) as again:
                assert same_bits(again.fetch(KEY), block)
                assert again.read_manifest(KEY.stream_id) == b'{"step": 1}'

    def test_a_record_that_is_not_a_buffer_is_refused(self, store: Store) -> None:
        with pytest.raises(ConfigError, match="buffer"):
            store.records.put_records([("req-1/manifest", 42)])

    # ---- errors ---------------------------------------------------------------------------
    def test_missing_block_raises_block_not_found_which_is_a_key_error(self, store: Store) -> None:
        with pytest.raises(BlockNotFound, match=r"req-1/L0-1\.T0-8"):
            store.fetch(KEY)
        with pytest.raises(KeyError):
            store.fetch(KEY)

    @pytest.mark.parametrize("damage", ["payload", "header", "truncated", "extended", "empty"])
    def test_damaged_records_raise_corrupt_block(self, store: Store, damage: str) -> None:
        store.flush(KEY, random_tensor((64, 64), torch.float16))

        def edit(data: bytearray) -> bytearray:
            if damage == "payload":
                data[-100] ^= 0x01
            elif damage == "header":
                data[12] ^= 0x40  # the payload length field
            elif damage == "truncated":
                del data[-1000:]
            elif damage == "extended":
                data += b"\0"
            else:
                data.clear()
            return data

        rewrite_record(store, KEY, edit)
        with pytest.raises(CorruptBlock, match="corrupt"):
            store.fetch(KEY)
        with pytest.raises(CorruptBlock, match="corrupt"):  # the contents of out are unspecified then
            store.fetch(KEY, out=torch.zeros(64, 64, dtype=torch.float16))

    def test_a_record_stored_under_another_key_is_corrupt(self, store: Store) -> None:
        other = BlockKey("req-1", layers=(1, 2), tokens=(0, 8))
        store.flush(other, torch.ones(4))
        with store.records.get_record(str(other)) as record:
            moved = np.frombuffer(bytes(record), dtype=np.uint8)
        store.records.put_records([(str(KEY), moved)])
        with pytest.raises(CorruptBlock, match="holds block"):
            store.fetch(KEY)

    def test_bad_arguments_raise_config_errors(self, store: Store) -> None:
        with pytest.raises(ConfigError, match="BlockKey"):
            store.flush("req-1/L0-1.T0-8", torch.ones(2))  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="complex64"):
            store.flush(KEY, torch.ones(2, dtype=torch.complex64))
        with pytest.raises(ConfigError, match="cannot store"):
            store.flush(KEY, [1.0, 2.0])
        with pytest.raises(ConfigError, match="stream_id"):
            store.keys("a/b")

    def test_use_after_close_raises_store_closed(self, store_factory: Callable[[], Store]) -> None:
        with store_factory() as store:
            store.flush(KEY, torch.ones(2))
        assert store.closed
        for call in (lambda: store.flush(KEY, torch.ones(2)), lambda: store.fetch(KEY),
                     lambda: store.keys(), lambda: store.delete("req-1")):
            with pytest.raises(StoreClosed, match="closed"):
                call()
        store.close()

    # ---- concurrency and random sequences -------------------------------------------------
    def test_concurrent_flushes_lose_nothing(self, store: Store) -> None:
        threads, per_thread = 4, 12
        errors: list[BaseException] = []

        def writer(thread: int) -> None:
            try:
                for step in range(per_thread):
                    key = BlockKey(f"t{thread}", layers=(0, 2), tokens=(step, step + 1))
                    store.flush(key, random_tensor((2, 2, 1, 2, 1, 64), torch.float16, seed=thread * 100 + step))
            except BaseException as error:  # surfaced below
                errors.append(error)

        workers = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=120)
        assert not errors, errors
        assert len(store.keys()) == threads * per_thread
        for thread in range(threads):
            for step in range(per_thread):
                key = BlockKey(f"t{thread}", layers=(0, 2), tokens=(step, step + 1))
                expected = random_tensor((2, 2, 1, 2, 1, 64), torch.float16, seed=thread * 100 + step)
                assert same_bits(store.fetch(key), expected)

    def test_random_operations_agree_with_a_dict(self, store_factory: Callable[[], Store]) -> None:
        run_store_state_machine(store_factory)
