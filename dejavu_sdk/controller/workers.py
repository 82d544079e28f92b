"""How a stage worker started anywhere finds the pipeline it serves: it asks the controller (`GET /v1/workers`)
where the head listens, then joins there (`dejavu worker --controller URL`)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from ..errors import AccessDenied, ConfigError, TransportError

#: Seconds a worker keeps asking a controller that does not answer yet (it may start after the worker).
ASK_TIMEOUT = 120.0


def ask_where_to_join(controller: str, token: str | None, timeout: float = ASK_TIMEOUT) -> str:
    """The head's transport URL, from the controller at `controller` (http://host:port), presenting `token`."""
    if not controller.startswith(("http://", "https://")):
        raise ConfigError(f"--controller is the controller's http://host:port, got {controller!r}")
    if not token:
        raise ConfigError("a worker presents the controller's token: give --token-file, or set DEJAVU_TOKEN")
    request = urllib.request.Request(controller.rstrip("/") + "/v1/workers",
                                     headers={"Authorization": f"Bearer {token}"})
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return str(json.load(answer)["join"])
        except urllib.error.HTTPError as error:  # noqa: PERF203 - a refusal ends the loop; only "not up yet" retries
            if error.code == 401:
                raise AccessDenied(f"the controller at {controller} refused the token") from None
            raise TransportError(f"the controller at {controller} answered {error.code}: {error.reason}") from None
        except (urllib.error.URLError, OSError) as error:  # not listening yet: ask again
            if time.monotonic() > deadline:
                raise TransportError(f"the controller at {controller} did not answer within {timeout:.0f} s: "
                                     f"{error}") from None
            time.sleep(0.5)
