"""The error a request is answered with: a status a client understands and OpenAI's error body."""

from __future__ import annotations

#: The most characters of an error message a client is sent (what it quotes of the request is bounded before).
MAX_MESSAGE = 1000


class ApiError(Exception):
    """An error answered with `status`, OpenAI's error body (`param`: the argument of the request at fault, where
    one is) and, when waiting helps, `retry_after` seconds. A message past `MAX_MESSAGE` characters is cut
    there."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 retry_after: float | None = None, param: str | None = None) -> None:
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE] + "..."
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.retry_after = status, message, kind, code, retry_after
        self.param = param
