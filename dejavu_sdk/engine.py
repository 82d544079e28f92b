"""`DejaVuEngine`: generate with any Hugging Face causal LM while its KV cache streams to a replica.

Who calls what:
- users call `generate` (like `model.generate`, greedy), `resume` in a new process after a crash,
  `cache` for custom loops, `forget` to drop a stream, and `close`;
- `generate` writes the stream's manifest, then runs `model.generate` with a `StreamingCache`; its
  `CacheManager` streams each block to the engine's replica (`dejavu_sdk.replica`, picked once at
  construction) together with a small progress record (the tokens since the previous one, what is durable
  once that block is): a step's writes stay the same size however long the generation. Each `generate` is one *run*
  with its own run id, written into its manifest and into the name of every block it streams, so the
  blocks of two generations under one stream id never share a name and are never mixed;
- `resume` reads the manifest and its progress log (checked whole: they name only blocks of their own
  stream and run), checks the model's geometry, rebuilds the durable cache with `gather`, rewrites the
  manifest whole under a new progress log, and lets `model.generate` recompute only the positions after
  the last durable one; it continues the manifest's run.
"""

from __future__ import annotations

import base64
import secrets
import threading
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import attrs
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from .backends import open_store
from .blocks import BlockKey, KVSpec, ProgressKey, check_stream_id, dtype_name
from .cache import CacheManager, StreamingCache, check_prompt_streaming, check_replicate_within_ms, prompt_streaming_for
from .errors import BlockNotFound, ConfigError, CorruptBlock
from .manifest import Manifest, encode_progress, with_stored_progress
from .prefix.keys import CHUNK_POSITIONS, check_salt
from .prefix.reuse import PrefixReuse, Tiers
from .replica import OneStoreReplica, SplitReplica, open_replica
from .store import Store
from .stream import check_tiling, gather
from .transports.base import Transport

if TYPE_CHECKING:
    from .generation.batching import Result


class _ManagerOptions(TypedDict):
    """The CacheManager options an engine passes to every stream's manager."""

    replicate_every: int
    replicate_within_ms: float | None
    queue_size: int
    on_replica_error: str


