"""The streaming cache: a transformers `DynamicCache` that streams every layer's new KV as it is produced.

Who calls what:
- the model calls `StreamingCache.update(keys, values, layer_idx)` once per attention layer per forward;
  the cache stores the KV as `DynamicCache` does, then shows the delta to its `CacheManager`;
- the `CacheManager` decides what leaves and when:
    prefill (several new positions): layer l's block is handed off at once, while layer l+1 computes
        (layer-by-layer prompt streaming);
    decode (one new position): each layer's slice is copied into a reusable staging buffer, and the
        whole step (or `replicate_every` steps) leaves as one block (buffered copies);
- one background streamer thread flushes handed-off blocks to the sink (a store or transport) through a
  bounded queue, so streaming overlaps compute and a slow sink slows the model instead of using unbounded
  memory;
- the caller (the engine, or a custom loop) calls `finish()` after the last step: it flushes what is
  buffered, waits for the streamer, and raises if anything failed, so there is never a silent gap.
"""

from __future__ import annotations

import copy
import queue
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from transformers import DynamicCache

from .blocks import BlockKey, KVSpec, ProgressKey, check_run
from .codec import HostBlock
from .errors import ConfigError, ReplicationError
from .stream import BlockSink, ProgressSink, StagingBuffer

_STOP = object()
#: The name of every streamer thread starts so (the stream id follows): profilers and benchmarks find it by it.
STREAMER = "dejavu-streamer"


