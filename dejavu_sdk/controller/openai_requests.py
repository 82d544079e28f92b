"""The OpenAI requests the controller answers, checked: `/v1/completions` and `/v1/chat/completions` bodies
become a `GenerationRequest` (the choices to generate, as token ids, their limits, decodings and stop strings),
or an `ApiError` that says what is wrong with the status a client understands.

Tokenizing (and rendering a chat's messages with the tokenizer's chat template, `chat_prompts`) happens here, so
the API runs `parse_*` off its event loop. What an error quotes of a request is short (`quoted`), however large the
value sent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import attrs

from ..errors import quoted
from ..generation.logprobs import MAX_LOGPROBS
from .api_errors import ApiError
from .chat_prompts import chat_prompt

#: Arguments of OpenAI's APIs that change the output and are not supported, with the values that change nothing
#: (sent by clients that fill in defaults).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
               "best_of": (None, 1), "suffix": (None, ""), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []),
               "functions": (None, []), "tool_choice": (None, "none"), "function_call": (None, "none"),
               "response_format": (None, {"type": "text"})}
#: Most stop strings a request may give, and longest (characters).
MAX_STOPS, MAX_STOP_LENGTH = 16, 256
#: Most choices a request may ask for (`n` times its prompts is also capped by the API's `max_prompts`).
MAX_N = 128
#: Longest `cache_salt` (characters): a tenant's name, not a payload.
MAX_SALT = 256


class ModelFacts(Protocol):
    """What checking a request needs to know of the model served."""

    model_id: str
    tokenizer: Any | None
    context: int | None

    @property
    def names(self) -> Sequence[str]:
        """Every name a client may use for it."""


@attrs.frozen
class Choice:
    """One choice to generate: its prompt's token ids, its limit of new tokens, its decoding (`Pipeline.submit`'s
    keyword arguments) and which prompt it continues."""

    prompt: list[int]
    max_tokens: int
    decoding: dict[str, Any]
    prompt_index: int


@attrs.frozen
class GenerationRequest:
    """A checked request: its choices (prompt by prompt, `n` each), stop strings, whether to stream, the model
    name to answer with (the one the client used), and its owner."""

    kind: Literal["completion", "chat"]
    model: str
    choices: list[Choice]
    prompts: list[list[int]]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    #: The top tokens listed beside each token's log-probability (None: no log-probabilities asked for).
    logprobs: int | None = None
    #: Completions: the answer's text (and log-probabilities) begin with the prompt's.
    echo: bool = False
    #: Streamed with the usage: every chunk carries the usage so far (`stream_options.continuous_usage_stats`).
    continuous_usage: bool = False
    #: The owner id of the client token that made it (`owners.owner_id`, never the token): only that token reads it
    #: back. None: no client's (journaled before requests had owners).
    owner: str | None = None
    #: The salt of the prompt prefixes it reads and keeps (`cache_salt` in its body; None: its owner's, so that
    #: one client cannot tell another's prompts from how fast its own are answered).
    cache_salt: str | None = None

    def salt(self) -> str:
        """The tenant its prompt prefixes are kept apart for."""
        return self.cache_salt if self.cache_salt is not None else self.owner or ""


def parse_completion(body: Any, facts: ModelFacts, max_prompts: int) -> GenerationRequest:
    """A `/v1/completions` body: `prompt` as a text, texts, token ids or lists of them."""
    model = _model(body, facts)
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and bool(prompt) and not _is_id(prompt[0])
    _check_count(len(prompt) if several else 1, body, max_prompts)  # before any is tokenized
    prompts = _prompts(prompt, facts.tokenizer)
    logprobs = None if body.get("logprobs") is False else _integer(body, "logprobs", None, minimum=0,
                                                                    maximum=MAX_LOGPROBS)
    echo = _flag(body, "echo")
    if echo and _flag(body, "stream"):
        raise ApiError(400, "echo is answered whole: send it without stream")
    scores = {} if logprobs is None else {"logprobs": logprobs, **({"prompt_logprobs": logprobs} if echo else {})}
    return _request("completion", model, body, prompts, facts, max_prompts, default_max=16, scores=scores,
                    echo=echo)


def parse_chat(body: Any, facts: ModelFacts, max_prompts: int) -> GenerationRequest:
    """A `/v1/chat/completions` body: `messages` rendered with the tokenizer's chat template, the assistant's turn
    opened (`chat_prompt`: roles the template handles, special tokens in content as text);
    `max_completion_tokens` (or the older `max_tokens`) defaults to the rest of the context."""
    model = _model(body, facts)
    tokenizer = facts.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, f"the model {model!r} has no chat template: use /v1/completions")
    prompt = chat_prompt(tokenizer, body.get("messages"))
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    if body.get("echo") not in (None, False):
        raise ApiError(400, "echo is a /v1/completions argument")
    top = _integer(body, "top_logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
    if top is not None and not _flag(body, "logprobs"):
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true")
    scores = {"logprobs": top or 0} if _flag(body, "logprobs") else {}
    return _request("chat", model, body, [prompt], facts, max_prompts, default_max=None, scores=scores)


def _request(kind: Literal["completion", "chat"], model: str, body: dict[str, Any], prompts: list[list[int]],
             facts: ModelFacts, max_prompts: int, default_max: int | None, scores: dict[str, int],
             echo: bool = False) -> GenerationRequest:
    for name, neutral in UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            raise ApiError(400, f"{name}={quoted(body[name])} is not supported")
    n = _check_count(len(prompts), body, max_prompts)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise ApiError(400, "'stream_options' is an object, and only with stream: true")
    include_usage = isinstance(options, dict) and _flag(options, "include_usage")
    continuous = isinstance(options, dict) and _flag(options, "continuous_usage_stats")
    continuous_usage = include_usage and continuous  # as vLLM: only where the stream ends with the usage
    decoding = {**_decoding(body), **scores}
    choices = []
    for index, prompt in enumerate(prompts):
        limit = _max_tokens(body, default_max, len(prompt), facts.context)
        choices += [Choice(prompt, limit, _seeded(decoding, copy), index) for copy in range(n)]
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or len(salt) > MAX_SALT):
        raise ApiError(400, f"'cache_salt' must be a string of at most {MAX_SALT} characters, got {quoted(salt)}")
    return GenerationRequest(kind, model, choices, prompts, _stop(body.get("stop")), stream, include_usage,
                             scores.get("logprobs"), echo, continuous_usage=continuous_usage, cache_salt=salt)


def _check_count(prompts: int, body: dict[str, Any], max_prompts: int) -> int:
    """The request's `n`, once its choices (prompts times n) are within `max_prompts` (a 400 otherwise)."""
    n = _integer(body, "n", 1, minimum=1, maximum=MAX_N)
    if prompts * n > max_prompts:
        raise ApiError(400, f"{prompts} prompts x n={n} choices is more than the {max_prompts} this server takes in "
                       "one request (--max-prompts)")
    return int(n)


