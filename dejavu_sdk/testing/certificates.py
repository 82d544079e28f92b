"""A throwaway self-signed TLS certificate for 127.0.0.1 and localhost, made with the `openssl` command.

For tests and benchmarks of TLS on loopback: the certificate is its own CA, so clients pass it as `ca=`.
"""

from __future__ import annotations

import os
import shutil
import subprocess


def self_signed_certificate(directory: str | os.PathLike[str]) -> tuple[str, str]:
    """Write `cert.pem` and `key.pem` (valid one day, for 127.0.0.1, ::1 and localhost) into `directory`."""
    if shutil.which("openssl") is None:
        raise RuntimeError("making a test certificate needs the openssl command")
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", key,
                    "-out", cert, "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    return cert, key
