"""The streaming cache: a transformers `DynamicCache` that streams every layer's new KV as it is produced.

Who calls what:
- the model calls `StreamingCache.update(keys, values, layer_idx)` once per attention layer per forward;
  the cache stores the KV as `DynamicCache` does, then shows the delta to its `CacheManager`;
- the `CacheManager` decides what leaves and when:
    prefill (several new positions), `prompt_streaming="layerwise"`: layer l's block is handed off at once,
        while layer l+1 computes (layer-by-layer prompt streaming); `"after"`: every layer's block is kept
        until the last layer's is made, and they leave together, in as few writes as `GROUP_BYTES` allows;
    decode (one new position): each layer's slice is copied into a reusable staging buffer, and the
        step leaves as one block (buffered copies), or several steps do: up to `replicate_every`, spanning
        about `replicate_within_ms` at most;
- one background streamer thread flushes handed-off blocks to the sink (a store or transport) through a
  bounded queue, so streaming overlaps compute and a slow sink slows the model instead of using unbounded
  memory; whatever is waiting when it wakes goes out together, in writes of up to `GROUP_BYTES` (group
  commit: one LMDB transaction for several blocks);
- the caller (the engine, or a custom loop) calls `finish()` after the last step: it flushes what is
  buffered, waits for the streamer, and raises if anything failed, so there is never a silent gap.
"""

from __future__ import annotations

import copy
import math
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from transformers import DynamicCache

from .blocks import BlockKey, KVSpec, ProgressKey, check_run
from .codec import HostBlock, KVPair
from .errors import ConfigError, ReplicationError
from .stream import BlockGroupSink, BlockSink, GroupSink, ProgressSink, StagingBuffer

_STOP = object()
#: The name of every streamer thread starts so (the stream id follows): profilers and benchmarks find it by it.
STREAMER = "dejavu-streamer"
#: How the prompt's KV leaves (`DejaVuEngine(prompt_streaming=...)`); "auto" is resolved by `prompt_streaming_for`.
PROMPT_STREAMING = ("layerwise", "after", "auto")

#: One block handed off: its key, and the block (a device tensor, a `KVPair` of a prompt layer on the CPU, a
#: `HostBlock` of the staging buffer, or a tensor of part of it).
Entry = tuple[BlockKey, Any]
#: What one request to the sink carries at most when several blocks wait (a larger block goes alone).
#: Small blocks (decode steps) gain most from sharing a request: one LMDB transaction and fsync instead of
#: one each. Past about 2 MiB an LMDB transaction costs more CPU than the same bytes in two (LMDB 0.9 on
#: ext4, 2 cores: 6 blocks of 1 MiB took 4.5 ms of CPU in one transaction, 1.2 ms in three).
GROUP_BYTES = 2 << 20


def check_prompt_streaming(choice: str) -> str:
    """`choice` if it is one of `PROMPT_STREAMING`, else ConfigError."""
    if choice not in PROMPT_STREAMING:
        raise ConfigError(f"prompt_streaming must be one of {', '.join(map(repr, PROMPT_STREAMING))}, got {choice!r}")
    return choice


