"""vLLM's text routes beside the OpenAI API: `POST /tokenize` (a text, or chat messages as `/v1/chat/completions`
renders them), `POST /detokenize` and `GET /tokenizer_info`. Tokenizing runs on the API's text threads."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

from aiohttp import web

from .api_errors import ApiError
from .bodies import json_body
from .openai_requests import ModelFacts, parse_chat


async def tokenize(request: web.Request, backend: ModelFacts, text_threads: Executor) -> web.Response:
    """{"prompt": text, "add_special_tokens": true} or {"messages": [...]} (rendered as a chat is, the assistant's
    turn opened): the token ids, their count and the model's context."""
    body = await json_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    tokens = await asyncio.get_running_loop().run_in_executor(text_threads, _tokens_of, body, backend)
    return web.json_response({"count": len(tokens), "max_model_len": backend.context, "tokens": tokens})


def _tokens_of(body: dict[str, Any], backend: ModelFacts) -> list[int]:
    tokenizer = _tokenizer(backend)
    if "messages" in body:
        chat = parse_chat({**body, "model": backend.model_id, "max_tokens": 1}, backend, 1)
        return chat.prompts[0]
    prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
    if not isinstance(prompt, str) or not isinstance(special, bool):
        raise ApiError(400, "'prompt' must be a text (and 'add_special_tokens' true or false)")
    return list(tokenizer(prompt, add_special_tokens=special)["input_ids"])


async def detokenize(request: web.Request, backend: ModelFacts, text_threads: Executor) -> web.Response:
    """{"tokens": [ids]}: their text."""
    body = await json_body(request)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    vocabulary = len(_tokenizer(backend))
    if not isinstance(tokens, list) or not all(isinstance(token, int) and not isinstance(token, bool)
                                               and 0 <= token < vocabulary for token in tokens):
        raise ApiError(400, f"'tokens' must be a list of token ids from 0 to {vocabulary - 1}")
    text = await asyncio.get_running_loop().run_in_executor(text_threads, _tokenizer(backend).decode, tokens)
    return web.json_response({"prompt": text})


async def tokenizer_info(_: web.Request, backend: ModelFacts) -> web.Response:
    """What a client needs to tokenize as the server does (vLLM's `/tokenizer_info`): the special tokens, the
    chat template and the context."""
    tokenizer = _tokenizer(backend)
    special = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return web.json_response({"tokenizer_class": type(tokenizer).__name__, **special,
                              "chat_template": getattr(tokenizer, "chat_template", None),
                              "model_max_length": backend.context})


def _tokenizer(backend: ModelFacts) -> Any:
    if backend.tokenizer is None:
        raise ApiError(400, "this model is served without a tokenizer")
    return backend.tokenizer