class CacheManager:
    """Routes one stream's KV deltas to `sink` from a background thread.

    `replicate_every`: decode steps per block (1: every step; more for slow tiers such as object storage).
    `on_replica_error`: "raise" (default) surfaces a failed flush from the next call and from `finish`;
    "warn" warns once and stops replicating this stream.
    `on_durable(key)` runs on the streamer thread after each block the sink accepted. With `progress_for`,
    the sink must be a `ProgressSink` (a store, the local transport, an engine's replica): it gets each block
    together with a small progress record, `progress_for(key, durable_positions)` (the record's key and
    bytes, saying what is durable once that block is), and LMDB commits both in one transaction.
    `run` goes into every block key (`BlockKey.run`): the engine names each generation's blocks apart.
    The sink gets prefill blocks as tensors and, on the CPU, full decode blocks as `codec.HostBlock`s (the
    staging buffer, described once; `block.tensor` is the tensor): stores and transports encode them with
    plain buffer copies.
    """

    def __init__(self, sink: BlockSink | ProgressSink, stream_id: str, layers: int, *, replicate_every: int = 1,
                 queue_size: int = 8, on_replica_error: str = "raise",
                 on_durable: Callable[[BlockKey], None] | None = None, durable: Sequence[BlockKey] = (),
                 durable_positions: int = 0,
                 progress_for: Callable[[BlockKey, int], tuple[ProgressKey, bytes]] | None = None,
                 run: str = "") -> None:
        if not isinstance(replicate_every, int) or replicate_every < 1:
            raise ConfigError(f"replicate_every must be a positive integer, got {replicate_every!r}")
        if on_replica_error not in ("raise", "warn"):
            raise ConfigError(f"on_replica_error must be 'raise' or 'warn', got {on_replica_error!r}")
        self.sink, self.stream_id, self.layers = sink, stream_id, layers
        self.run = check_run(run)
        self.replicate_every, self.on_replica_error = replicate_every, on_replica_error
        self.durable: list[BlockKey] = list(durable)  # blocks the sink has accepted, in hand-off order
        self._layer_ends = [durable_positions] * layers  # per layer, positions [0, end) are durable
        self._on_durable = on_durable
        if progress_for is not None and not isinstance(sink, ProgressSink):
            raise ConfigError(f"progress_for needs a ProgressSink (a store or the local transport); "
                              f"{type(sink).__name__} is not one, so record progress from on_durable instead")
        self._progress_for = progress_for
        if not isinstance(queue_size, int) or queue_size < 1:
            raise ConfigError(f"queue_size must be a positive integer, got {queue_size!r}")
        # Hand-off in C (SimpleQueue), bounded by tickets: a block goes in only with a ticket, and the streamer
        # gives the ticket back once the block is written. queue.Queue would do the same in Python, and the
        # streamer runs that Python on every wake-up, with cold caches, beside the model's threads.
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._tickets: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(queue_size):
            self._tickets.put(None)
        self._free: queue.SimpleQueue[StagingBuffer] = queue.SimpleQueue()  # unbounded; put and get in C
        self._staging: StagingBuffer | None = None
        self._step_slices: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._first_position = 0
        self._filled = 0
        self._error: BaseException | None = None
        self._warned = False
        self._finished = False
        self._thread = threading.Thread(target=self._stream, name=f"{STREAMER} {stream_id}", daemon=True)
        self._thread.start()

    # ---- called from the model's forward -------------------------------------------------
    def observe(self, layer: int, keys: torch.Tensor, values: torch.Tensor, first_position: int) -> None:
        """See layer `layer`'s new KV `[B, H_kv, T, D]` for positions from `first_position` on."""
        if self._error is not None:  # raises, or with on_replica_error="warn" no longer replicates this stream
            self._check()
            return
        if keys.shape[-2] > 1:  # prefill: this layer's block leaves now, while the next layer computes
            block = torch.stack((keys.detach(), values.detach())).unsqueeze(0)  # a copy, off the graph
            key = BlockKey.for_layer(self.stream_id, layer, first_position, keys.shape[-2], self.run)
            self._hand_off(key, block)
            return
        if layer == 0:
            self._step_slices = []
            if self._filled == 0:
                self._first_position = first_position
        self._step_slices.append((keys, values))
        if layer == self.layers - 1:
            self._buffer_step()

    def _buffer_step(self) -> None:
        if len(self._step_slices) != self.layers:
            raise ConfigError(f"a decode step updated {len(self._step_slices)} layers, expected {self.layers}")
        if self._staging is None:
            self._staging = self._take_staging(self._step_slices[0][0])
        self._staging.fill(self._step_slices, (0, 1), slot=self._filled)
        self._filled += 1
        if self._filled == self.replicate_every:
            self._hand_off_staging()

    def _take_staging(self, sample: torch.Tensor) -> StagingBuffer:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            spec = KVSpec(layers=self.layers, kv_heads=sample.shape[1], head_dim=sample.shape[-1],
                          dtype=sample.dtype, batch=sample.shape[0])
            return StagingBuffer(spec, (0, self.layers), tokens=self.replicate_every, device=sample.device)

    def _hand_off_staging(self) -> None:
        staging, filled = self._staging, self._filled
        assert staging is not None  # set whenever _filled > 0, the only time this is called
        self._staging, self._filled = None, 0
        key = BlockKey.for_decode_steps(self.stream_id, (0, self.layers), self._first_position, filled, self.run)
        if filled < self.replicate_every:  # the last block of a stream, part full
            block: torch.Tensor | HostBlock = staging.buffer[:, :, :, :, :filled]
        else:
            block = staging.host_block if staging.host_block is not None else staging.buffer
        self._hand_off(key, block, lambda: self._free.put(staging))

    def _hand_off(self, key: BlockKey, block: torch.Tensor | HostBlock,
                  done: Callable[[], None] | None = None) -> None:
        ready = None
        if isinstance(block, torch.Tensor) and block.device.type == "cuda":  # not to be read before it is computed
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(block.device))
        self._tickets.get()  # blocks when the streamer is `queue_size` blocks behind: back-pressure
        self._queue.put((key, block, ready, done))

    # ---- the streamer thread ---------------------------------------------------------------
    def _stream(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            key, block, ready, done = item
            try:
                if self._error is None:
                    if ready is not None:
                        ready.synchronize()
                    ends = _advanced(self._layer_ends, key)
                    if self._progress_for is None:
                        self.sink.flush(key, block)  # type: ignore[union-attr]
                    else:
                        progress, record = self._progress_for(key, min(ends))
                        self.sink.flush_with_progress(key, block, progress, record)  # type: ignore[union-attr]
                    self._record_durable(key, ends)
            except BaseException as error:  # surfaced to the model's thread by _check and finish
                self._error = ReplicationError(f"replicating {key} failed: {error}")
                self._error.__cause__ = error
            finally:
                if done is not None:
                    done()
                self._tickets.put(None)

    def _record_durable(self, key: BlockKey, ends: list[int]) -> None:
        """`key` reached the sink; `ends` are the durable ends of every layer with it."""
        self.durable.append(key)
        self._layer_ends = ends
        if self._on_durable is not None:
            self._on_durable(key)

    @property
    def durable_positions(self) -> int:
        """Positions [0, n) of every layer have reached the sink."""
        return min(self._layer_ends)

    def _check(self) -> None:
        if self._error is None or self._finished:
            return
        if self.on_replica_error == "raise":
            raise self._error
        if not self._warned:
            self._warned = True
            warnings.warn(f"{self._error}; stream {self.stream_id} is no longer replicated", stacklevel=3)

    def finish(self) -> list[BlockKey]:
        """Flush what is buffered, wait until the streamer is done, and return the durable blocks."""
        if not self._finished:
            if self._error is None and self._filled:
                self._hand_off_staging()
            self._queue.put(_STOP)
            self._thread.join()
            self._finished = True
            if self._error is not None:
                if self.on_replica_error == "raise":
                    raise self._error
                warnings.warn(f"{self._error}; stream {self.stream_id} is not fully replicated", stacklevel=2)
        return list(self.durable)


def _advanced(layer_ends: list[int], key: BlockKey) -> list[int]:
    """Per layer, the end of the durable positions once `key` is durable too (blocks arrive in order)."""
    ends = list(layer_ends)
    for layer in range(*key.layers):
        if key.tokens[0] == ends[layer]:
            ends[layer] = key.tokens[1]
    return ends


class StreamingCache(DynamicCache):
    """A `DynamicCache` whose every update is also streamed by `manager`. Use it like any transformers
    cache (`model(ids, cache=cache)`, `model.generate(..., cache=cache)`), then call `manager.finish()`.

    The replica only ever grows: it holds what `update` appended, position by position. So every other
    operation that changes the cache's contents raises `ConfigError` before it changes anything, and the
    cache stays usable (and its replica exact) afterwards:
    - `crop` (assisted decoding, prompt lookup, speculative decoding: rejected draft tokens are dropped)
      and `activate_past_recording`, which prepares those rollbacks; `crop(0)` removes no position and is
      allowed, and `is_croppable` is False;
    - `reorder_cache` and `batch_select_indices` (beam search), `batch_repeat_interleave`, `reset`;
    - `update_conv_state`, `update_recurrent_state` and `update_indexer`: only attention KV is streamed.
    Reading (`get_seq_length`, `get_mask_sizes`, iteration, ...), `early_initialization`, `offload` and
    `prefetch` change no contents and work as in `DynamicCache`; `restore` fills the cache without streaming.

    `copy.deepcopy(cache)` returns a plain, independent `DynamicCache` with the same contents and no
    manager: transformers' prompt-reuse recipe (`generate(..., cache=copy.deepcopy(prompt_cache))`)
    continues from the copy without touching this cache's replica. Use such a copy, too, for anything
    refused here. `torch.export` cannot trace a streaming cache (its streamer thread and queue are not
    part of any graph): `update` raises `ConfigError` under export; export with a `DynamicCache`.
    """

    def __init__(self, manager: CacheManager, config: Any = None) -> None:
        super().__init__(config=config)
        self.manager = manager

    def restore(self, cache: torch.Tensor) -> None:
        """Fill the cache from `[layers, 2, B, H_kv, positions, D]` (fetched blocks) without streaming it again."""
        for layer in range(cache.shape[0]):
            DynamicCache.update(self, cache[layer, 0], cache[layer, 1], layer)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if _is_exporting():
            raise ConfigError(
                "torch.export is tracing a StreamingCache: its streamer thread and queue cannot be traced, and the "
                "blocks it would stream hold fake tensors; export the model with a plain DynamicCache (copy.deepcopy "
                "of this cache is one, with the same contents) and stream outside the exported program")
        first_position = self.get_seq_length(layer_idx) if layer_idx < len(self.layers) else 0
        result = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self.manager.observe(layer_idx, key_states, value_states, first_position)
        return result

    def __deepcopy__(self, memo: dict[int, Any]) -> DynamicCache:
        """A plain `DynamicCache` with a copy of every layer, and no manager: using it streams nothing."""
        clone = DynamicCache.__new__(DynamicCache)
        memo[id(self)] = clone
        for name, value in vars(self).items():
            if name != "manager":
                clone.__dict__[name] = copy.deepcopy(value, memo)
        return clone

    # ---- operations the replica cannot follow: refused before they change anything -----------------------
    @property
    def is_croppable(self) -> bool:
        """False: positions already streamed cannot be taken back (transformers then never plans a rollback)."""
        return False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:  # removes no position; transformers calls it to trim sliding-window layers
            super().crop(tokens_to_remove)
            return
        self._refuse(f"crop({tokens_to_remove})", "it removes positions from the end of the cache (assisted decoding, "
                     "prompt lookup and speculative decoding drop rejected draft tokens this way)", _NO_ROLLBACK)

    def activate_past_recording(self, **options: object) -> None:  # options: what newer transformers pass along
        self._refuse("activate_past_recording()", "it prepares the cache to be rolled back with crop (assisted "
                     "decoding, prompt lookup, speculative decoding)", _NO_ROLLBACK)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse("reorder_cache()", "beam search reorders the cache's rows", "use greedy decoding (num_beams=1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("batch_select_indices()", "it keeps only some of the cache's rows (beam search, dropping "
                     "finished rows)", "keep every row to the end (finished rows generate padding), or give each "
                     "sequence its own stream")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse(f"batch_repeat_interleave({repeats})", "it repeats the cache's rows",
                     f"repeat the inputs before the prefill instead, or expand a copy ({_COPY})")

    def reset(self) -> None:
        self._refuse("reset()", "it empties the cache",
                     "call cache.manager.finish() and take a new cache, under another stream id, for the next sequence")

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          **kwargs: Any) -> torch.Tensor:
        self._refuse("update_conv_state()", "it changes a linear-attention or Mamba-style state", _ATTENTION_ONLY)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        self._refuse("update_recurrent_state()", "it changes a linear-attention or Mamba-style state", _ATTENTION_ONLY)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self._refuse("update_indexer()", "it changes a sparse-attention indexer's keys", _ATTENTION_ONLY)

    def _refuse(self, operation: str, what: str, instead: str) -> NoReturn:
        raise ConfigError(f"{operation} on the streaming cache of stream {self.manager.stream_id}: {what}, which "
                          f"DejaVu does not replicate, so the replica would no longer match the cache; {instead}. "
                          "The cache is unchanged")


_COPY = "copy.deepcopy(cache) is a plain DynamicCache that streams nothing"
_NO_ROLLBACK = (f"generate without assistant_model, prompt_lookup_num_tokens or other drafting, or work on a copy "
                f"({_COPY})")
_ATTENTION_ONLY = "DejaVu streams attention keys and values only: use a model whose layers are all attention layers"


#: Whether torch.export is tracing (strict or not), looked up once: `update` asks at every layer of every
#: step. Always False on a torch too old to tell.
_is_exporting: Callable[[], bool] = getattr(torch.compiler, "is_exporting", lambda: False)