class DejaVuEngine:
    """Wraps `model`; `store` (URL or Store) holds replicas, `transport` moves blocks there (default local).

    Without a store the engine is `model.generate` and nothing more. `keep_finished=False` deletes a
    stream's blocks and manifest once its generation completes; `forget` deletes them at any time.

    How far the replica may lag, and so what a resume computes again (both recorded in the manifest):
    a block holds at most `replicate_every` decode steps, and leaves at the end of the first step that
    ends `replicate_within_ms` after its first step was buffered (None: only when full). The default,
    every step its own block, is the paper's. `prompt_streaming`: "layerwise" streams each prompt layer
    while the next computes, "after" writes the prompt's layers together once the last is made, "auto"
    picks layer by layer only where the streamer has a core or device of its own to run on
    (`dejavu_sdk.cache.prompt_streaming_for`, recorded in the manifest).

    `prefix_cache` (a store URL, a `Store`, a list of them fastest first, such as
    `["memory://?max_bytes=2GiB", "lmdb:///var/kv"]`, or a `dejavu_sdk.prefix.PrefixCache`) keeps every prompt's
    KV in chunks of `prefix_chunk` positions keyed by their tokens, and starts a prompt from the chunks it finds
    there (`dejavu_sdk.prefix`): prompts are then prefilled chunk by chunk at those boundaries, and the tokens are
    exactly those of `model.generate(..., prefill_chunk_size=prefix_chunk)`. `cached_positions` says how many
    positions the last `generate` read from it.
    """

    def __init__(self, model: Any, store: str | Store | None = None, transport: str | Transport = "local", *,
                 replicate_every: int = 1, replicate_within_ms: float | None = None, prompt_streaming: str = "auto",
                 queue_size: int = 8, on_replica_error: str = "raise", keep_finished: bool = False,
                 prefix_cache: Tiers | None = None, prefix_chunk: int = CHUNK_POSITIONS) -> None:
        self.model = model
        self.config = model.config.get_text_config(decoder=True)
        if store is None and transport != "local":
            raise ConfigError("a transport needs a store for the stream's manifest; pass store=... as well")
        self.options: _ManagerOptions = {"replicate_every": replicate_every,
                                         "replicate_within_ms": check_replicate_within_ms(replicate_within_ms),
                                         "queue_size": queue_size, "on_replica_error": on_replica_error}
        self.prompt_streaming = check_prompt_streaming(prompt_streaming)
        self.store = open_store(store) if store is not None else None
        self.replica = open_replica(self.store, transport) if self.store is not None else None
        self.keep_finished = keep_finished
        self._refuse_non_kv_layers()
        self.prefix = PrefixReuse.of(model, prefix_cache, prefix_chunk) if prefix_cache is not None else None
        self.cached_positions = 0

    # ---- public API --------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int | None = None, stream_id: str | None = None, replace: bool = False,
                 seed: int | None = None, cache_salt: str = "", **kwargs: Any) -> torch.Tensor:
        """`model.generate(input_ids, ...)`, with the KV cache replicated as it is produced.

        Greedy by default. With `do_sample=True` (and `temperature`, `top_k`, `top_p`, `min_p`,
        `repetition_penalty`, ...), the result equals `torch.manual_seed(seed)` followed by
        `model.generate(...)` with the same settings; without `seed` the engine draws one and records it.
        A sampled stream resumes exactly too: the progress record of each durable step carries the
        generator's state. Beam search, several sequences per prompt and assisted decoding are refused.

        A stream id names one generation at a time. If `stream_id` already has a manifest in the store (an
        unfinished generation, or a finished one kept with `keep_finished=True`), this raises ConfigError
        rather than destroy it: `resume` it, `forget` it, or pass `replace=True` to delete it and start over.

        `cache_salt` keeps the prefix chunks of one tenant apart from another's (with `prefix_cache`).
        """
        _refuse_unreplicable(kwargs)
        sampling = self._sampling(kwargs, seed)
        check_salt(cache_salt)
        self.cached_positions = 0
        if self.store is None:
            if sampling is not None:
                torch.manual_seed(sampling["seed"])
            if self.prefix is None:
                return self.model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                           do_sample=sampling is not None, **_settings(sampling), **kwargs)
            out, self.cached_positions = self.prefix.generate(
                self.model, input_ids, attention_mask, cache_salt, max_new_tokens=max_new_tokens,
                do_sample=sampling is not None, **_settings(sampling), **kwargs)
            return out
        stream_id = check_stream_id(stream_id or f"stream-{uuid.uuid4().hex[:12]}")
        if not isinstance(replace, bool):
            raise ConfigError(f"replace must be True or False, got {replace!r}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        eos, pad = self._special_tokens(kwargs)
        rows = input_ids.shape[0]
        manifest = Manifest(stream_id=stream_id, run=uuid.uuid4().hex[:16], geometry=self._geometry(rows),
                            input_ids=input_ids.tolist(), attention_mask=attention_mask.to(torch.long).tolist(),
                            max_new_tokens=self._max_new_tokens(max_new_tokens), eos_token_id=eos, pad_token_id=pad,
                            replicate_every=self.options["replicate_every"],
                            replicate_within_ms=self.options["replicate_within_ms"],
                            prompt_streaming=prompt_streaming_for(self.model.device, self.prompt_streaming),
                            sampling=sampling)
        if sampling is not None:  # as torch.manual_seed(seed) before model.generate; the state goes with each step
            torch.manual_seed(sampling["seed"])
            manifest = attrs.evolve(manifest, rng=_encode_state(_state_bytes(self.model.device)))
        if replace:
            self.forget(stream_id)
        else:
            self._refuse_taken(stream_id)
        self.store.write_manifest(stream_id, manifest.to_bytes())
        return self._run(manifest, kwargs, resumed=False, salt=cache_salt)

    def generate_many(self, prompts: Sequence[Any], max_new_tokens: int | Sequence[int] = 32, *, microbatch: int = 4,
                      kv_budget_bytes: int | None = None, swapping: bool | str = "auto", do_sample: bool = False,
                      seed: int | None = None, batching: str = "static", max_prefill_tokens: int | None = None,
                      progress: bool = False, cache_salt: str = "", **settings: Any) -> list[Result]:
        """Serve many prompts `[T]` on this one model: microbatches of up to `microbatch` of them (in order,
        left-padded) decoded round robin, each request's `Result` (new tokens, and where it was served) in order.
        `max_new_tokens`: one limit for all, or one per prompt.

        `kv_budget_bytes` caps the device memory their KV caches take (None: no cap): a microbatch starts only
        once its cache fits. `swapping=True` keeps every microbatch's cache in host memory and two on the
        device, brought in while the previous one computes, so about twice as many fit; `"auto"` swaps when the
        caches do not all fit, the model is on a GPU and the planner's condition says the copies keep up (logged).
        Decoding as in `Pipeline.submit` (greedy, or `do_sample` with `seed`, `temperature`, `top_k`, `top_p`,
        `min_p`): a microbatch's tokens equal `model.generate` on it (on a GPU, sampled rows draw from a CPU generator
        seeded with `seed`: reproducible, but not `generate`'s GPU draws). The model is put in eval mode. These
        caches are not replicated to the engine's store: use `generate` for a replicated, resumable stream.

        `max_prefill_tokens` bounds the prompt positions a step prefills (None: a microbatch's prompts at once):
        a static microbatch then equals `model.generate(..., prefill_chunk_size=max_prefill_tokens // rows)`.
        `batching="continuous"` lets rows leave their microbatch (a slot) as they end and waiting prompts join it
        (their prompts prefilled beside its steps, at most `max_prefill_tokens` positions a step; None: at once);
        each `Result.schedule` then records the slot's rounds, and `dejavu_sdk.generation.replay` on them gives
        the same tokens. Admission then counts rows: a slot reserves its rows at its longest row's final length.

        With the engine's `prefix_cache`, a prompt prefilled alone (continuous batching takes them one at a time;
        a static microbatch of one) starts from the chunks it finds and keeps its new ones, under `cache_salt`;
        prompts are prefilled a chunk a round (`max_prefill_tokens` is `prefix_chunk`), and each result says
        how many positions it read (`Result.cached_positions`).
        """
        from .generation.decoding import Decoding
        from .generation.roundrobin import RoundRobin

        asked = sorted(name for name in ("logprobs", "prompt_logprobs") if settings.get(name) is not None)
        if asked:
            raise ConfigError(f"{', '.join(asked)}: a pipeline (dejavu_sdk.serving.Pipeline) reports them, "
                              "generate_many does not")
        check_salt(cache_salt)
        runner = RoundRobin(self.model, microbatch=microbatch, kv_budget_bytes=kv_budget_bytes, swapping=swapping,
                            batching=batching, max_prefill_tokens=max_prefill_tokens, progress=progress,
                            prefix=self.prefix, salt=cache_salt)
        return runner.run(runner.requests(prompts, max_new_tokens, Decoding.of(do_sample, seed, **settings)))

    def resume(self, stream_id: str, **kwargs: Any) -> torch.Tensor:
        """Finish an interrupted `generate` of `stream_id`: same result, only the undurable steps recomputed.

        A sampled stream continues from its recorded generator state, with its recorded settings; settings
        given here must agree with them, and a stream recorded by other library versions or on another
        kind of device is refused, since it could not be resumed exactly.
        """
        _refuse_unreplicable(kwargs)
        store = self._require_store()
        try:
            data = store.read_manifest(check_stream_id(stream_id))
        except BlockNotFound:
            raise BlockNotFound(f"stream {stream_id} has no manifest in {store.url}: it never started there, or it "
                                "finished and was deleted (keep_finished=False)") from None
        manifest = with_stored_progress(store, Manifest.from_bytes(data, stream_id))
        manifest.check_geometry(self._geometry(len(manifest.input_ids)))
        _check_resumable_sampling(manifest, kwargs, self.model.device)
        return self._run(manifest, kwargs, resumed=True)

    def cache(self, stream_id: str) -> StreamingCache:
        """A streaming transformers cache for custom loops: `model(ids, cache=cache)`, then
        `cache.manager.finish()` to wait until every block is durable."""
        manager = CacheManager(self._require_replica().blocks, check_stream_id(stream_id),
                               self.config.num_hidden_layers, **self.options,
                               prompt_streaming=prompt_streaming_for(self.model.device, self.prompt_streaming))
        return StreamingCache(manager, config=self.model.config)

    def forget(self, stream_id: str) -> int:
        """Delete a stream's blocks and manifest; returns how many blocks were deleted."""
        return self._require_replica().delete(check_stream_id(stream_id))

    def close(self) -> None:
        if self.prefix is not None:
            self.prefix.close()
        if self.replica is not None:
            self.replica.close()
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> DejaVuEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- one run of model.generate, fresh or resumed ----------------------------------------------
    def _run(self, manifest: Manifest, kwargs: dict[str, Any], resumed: bool, salt: str = "") -> torch.Tensor:
        prompt_ids = torch.tensor(manifest.input_ids)
        generated = torch.tensor(manifest.generated, dtype=prompt_ids.dtype).reshape(len(manifest.input_ids), -1)
        ids = torch.cat((prompt_ids, generated), dim=1).to(self.model.device)
        mask = torch.cat((torch.tensor(manifest.attention_mask), torch.ones_like(generated)), dim=1).to(ids.device)
        finished = _finished_rows(manifest.generated, manifest.eos_token_id)
        remaining = manifest.max_new_tokens - generated.shape[1]
        if manifest.finished or remaining <= 0 or (finished and all(finished)):
            self._complete(manifest)
            return ids
        restored, restored_keys = self._restorable(manifest, limit=ids.shape[1] - 1)
        if resumed:  # the blocks past the restored prefix are streamed again: the manifest must not name them;
            # they stream with this engine's settings, which the manifest then records
            manifest = self._rewrite_manifest(attrs.evolve(
                manifest, blocks=[str(key) for key in restored_keys], durable_positions=restored,
                replicate_every=self.options["replicate_every"],
                replicate_within_ms=self.options["replicate_within_ms"],
                prompt_streaming=prompt_streaming_for(self.model.device, self.prompt_streaming)))
        recorder = _TokenRecorder(manifest, self.model.device)
        manager = CacheManager(self._require_replica(), manifest.stream_id, self.config.num_hidden_layers,
                               durable=restored_keys, durable_positions=restored, on_durable=recorder.note_durable,
                               progress_for=recorder.progress_after, run=manifest.run,
                               replicate_every=manifest.replicate_every,  # as the manifest says
                               replicate_within_ms=manifest.replicate_within_ms,
                               prompt_streaming=manifest.prompt_streaming, queue_size=self.options["queue_size"],
                               on_replica_error=self.options["on_replica_error"])
        cache = StreamingCache(manager, config=self.model.config)
        if restored:
            cache.restore(self._fetch_cache(manifest, restored_keys, restored).to(self.model.device))
        elif self.prefix is not None and not resumed:  # streamed on to the replica as a computed prompt would be
            self.cached_positions = self.prefix.restore(prompt_ids.to(ids.device), mask[:, :prompt_ids.shape[1]],
                                                        cache, salt)
        if self.prefix is not None:
            kwargs = self.prefix.generate_options(kwargs)
        extra = _keep_finished_rows_padded(finished, manifest.pad_token_id) if any(finished) else {}
        if manifest.sampling is not None:  # continue from the state right after the last recorded token
            _set_generator_state(self.model.device, _decode_state(manifest))
        try:
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=remaining,
                                      do_sample=manifest.sampling is not None, **_settings(manifest.sampling),
                                      cache=cache, streamer=recorder, eos_token_id=manifest.eos_token_id or None,
                                      pad_token_id=manifest.pad_token_id, **extra, **kwargs)
        finally:
            manager.finish()
        if self.prefix is not None and not resumed:
            self.prefix.keep(prompt_ids, mask[:, :prompt_ids.shape[1]], cache, self.cached_positions, salt)
        self._complete(recorder.final(manager.durable_positions))
        return out

    def _restorable(self, manifest: Manifest, limit: int) -> tuple[int, list[BlockKey]]:
        """The longest prefix of at most `limit` positions that durable blocks tile exactly, and those blocks.

        A prefix must leave at least one known token to feed the model, so it may end before the last
        durable position; the positions after it are recomputed.
        """
        keys = manifest.block_keys
        ends = sorted({key.tokens[1] for key in keys if key.tokens[1] <= min(limit, manifest.durable_positions)},
                      reverse=True)
        for end in ends:
            inside = [key for key in keys if key.tokens[1] <= end]
            try:
                check_tiling(inside, (0, self.config.num_hidden_layers), (0, end))
            except ConfigError:
                continue
            return end, inside
        return 0, []

    def _fetch_cache(self, manifest: Manifest, keys: list[BlockKey], positions: int) -> torch.Tensor:
        geometry = manifest.geometry
        spec = KVSpec(layers=geometry["layers"], kv_heads=geometry["kv_heads"], head_dim=geometry["head_dim"],
                      dtype=geometry["dtype"], batch=geometry["batch"])
        try:
            return gather(self._require_replica().blocks, keys, spec, positions)
        except BlockNotFound as error:
            raise BlockNotFound(f"stream {manifest.stream_id} cannot be resumed: {error}") from error

    def _rewrite_manifest(self, manifest: Manifest) -> Manifest:
        """Write `manifest` whole, under a new progress log, then drop the records of the older logs (which
        it already holds, or no longer wants; until they are gone, readers ignore them)."""
        store = self._require_store()
        manifest = attrs.evolve(manifest, log=manifest.log + 1)
        store.write_manifest(manifest.stream_id, manifest.to_bytes())
        store.remove_progress(manifest.stream_id, manifest.run, below_log=manifest.log)
        return manifest

    def _complete(self, manifest: Manifest) -> None:
        if self.keep_finished:
            self._rewrite_manifest(attrs.evolve(manifest, finished=True))
        else:  # only this run's own: a run started under the same id meanwhile keeps its blocks and manifest
            self._require_replica().delete_run(manifest.stream_id, manifest.run)

    def _refuse_taken(self, stream_id: str) -> None:
        """ConfigError if `stream_id` already has a manifest: generate must not silently destroy a stream."""
        store = self._require_store()
        try:
            finished: bool | None = Manifest.from_bytes(store.read_manifest(stream_id), stream_id).finished
        except BlockNotFound:
            return
        except (ConfigError, CorruptBlock):
            finished = None
        options = (f"delete it with engine.forget({stream_id!r}), or pass replace=True to generate to delete it and "
                   "start over")
        if finished is None:
            state = (f"a manifest this SDK cannot resume (damaged or of another format; engine.resume({stream_id!r}) "
                     "says why)")
        elif finished:
            state = (f"a finished generation kept with keep_finished=True (engine.resume({stream_id!r}) returns "
                     "its tokens)")
        else:
            state = f"an unfinished generation (continue it with engine.resume({stream_id!r}))"
        raise ConfigError(f"stream {stream_id} already holds {state} in {store.url}; {options}. A stream id names "
                          "one generation at a time")

    # ---- the model --------------------------------------------------------------------------
    def _geometry(self, batch: int) -> dict[str, Any]:
        config = self.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return {"architecture": type(self.model).__name__, "layers": config.num_hidden_layers,
                "kv_heads": getattr(config, "num_key_value_heads", None) or heads, "head_dim": head_dim,
                "dtype": dtype_name(self.model.dtype), "batch": batch}

    def _refuse_non_kv_layers(self) -> None:
        layer_types = getattr(self.config, "layer_types", None) or []
        odd = sorted({kind for kind in layer_types if kind not in ("full_attention", "sliding_attention")})
        if odd:
            raise ConfigError(f"{type(self.model).__name__} has {', '.join(odd)} layers, which keep no KV cache "
                              "to stream; DejaVuEngine supports attention-only models")

    def _sampling(self, kwargs: dict[str, Any], seed: int | None) -> dict[str, Any] | None:
        """What a sampled generation records (seed, settings in effect, versions, device); None for greedy.

        Takes `do_sample` and the sampling settings out of `kwargs`: they are passed on from the record,
        so a fresh run and a resumed one use the very same values.
        """
        if not kwargs.pop("do_sample", False):  # greedy unless asked, whatever the model's generation config says
            if seed is not None:
                raise ConfigError("seed= applies to sampling: pass do_sample=True as well, or drop seed")
            if any(name in kwargs for name in SAMPLING_SETTINGS):
                raise ConfigError(f"{', '.join(sorted(set(kwargs) & set(SAMPLING_SETTINGS)))} apply to sampling: "
                                  "pass do_sample=True as well")
            return None
        if seed is None:
            seed = secrets.randbits(62)
        elif not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise ConfigError(f"seed must be an integer from 0 to 2**63 - 1, got {seed!r}")
        config = self.model.generation_config
        settings = {name: kwargs.pop(name, getattr(config, name, None)) for name in SAMPLING_SETTINGS}
        for name, value in settings.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"{name} must be a number, got {value!r}")
        return {"seed": seed, "settings": settings, "versions": _versions(), "device": self.model.device.type}

    def _special_tokens(self, kwargs: dict[str, Any]) -> tuple[list[int], int | None]:
        generation_config = self.model.generation_config
        eos = kwargs.pop("eos_token_id", generation_config.eos_token_id)
        pad = kwargs.pop("pad_token_id", generation_config.pad_token_id)
        eos = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(token) for token in eos]
        return eos, (pad if pad is not None else (eos[0] if eos else None))

    def _max_new_tokens(self, value: int | None) -> int:
        value = value if value is not None else self.model.generation_config.max_new_tokens
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {value!r}")
        return value

    def _require_store(self) -> Store:
        if self.store is None:
            raise ConfigError("this engine has no store; create it with DejaVuEngine(model, store='lmdb:///path')")
        return self.store

    def _require_replica(self) -> OneStoreReplica | SplitReplica:
        if self.replica is None:
            raise ConfigError("this engine has no store; create it with DejaVuEngine(model, store='lmdb:///path')")
        return self.replica