class CacheManager:
    """Routes one stream's KV deltas to `sink` from a background thread.

    `replicate_every`: at most this many decode steps per block (1: every step; more for slow tiers such
    as object storage, or steps too short to write each alone). `replicate_within_ms`: with
    `replicate_every` > 1, a block also leaves once waiting for one more step (taken to last as long as
    the step just made) would hold its first step back `replicate_within_ms` or longer (None: only when
    full). So steps longer than it leave one by one, shorter ones in groups that span about that long;
    beyond what is staged, at most `queue_size` hand-offs wait for the streamer (back-pressure).
    `prompt_streaming`: "layerwise" (each prompt layer's block leaves while the next layer computes) or
    "after" (they leave together once the last layer's is made); `prompt_streaming_for` picks one.
    `on_replica_error`: "raise" (default) surfaces a failed flush from the next call and from `finish`;
    "warn" warns once and stops replicating this stream.
    `on_durable(key)` runs on the streamer thread after each block the sink accepted. With `progress_for`,
    the sink must be a `ProgressSink` (a store, the local transport, an engine's replica): it gets each block
    together with a small progress record, `progress_for(key, durable_positions)` (the record's key and
    bytes, saying what is durable once that block is), and LMDB commits both in one transaction.
    `run` goes into every block key (`BlockKey.run`): the engine names each generation's blocks apart.
    On the CPU the sink gets prefill blocks as `codec.KVPair`s (the layer's keys and values as the cache keeps
    them, not stacked) and full decode blocks as `codec.HostBlock`s (the staging buffer, described once);
    `block.tensor` is the block as a tensor. Stores and transports encode them with plain buffer copies. On a
    GPU, blocks are device tensors.
    """

    def __init__(self, sink: BlockSink | ProgressSink, stream_id: str, layers: int, *, replicate_every: int = 1,
                 replicate_within_ms: float | None = None, prompt_streaming: str = "layerwise",
                 queue_size: int = 8, on_replica_error: str = "raise",
                 on_durable: Callable[[BlockKey], None] | None = None, durable: Sequence[BlockKey] = (),
                 durable_positions: int = 0,
                 progress_for: Callable[[BlockKey, int], tuple[ProgressKey, bytes]] | None = None,
                 run: str = "") -> None:
        if not isinstance(replicate_every, int) or replicate_every < 1:
            raise ConfigError(f"replicate_every must be a positive integer, got {replicate_every!r}")
        if on_replica_error not in ("raise", "warn"):
            raise ConfigError(f"on_replica_error must be 'raise' or 'warn', got {on_replica_error!r}")
        self.replicate_within_ms = check_replicate_within_ms(replicate_within_ms)
        self.sink, self.stream_id, self.layers = sink, stream_id, layers
        self.run = check_run(run)
        self.replicate_every, self.on_replica_error = replicate_every, on_replica_error
        if prompt_streaming not in ("layerwise", "after"):
            raise ConfigError(f"prompt_streaming must be 'layerwise' or 'after' here (resolve 'auto' with "
                              f"prompt_streaming_for), got {prompt_streaming!r}")
        self.prompt_streaming = prompt_streaming
        self._within = None if replicate_within_ms is None else replicate_within_ms / 1000
        self.durable: list[BlockKey] = list(durable)  # blocks the sink has accepted, in hand-off order
        self._layer_ends = [durable_positions] * layers  # per layer, positions [0, end) are durable
        self._on_durable = on_durable
        if progress_for is not None and not isinstance(sink, ProgressSink):
            raise ConfigError(f"progress_for needs a ProgressSink (a store or the local transport); "
                              f"{type(sink).__name__} is not one, so record progress from on_durable instead")
        self._progress_for = progress_for
        # One write for several blocks, with their progress records or without
        self._group_sink = sink if isinstance(sink, GroupSink) else None
        self._block_group_sink = sink if isinstance(sink, BlockGroupSink) else None
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
        self._first_buffered = 0.0  # when the staged block's first step was buffered (perf_counter seconds)
        self._last_buffered: float | None = None  # when the last decode step was
        self._prompt: list[Entry] = []  # prompt_streaming="after": the prompt's blocks, until the last layer's
        self._error: BaseException | None = None
        self._warned = False
        self._finished = False
        self._thread = threading.Thread(target=self._stream, name=f"{STREAMER} {stream_id}", daemon=True)
        self._thread.start()

    # ---- called from the model's forward -------------------------------------------------
    def observe(self, layer: int, keys: torch.Tensor, values: torch.Tensor, first_position: int) -> None:
        """See layer `layer`'s new KV `[B, H_kv, T, D]` for positions from `first_position` on.

        Several positions (a prompt) on the CPU are not copied: the tensors are written as they are when the
        streamer gets to them, so nothing may write into them afterwards (a `DynamicCache` replaces its
        tensors on update, never changes them; copy a buffer that is reused). A single position is copied
        into the staging buffer at once."""
        if self._error is not None:  # raises, or with on_replica_error="warn" no longer replicates this stream
            self._drop_held()
            self._check()
            return
        if keys.shape[-2] > 1:  # prefill: this layer's block leaves now, or with the last layer's
            if layer == 0 and self._filled:  # decode steps staged before it go first: blocks leave in order
                self._hand_off_staging()
            block: torch.Tensor | KVPair = KVPair.of(keys, values) if keys.device.type == "cpu" else \
                torch.stack((keys.detach(), values.detach())).unsqueeze(0)  # a device copy, off the graph
            key = BlockKey.for_layer(self.stream_id, layer, first_position, keys.shape[-2], self.run)
            if self.prompt_streaming == "layerwise":
                self._hand_off([(key, block)])
                return
            self._prompt.append((key, block))
            if layer == self.layers - 1:
                self._hand_off_prompt()
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
        now = time.perf_counter()
        step, self._last_buffered = now - (self._last_buffered or now), now
        if self._filled == 1:
            self._first_buffered = now
        # Leave when full, or when waiting for one more step (as long as this one) would keep the first
        # step's KV back longer than replicate_within_ms.
        if self._filled == self.replicate_every or (
                self._within is not None and now - self._first_buffered + step >= self._within):
            self._hand_off_staging()

    def _drop_held(self) -> None:
        """Let go of what was never handed off (after an error: it will not be written)."""
        self._prompt, self._staging, self._step_slices, self._filled = [], None, [], 0

    def _hand_off_prompt(self) -> None:
        entries, self._prompt = self._prompt, []
        if entries:
            self._hand_off(entries)

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
        if filled < self.replicate_every:  # part full (the stream's last block, or replicate_within_ms)
            part = staging.buffer[:, :, :, :, :filled].contiguous()  # a small copy; the buffer is free again
            self._free.put(staging)
            self._hand_off([(key, HostBlock.of(part) if part.device.type == "cpu" else part)])
            return
        block = staging.host_block if staging.host_block is not None else staging.buffer
        self._hand_off([(key, block)], lambda: self._free.put(staging))

    def _hand_off(self, entries: list[Entry], done: Callable[[], None] | None = None) -> None:
        ready = []  # device blocks are not to be read before they are computed: an event on each device
        for device in dict.fromkeys(block.device for _, block in entries
                                    if isinstance(block, torch.Tensor) and block.device.type == "cuda"):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            ready.append(event)
        self._tickets.get()  # blocks when the streamer is `queue_size` hand-offs behind: back-pressure
        self._queue.put((entries, ready, done))

    # ---- the streamer thread ---------------------------------------------------------------
    def _stream(self) -> None:
        stopping = False
        while not stopping:
            items = [self._queue.get()]
            while items[-1] is not _STOP and not self._queue.empty():  # group commit: what waits goes too
                items.append(self._queue.get_nowait())
            if items[-1] is _STOP:
                stopping = True
                items.pop()
            if items:
                self._write(items)

    def _write(self, items: list[tuple[list[Entry], Any, Callable[[], None] | None]]) -> None:
        """Write the entries of `items`, in order, in requests of up to `GROUP_BYTES` each (one per block for
        a sink that takes one at a time); each block counts as durable once its request is accepted."""
        entries = [entry for item_entries, _, _ in items for entry in item_entries]
        try:
            for _, ready, _ in items:
                for event in ready:
                    event.synchronize()
            for group in _groups(entries):
                if self._error is None:
                    self._write_group(group)
        except BaseException as error:  # surfaced to the model's thread by _check and finish
            self._error = ReplicationError(f"replicating {', '.join(str(key) for key, _ in entries)} failed: "
                                           f"{error}")
            self._error.__cause__ = error
        finally:
            for _, _, done in items:
                if done is not None:
                    done()
                self._tickets.put(None)

    def _write_group(self, group: list[Entry]) -> None:
        steps, ends = [], self._layer_ends
        for key, block in group:
            ends = _advanced(ends, key)
            steps.append((key, block, ends))
        if len(steps) > 1 and self._progress_for is not None and self._group_sink is not None:
            self._group_sink.flush_group_with_progress([(key, block, *self._progress_for(key, min(ends)))
                                                        for key, block, ends in steps])
        elif len(steps) > 1 and self._progress_for is None and self._block_group_sink is not None:
            self._block_group_sink.flush_group([(key, block) for key, block, _ in steps])
        else:
            self._write_each(steps)
            return
        for key, _, ends in steps:
            self._record_durable(key, ends)

    def _write_each(self, steps: list[tuple[BlockKey, Any, list[int]]]) -> None:
        for key, block, ends in steps:  # one request each: each block durable as it is accepted
            if self._progress_for is None:
                self.sink.flush(key, block)  # type: ignore[union-attr]
            else:
                progress, record = self._progress_for(key, min(ends))
                self.sink.flush_with_progress(key, block, progress, record)  # type: ignore[union-attr]
            self._record_durable(key, ends)

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
            if self._error is None:
                if self._filled:
                    self._hand_off_staging()
                self._hand_off_prompt()  # a forward that stopped before its last layer (after the steps before it)
            self._drop_held()
            self._queue.put(_STOP)
            self._thread.join()
            self._finished = True
            if self._error is not None:
                if self.on_replica_error == "raise":
                    raise self._error
                warnings.warn(f"{self._error}; stream {self.stream_id} is not fully replicated", stacklevel=2)
        return list(self.durable)


