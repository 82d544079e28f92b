"""TLS on a pipeline's own links: the head's inbox, each stage worker's inbox, and every link between them.

One certificate for the pipeline (`cert`, with its private key `key`) is served by every inbox, and every link
verifies its peer against `ca` (the PEM file of the authority that signed it, or the certificate itself when it
signs itself). The certificate must name the addresses the inboxes listen on (for workers on one machine,
127.0.0.1). Only `tcp` links carry TLS. With it, what the stages send each other (activations, prompt KV handed
to token stages, replicas held by a neighbour, tokens) is encrypted, and a worker joins only a head that proves it
holds the pipeline's key (the workers' token proves the reverse). A `replica_store` is reached its own way (its
URL's options, e.g. a `tcp://` store server's TLS), not over these links.

The head takes it as `Pipeline(..., link_tls_cert=, link_tls_key=, link_tls_ca=)`; the workers it launches get it
in their environment (`DEJAVU_LINK_TLS_CERT`, `DEJAVU_LINK_TLS_KEY`, `DEJAVU_LINK_TLS_CA`), and so does `dejavu
worker --link-tls-cert ... --link-tls-key ... --link-tls-ca ...`. The paths are the head's: workers on other
machines (Ray actors included) need the files at the same paths.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ...errors import ConfigError

CERT_VARIABLE, KEY_VARIABLE, CA_VARIABLE = "DEJAVU_LINK_TLS_CERT", "DEJAVU_LINK_TLS_KEY", "DEJAVU_LINK_TLS_CA"


@attrs.frozen
class LinkTls:
    """The pipeline's certificate and key (PEM files), and the authority its links verify peers against."""

    cert: str
    key: str
    ca: str

    @classmethod
    def of(cls, cert: str | None, key: str | None, ca: str | None, transport: str = "tcp") -> LinkTls | None:
        """None when none is given; ConfigError unless all three are given, name files, and `transport` is tcp."""
        given = {"link_tls_cert": cert, "link_tls_key": key, "link_tls_ca": ca}
        if all(value is None for value in given.values()):
            return None
        missing = sorted(name for name, value in given.items() if not value)
        if missing:
            raise ConfigError(f"TLS on the pipeline's links needs link_tls_cert, link_tls_key and link_tls_ca; "
                              f"{', '.join(missing)} missing")
        if transport != "tcp":
            raise ConfigError(f"TLS on the pipeline's links runs over transport='tcp', not {transport!r}")
        for name, value in given.items():
            if not Path(str(value)).is_file():
                raise ConfigError(f"{name}: {value!r} is not a file")
        return cls(str(Path(str(cert)).resolve()), str(Path(str(key)).resolve()), str(Path(str(ca)).resolve()))

    @classmethod
    def from_environment(cls, environment: Mapping[str, str] | None = None) -> LinkTls | None:
        """The settings a launched worker was given (None: its links are plain); the head checked the files."""
        environment = os.environ if environment is None else environment
        cert, key, ca = (environment.get(name) or None for name in (CERT_VARIABLE, KEY_VARIABLE, CA_VARIABLE))
        if cert is None and key is None and ca is None:
            return None
        if cert is None or key is None or ca is None:
            raise ConfigError(f"{CERT_VARIABLE}, {KEY_VARIABLE} and {CA_VARIABLE} go together; some are unset")
        return cls(cert, key, ca)

    def environment(self) -> dict[str, str]:
        """What a worker's environment holds of it."""
        return {CERT_VARIABLE: self.cert, KEY_VARIABLE: self.key, CA_VARIABLE: self.ca}


def inbox_options(tls: LinkTls | None) -> dict[str, Any]:
    """`serve`'s options for an inbox of the pipeline. Its connections are never closed for being idle: they
    live as long as the pipeline, and a link that only posts (a stage's steps to the next) could not tell,
    after such a close, whether its last posts arrived; heartbeats and the progress watchdog find a peer gone."""
    return {"idle_timeout": None, **({} if tls is None else {"tls_cert": tls.cert, "tls_key": tls.key})}


def link_options(tls: LinkTls | None) -> dict[str, Any]:
    """`open_transport`'s options for a link to an inbox of the pipeline."""
    return {} if tls is None else {"ca": tls.ca}


def worker_environment(tls: LinkTls | None) -> dict[str, str]:
    """What a launched worker's environment gets of it (plain links: the variables emptied, so a worker never
    takes the head's own environment's settings for the pipeline's)."""
    return tls.environment() if tls is not None else {CERT_VARIABLE: "", KEY_VARIABLE: "", CA_VARIABLE: ""}
