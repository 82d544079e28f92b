"""Who a request belongs to: the client token that made it. A request is known to its owner alone
(`GET /v1/requests/<id>`, its stream, the ids `/v1/status` lists); to any other token it does not exist.

A token is never kept: a request holds its owner id, a SHA-256 digest of the token, and so does the journal, so
that a successor controller given the same token answers the same client. Tokens and owner ids are compared in
constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

#: What a token's digest starts from: an owner id is no plain SHA-256 of the token (a table of those finds nothing).
_DOMAIN = b"dejavu-sdk request owner\0"


def owner_id(token: str) -> str:
    """The owner id of the requests made with `token` (hex digits)."""
    return hashlib.sha256(_DOMAIN + token.encode()).hexdigest()


def owns(owner: str | None, caller: str | None) -> bool:
    """Whether the client of owner id `caller` made a request of owner id `owner`; a request without one (journaled
    by a controller before requests had owners) is no client's."""
    if owner is None or caller is None:
        return False
    return hmac.compare_digest(owner.encode(), caller.encode())


class Tokens:
    """The tokens an API accepts, each with the owner id of the requests it makes."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self._owners = [(token.encode(), owner_id(token)) for token in tokens]

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, presented: str) -> str | None:
        """The owner id of the token presented; None if it is none of them (each compared in constant time, and
        every one compared: how long it takes says nothing of which matched)."""
        given, found = presented.encode(), None
        for token, owner in self._owners:
            if hmac.compare_digest(given, token):
                found = owner
        return found