#: Settings of `model.generate` that decide what a sampled token is; a sampled stream records each.
SAMPLING_SETTINGS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                     "repetition_penalty", "no_repeat_ngram_size")


def _refuse_unreplicable(kwargs: dict[str, Any]) -> None:
    """Refuse decoding that changes the cache other than by appending, or makes several sequences a row."""
    if (kwargs.get("num_beams") or 1) > 1:
        raise ConfigError(f"num_beams={kwargs['num_beams']!r}: beam search reorders the cache's rows at every "
                          "step, which DejaVuEngine does not replicate; use greedy decoding or do_sample=True")
    if (kwargs.get("num_return_sequences") or 1) > 1:
        raise ConfigError(f"num_return_sequences={kwargs['num_return_sequences']!r}: one stream replicates one "
                          "sequence per prompt row; repeat the prompt rows instead")
    for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"):
        if kwargs.get(name) is not None:
            raise ConfigError(f"{name}: assisted and speculative decoding crop the cache when a guess is rejected, "
                              "which DejaVuEngine does not replicate; decode without it")


def _settings(sampling: dict[str, Any] | None) -> dict[str, Any]:
    """The recorded sampling settings, as `model.generate` keyword arguments (none for greedy)."""
    if sampling is None:
        return {}
    return {name: value for name, value in sampling["settings"].items() if value is not None}


