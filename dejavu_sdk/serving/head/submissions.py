"""The requests of one submission to a pipeline: every prompt and setting checked before any is queued."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import ConfigError
from ...generation.batching import Request, check_new_tokens, check_prompt
from ...generation.decoding import Decoding, TokenRules
from ...generation.logprobs import PromptLogprobs, TokenLogprobs
from ...prefix.keys import check_salt


def submission(prompts: Sequence[Any], max_new_tokens: int | Sequence[int], do_sample: bool,
               seed: int | Sequence[int | None] | None, on_token: Callable[[int, int], None] | None,
               on_logprobs: Callable[[int, TokenLogprobs | PromptLogprobs], None] | None, tags: Sequence[Any] | None,
               settings: dict[str, Any], rules: TokenRules) -> list[Request]:
    """A request per prompt, as `Pipeline.submit_all` describes them, one submission (admission takes turns
    between submissions); ConfigError for the first prompt or setting that `rules` (the model's) refuse."""
    salt = check_salt(settings.pop("cache_salt", ""))  # the prompt prefixes' tenant, not a decoding setting
    limits = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
    for name, given in (("max_new_tokens", limits), ("seed", seed), ("tags", tags)):
        if isinstance(given, Sequence) and len(given) != len(prompts):
            raise ConfigError(f"{name}= names {len(given)} prompts, not the {len(prompts)} given")
    if isinstance(seed, Sequence):
        decodings = [Decoding.of(do_sample, each, **settings) for each in seed]
    else:
        decodings = [Decoding.of(do_sample, seed, **settings)] * len(prompts)
    requests: list[Request] = []
    for index, (ids, decoding) in enumerate(zip(prompts, decodings, strict=True)):
        prompt = check_prompt(ids, rules.context, rules.vocabulary)
        limit = check_new_tokens(limits[index], prompt.numel(), rules.context)
        check_decoding(decoding, limit, rules)
        listener = None if on_token is None else functools.partial(on_token, index)
        scores = None if on_logprobs is None else functools.partial(on_logprobs, index)
        request = Request(prompt, limit, decoding, on_token=listener, on_logprobs=scores,
                          tag=None if tags is None else tags[index], cache_salt=salt)
        if requests:
            request.group = requests[0].group
        requests.append(request)
    return requests


def check_decoding(decoding: Decoding, max_new_tokens: int, rules: TokenRules) -> None:
    """ConfigError for a decoding the model of `rules` cannot serve: sampling it refuses, stop ids outside its
    vocabulary, more `min_tokens` than new tokens."""
    if decoding.do_sample and rules.sampling_refused is not None:
        raise rules.sampling_refused
    outside = [token for token in decoding.ends.stop_token_ids if token >= rules.vocabulary]
    if outside:
        raise ConfigError(f"stop_token_ids {outside} are outside the model's vocabulary of {rules.vocabulary}")
    if decoding.ends.min_tokens > max_new_tokens:
        raise ConfigError(f"min_tokens ({decoding.ends.min_tokens}) is more than max_new_tokens ({max_new_tokens})")