def _model(body: Any, facts: ModelFacts) -> str:
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' is required: the id GET /v1/models lists")
    if model not in facts.names:
        raise ApiError(404, f"the model {quoted(model)} is not served here; this controller serves "
                       f"{', '.join(map(repr, facts.names))}", "not_found_error", "model_not_found")
    return model


def _max_tokens(body: dict[str, Any], default: int | None, prompt_length: int, context: int | None) -> int:
    """The request's `max_tokens`; null (or absent where the default is null): up to the model's context."""
    value = body.get("max_tokens", default)
    if value is None:
        if context is None:
            raise ApiError(400, "'max_tokens' is needed: the model does not say how long its context is")
        if prompt_length >= context:
            raise ApiError(400, f"the prompt's {prompt_length} tokens fill the model's context of {context}")
        return context - prompt_length
    return _integer(body, "max_tokens", default, minimum=1)


def _prompts(prompt: Any, tokenizer: Any | None) -> list[list[int]]:
    """The prompts as lists of token ids: text (tokenized), a list of texts, token ids, or lists of them."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        if tokenizer is None:
            raise ApiError(400, "this model is served without a tokenizer: send the prompt as token ids")
        texts = [prompt] if isinstance(prompt, str) else prompt
        return [list(tokenizer(text)["input_ids"]) for text in texts]
    if isinstance(prompt, list) and prompt and all(_is_id(token) for token in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(ids, list) and ids and all(_is_id(t) for t in ids)
                                                   for ids in prompt):
        return [list(ids) for ids in prompt]
    raise ApiError(400, "'prompt' must be a non-empty text, a list of texts, a list of token ids or a list of "
                   "such lists")


def _stop(stop: Any) -> tuple[str, ...]:
    """Stop strings: one text or a list of texts (empty ones mean nothing)."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(text, str) for text in stops):
        raise ApiError(400, "'stop' must be a text or a list of texts")
    if len(stops) > MAX_STOPS or any(len(text) > MAX_STOP_LENGTH for text in stops):
        raise ApiError(400, f"at most {MAX_STOPS} stop strings of up to {MAX_STOP_LENGTH} characters")
    return tuple(text for text in stops if text)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(body: dict[str, Any], name: str, default: int | None, minimum: int,
             maximum: int | None = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not _is_id(value) or value < minimum or (maximum is not None and value > maximum):
        within = f"of at least {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ApiError(400, f"{name!r} must be an integer {within}, got {quoted(value)}")
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high \
            or not math.isfinite(value):
        raise ApiError(400, f"{name!r} must be a number from {low} to {high}, got {quoted(value)}")
    return float(value)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name!r} must be true or false, got {quoted(value)}")
    return value