def _versions() -> dict[str, str]:
    """The libraries whose sampling a sampled stream reproduces: exact resume needs the same ones."""
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def _generator_state(device: torch.device) -> torch.Tensor:
    """The state of the generator that samples on `device` (torch's default generator for it)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _state_bytes(device: torch.device) -> bytes:
    """The generator's state as bytes, taken on the model's thread, so that the streamer thread only base64s
    them: a numpy call on a thread that wakes once per step costs tens of microseconds of cold code."""
    return _generator_state(device).numpy().tobytes()


def _encode_state(state: bytes) -> str:
    return base64.b64encode(state).decode()


def _decode_state(manifest: Manifest) -> torch.Tensor:
    state = torch.frombuffer(bytearray(base64.b64decode(manifest.rng)), dtype=torch.uint8)
    device = torch.device(manifest.sampling["device"] if manifest.sampling else "cpu")
    expected = _generator_state(device).numel()
    if state.numel() != expected:
        raise CorruptBlock(f"the manifest of stream {manifest.stream_id}: field 'rng' holds {state.numel()} bytes, "
                           f"not the {expected} of a generator state")
    return state


def _check_resumable_sampling(manifest: Manifest, kwargs: dict[str, Any], device: torch.device) -> None:
    """ConfigError unless this process can continue the stream's sampling exactly as it was recorded."""
    sampling = manifest.sampling
    do_sample = kwargs.pop("do_sample", None)
    if do_sample is not None and bool(do_sample) != (sampling is not None):
        raise ConfigError(f"stream {manifest.stream_id} was {'sampled' if sampling else 'greedy'}; resume it "
                          "as it started (do_sample is recorded; leave it out)")
    given = {name: kwargs.pop(name) for name in SAMPLING_SETTINGS if name in kwargs}
    if sampling is None:
        if given:
            raise ConfigError(f"stream {manifest.stream_id} is greedy: {', '.join(sorted(given))} do not apply")
        return
    differing = {name: value for name, value in given.items() if sampling["settings"].get(name) != value}
    if differing:
        raise ConfigError(f"stream {manifest.stream_id} was sampled with {sampling['settings']}; resuming with "
                          f"{differing} would not continue it exactly (the settings are recorded; leave them out)")
    if sampling["versions"] != _versions():
        raise ConfigError(f"stream {manifest.stream_id} was sampled with {sampling['versions']}, this process has "
                          f"{_versions()}: its samples cannot be reproduced exactly here; resume it with the "
                          "versions that started it, or generate it again")
    if sampling["device"] != device.type:
        raise ConfigError(f"stream {manifest.stream_id} was sampled on {sampling['device']}, the model is on "
                          f"{device.type}: their generators differ, so the samples would too")