def _groups(entries: list[Entry]) -> list[list[Entry]]:
    """`entries` in order, cut into runs of at most `GROUP_BYTES` (a larger block alone)."""
    groups: list[list[Entry]] = []
    size = GROUP_BYTES
    for key, block in entries:
        nbytes = _nbytes(block)
        if size + nbytes > GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((key, block))
        size += nbytes
    return groups


def _nbytes(block: Any) -> int:
    if isinstance(block, HostBlock):
        return block.data.nbytes
    if isinstance(block, KVPair):
        return block.nbytes
    return block.numel() * block.element_size() if isinstance(block, torch.Tensor) else len(block)


def prompt_streaming_for(device: torch.device | str, choice: str = "auto") -> str:
    """What `choice` means for a model on `device`: "auto" streams the prompt layer by layer where the
    streamer has something of its own to run on, else after the forward.

    Layer by layer hides the prompt's writes behind the forward only if they do not take the forward's own
    resources: on a GPU the forward runs on the device while the streamer writes from the host (and holding
    the prompt's KV twice would take device memory); on a CPU, when the process may use a core beyond
    torch's threads. Otherwise each write takes the forward's time, and many small ones (a short prompt's
    layers) cost more than a few large ones: on two cores, writing SmolLM2's 30 layers of a 32-token prompt
    one by one made the call 20-24% longer, after the forward 6-7% (at 512 tokens both about 4%).
    """
    if check_prompt_streaming(choice) != "auto":
        return choice
    if torch.device(device).type != "cpu":
        return "layerwise"
    return "layerwise" if usable_cores() > torch.get_num_threads() else "after"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the system says (Linux; every core
    elsewhere), and no more than a container's CPU quota (cgroup v2 `cpu.max`) allows."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as limit:
            quota, period = limit.read().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 here, or no quota
        pass
    return cores


def check_replicate_within_ms(value: float | None) -> float | None:
    """`value` if it is None or a positive number of milliseconds, else ConfigError."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value < math.inf):
        raise ConfigError(f"replicate_within_ms must be a positive, finite number of milliseconds or None, got "
                          f"{value!r}")
    return value


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
        new = key_states.shape[-2]
        first_position = self.get_seq_length(layer_idx) if layer_idx < len(self.layers) else 0
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if new == 0:  # no position: nothing to stream
            return keys, values
        if new == 1:  # a decode step: copied into the staging buffer at once
            self.manager.observe(layer_idx, key_states, value_states, first_position)
        else:  # a prompt: the positions as the cache now holds them, the end of tensors that an update replaces
            # and never changes (the very tensors it keeps, contiguous and alive anyway, rather than the model's
            # states, which the streamer would keep alive beside them until written)
            held = keys.shape[-2]
            self.manager.observe(layer_idx, keys if held == new else keys[:, :, held - new:],
                                 values if held == new else values[:, :, held - new:], first_position)
        return keys, values

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
