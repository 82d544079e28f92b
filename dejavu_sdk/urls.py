"""All parsing of store and transport URLs, in one function with its edge cases tested.

    memory://                      this process's memory (no path)
    lmdb:///abs/path  lmdb://rel   a local path: three slashes for absolute, two for relative, ~ expanded
    file:///abs/path  file://rel   the same for fsspec's local filesystem
    s3://bucket/prefix             object storage: whatever follows :// is the fsspec path
    fsspec+memory://name           any fsspec protocol, forced through the fsspec store
    tcp://host:port  ucx://[::1]:7000   a network peer (port 0: any free port, when serving)
"""

from __future__ import annotations

import os
import re
import urllib.parse

import attrs

from .errors import ConfigError

LOCAL_PATH_SCHEMES = frozenset({"lmdb", "file"})
NETWORK_SCHEMES = frozenset({"tcp", "ucx", "nccl", "gloo"})
FSSPEC_PREFIX = "fsspec+"
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")


@attrs.frozen
class ParsedURL:
    """A parsed URL. `path` is a filesystem path for local schemes and the text after :// otherwise."""

    text: str
    scheme: str
    path: str = ""
    host: str | None = None
    port: int | None = None

    @property
    def protocol(self) -> str:
        """The scheme without a `fsspec+` prefix: the protocol fsspec would see."""
        return self.scheme.removeprefix(FSSPEC_PREFIX)


def parse_url(text: object) -> ParsedURL:
    """Split a store or transport URL into its parts; ConfigError says how to fix a malformed one."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"expected a URL such as 'lmdb:///var/kv' or 'memory://', got {text!r}")
    scheme, separator, rest = text.partition("://")
    if not separator:
        raise ConfigError(
            f"{text!r} has no scheme: write 'lmdb:///abs/path' (or 'lmdb://relative/path'), 'file:///...', "
            "'memory://', 's3://bucket/prefix' or 'tcp://host:port'"
        )
    scheme = scheme.lower()
    if not _SCHEME.fullmatch(scheme):
        raise ConfigError(f"{text!r} has an invalid scheme {scheme!r}")
    if "?" in rest or "#" in rest:
        raise ConfigError(f"{text!r}: query strings and fragments are not read; pass options as keyword arguments")
    protocol = scheme.removeprefix(FSSPEC_PREFIX)
    if protocol in NETWORK_SCHEMES:
        return _parse_network(text, scheme, rest)
    if protocol in LOCAL_PATH_SCHEMES:
        if not rest:
            raise ConfigError(f"{text!r} needs a path: '{scheme}:///abs/path' or '{scheme}://relative/path'")
        return ParsedURL(text, scheme, path=os.path.expanduser(rest))
    return ParsedURL(text, scheme, path=rest)


def join_host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets (`[::1]:7000`), as URLs write it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def network_address(url: ParsedURL) -> tuple[str, int]:
    """The host and port of a peer's URL. Schemes this module does not know as network schemes (a
    third-party transport's) carry `host:port` in their path, which is parsed here; ConfigError if it is
    not one."""
    if url.host is not None and url.port is not None:
        return url.host, url.port
    return _host_and_port(url.text, url.scheme, url.path)


def split_host_port(text: str) -> tuple[str, int]:
    """`host:port` (`[::1]:8000` for IPv6; an `http://` in front is allowed) as a host and a port; ConfigError
    if it is not one."""
    scheme, _, rest = text.rpartition("://")
    return _host_and_port(text, scheme or "http", rest)


def _parse_network(text: str, scheme: str, rest: str) -> ParsedURL:
    host, port = _host_and_port(text, scheme, rest)
    return ParsedURL(text, scheme, host=host, port=port)


def _host_and_port(text: str, scheme: str, rest: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit("//" + rest)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ConfigError(f"{text!r} must be '{scheme}://host:port' with a port from 0 to 65535 (0: any free "
                          "port, when serving) and no path")
    return parts.hostname, port