def _finished_rows(generated: list[list[int]], eos: list[int]) -> list[bool]:
    return [any(token in eos for token in row) for row in generated] if generated and eos else []


class _TokenRecorder:
    """A `generate` streamer: keeps the tokens of each step, and gives the progress record of each block."""

    def __init__(self, manifest: Manifest, device: torch.device) -> None:
        self.manifest = manifest
        self.tokens = [list(row) for row in manifest.generated]
        # Sampled streams: the generator's state right after the last token in `tokens`, taken as each
        # token arrives (a copy of a few kB), encoded only when a record carries it.
        self._device = device if manifest.sampling is not None else None
        self._state: bytes | None = None
        self._names = list(manifest.blocks)
        self._logged = len(self.tokens[0])  # tokens per row in the manifest and the records made so far
        self._next = manifest.progress_key(0)  # the next record of the manifest's progress log
        self._prompt_seen = False
        self._lock = threading.Lock()

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate first shows the whole input
            self._prompt_seen = True
            return
        state = _state_bytes(self._device) if self._device is not None else None
        with self._lock:
            for row, token in zip(self.tokens, value.reshape(-1).tolist(), strict=True):
                row.append(token)
            self._state = state

    def end(self) -> None:
        pass

    def progress_after(self, key: BlockKey, durable_positions: int) -> tuple[ProgressKey, bytes]:
        """The progress record that goes with `key`: the tokens since the last record, and the generator
        state after them. Runs on the streamer thread, once per block in the order they are written (several
        may be written together); its size does not depend on how long the stream is."""
        with self._lock:
            count, state = len(self.tokens[0]), self._state
            tokens = [row[self._logged:count] for row in self.tokens]
        rng = _encode_state(state) if state is not None and count > self._logged else ""
        progress, self._next, self._logged = self._next, self._next.next_step(), count
        return progress, encode_progress(str(key), durable_positions, tokens, rng)

    def note_durable(self, key: BlockKey) -> None:
        """Called on the streamer thread after each accepted block, whose progress record went with it."""
        self._names.append(str(key))

    def final(self, positions: int) -> Manifest:
        with self._lock:
            tokens, state = [list(row) for row in self.tokens], self._state
        rng = self.manifest.rng if state is None else _encode_state(state)
        return attrs.evolve(self.manifest, generated=tokens, blocks=list(self._names), durable_positions=positions,
                            rng=rng)


class _PadFinishedRows(LogitsProcessor):
    """Rows that ended before the crash keep producing padding, as they did in the first run."""

    def __init__(self, finished: torch.Tensor, pad_token_id: int) -> None:
        self.finished, self.pad_token_id = finished, pad_token_id

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows = self.finished.to(scores.device)
        scores = scores.masked_fill(rows[:, None], float("-inf"))
        scores[rows, self.pad_token_id] = 0.0
        return scores


class _FinishedRowsAreDone(StoppingCriteria):
    """...and count as done, so generation stops when the other rows do."""

    def __init__(self, finished: torch.Tensor) -> None:
        self.finished = finished

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.finished.to(input_ids.device)


def _keep_finished_rows_padded(finished: list[bool], pad_token_id: int | None) -> dict[str, Any]:
    if pad_token_id is None:
        raise ConfigError("resuming a batch where some rows already ended needs a pad_token_id")
    rows = torch.tensor(finished)
    return {"logits_processor": LogitsProcessorList([_PadFinishedRows(rows, pad_token_id)]),
            "stopping_criteria": StoppingCriteriaList([_FinishedRowsAreDone(rows)])}
