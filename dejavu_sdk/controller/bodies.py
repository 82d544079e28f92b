"""A client's request body as the API reads it: JSON, or a 400 that says why not."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from .api_errors import ApiError


async def json_body(request: web.Request) -> Any:
    """The request's JSON body; 400 for what is not JSON, is nested too deeply, or holds text that is not
    Unicode (a lone surrogate)."""
    raw = await request.read()
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode()  # a lone surrogate cannot be tokenized: refuse it here
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the body is not valid JSON") from None
    except ValueError as error:  # an integer of thousands of digits
        raise ApiError(400, f"the body's JSON is refused: {error}") from None
    except RecursionError:
        raise ApiError(400, "the body's JSON is nested too deeply") from None
    except UnicodeEncodeError:
        raise ApiError(400, "the body holds text that is not valid Unicode (a lone surrogate)") from None
    return body