def _decoding(body: dict[str, Any]) -> dict[str, Any]:
    """Greedy at temperature 0; else sampled with the request's temperature, top_p, top_k and min_p (off unless
    given: OpenAI's API has none, and top_k -1 means off as in vLLM) from a generator seeded with `seed`
    (drawn by the pipeline when not given); the request's own ends (`_ends`). Ranges as vLLM checks them
    (`Decoding.of`: ConfigError, a 400)."""
    ends = _ends(body)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if temperature == 0:
        return {"do_sample": False, **ends}
    seed = body.get("seed")
    if seed is not None and (not _is_id(seed) or not -2**63 <= seed < 2**63):
        raise ApiError(400, f"'seed' must be an integer from -2**63 to 2**63 - 1, got {quoted(seed)}")
    return {"do_sample": True, "temperature": temperature, "top_p": body.get("top_p", 1.0),
            "top_k": body.get("top_k", 0), "min_p": body.get("min_p", 0.0), "seed": seed, **ends}


def _ends(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's extra ends: `stop_token_ids` (the row ends at any), `ignore_eos`, `min_tokens` (end ids masked
    until then); only those given, so that a pipeline without them sees the decoding it always saw."""
    ends: dict[str, Any] = {}
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_id(token) and token >= 0 for token in stop_ids):
            raise ApiError(400, f"'stop_token_ids' must be a list of token ids, got {quoted(stop_ids)}")
        if stop_ids:
            ends["stop_token_ids"] = stop_ids
    if _flag(body, "ignore_eos"):
        ends["ignore_eos"] = True
    min_tokens = _integer(body, "min_tokens", 0, minimum=0)
    if min_tokens:
        ends["min_tokens"] = min_tokens
    return ends


def _seeded(decoding: dict[str, Any], copy: int) -> dict[str, Any]:
    """Choice `copy` of a prompt samples from seed + copy (a request's own seed for its first choice), wrapping
    within a 64-bit generator's seeds; unseeded choices each draw their own."""
    if not decoding.get("do_sample") or decoding.get("seed") is None or copy == 0:
        return decoding
    return {**decoding, "seed": (decoding["seed"] + copy + 2**63) % 2**64 - 2**63}
