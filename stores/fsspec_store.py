"""Object storage and files through fsspec: `s3://bucket/prefix`, `file:///dir`, `fsspec+memory://name`, ...

One object per block, named `<root>/<stream_id>/L<a>-<b>.T<t0>-<t1>`. Object stores replace whole objects
atomically; on the local filesystem a block is written to a temporary file and renamed into place, so a
reader never sees half a block (a failed write removes its temporary file). `storage_options` go to fsspec
unchanged (credentials, `endpoint_url`).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import numpy as np
from fsspec.registry import known_implementations

from ..errors import BackendUnavailable, BlockNotFound, StoreError
from ..records import NamedRecord, RecordStore, record_array
from ..store import Store
from ..urls import ParsedURL

_INSTALL_HINTS = {"s3": "pip install 'dejavu-sdk[s3]'", "s3a": "pip install 'dejavu-sdk[s3]'"}


class FsspecRecords(RecordStore):
    """Records as objects (or files) under an fsspec URL; thread-safe as fsspec filesystems are."""

    shared = True

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        protocol = url.partition("://")[0] if "://" in url else "file"
        try:
            self._fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as error:
            hint = _INSTALL_HINTS.get(protocol) or known_implementations.get(protocol, {}).get("err")
            raise BackendUnavailable(f"the {protocol}:// store needs a missing package ({error})", hint) from error
        except (ValueError, TypeError) as error:
            raise StoreError(f"cannot open {url!r}: {error}") from error
        self._root = root.rstrip("/")
        self._local = "file" in _protocols(self._fs)
        self.persistent = "memory" not in _protocols(self._fs)
        self._made_dirs: set[str] = set()
        with _translated(url):
            self._fs.makedirs(self._root, exist_ok=True)

    @classmethod
    def from_url(cls, url: ParsedURL, *, storage_options: dict[str, Any] | None = None) -> FsspecRecords:
        return cls(f"{url.protocol}://{url.path}", storage_options=storage_options)

    def _path(self, name: str) -> str:
        return f"{self._root}/{name}"

    def put_records(self, records: Sequence[NamedRecord]) -> None:
        arrays = [(name, record_array(record)) for name, record in records]
        for name, record in arrays:  # in order: a block before the progress record that names it
            self._put(name, record)

    def _put(self, name: str, record: np.ndarray) -> None:
        path = self._path(name)
        with _translated(self.url):
            if not self._local:
                self._fs.pipe_file(path, record.tobytes())
                return
            directory = os.path.dirname(path)
            if directory not in self._made_dirs:
                self._fs.makedirs(directory, exist_ok=True)
                self._made_dirs.add(directory)
            temporary = f"{path}.tmp-{uuid.uuid4().hex}"
            try:
                try:
                    file = open(temporary, "wb")  # noqa: SIM115 - closed below, whichever way it opened
                except FileNotFoundError:  # another process sharing the directory removed the stream's since
                    self._fs.makedirs(directory, exist_ok=True)
                    file = open(temporary, "wb")  # noqa: SIM115
                with file:
                    file.write(record.data)
                os.replace(temporary, path)
            except BaseException:  # a full disk, say: leave no half-written file behind, and raise the error
                with contextlib.suppress(OSError):
                    os.remove(temporary)
                raise

    @contextlib.contextmanager
    def get_record(self, name: str) -> Iterator[bytes | np.ndarray]:
        with _translated(self.url):
            try:
                record = self._read_local(name) if self._local else self._fs.cat_file(self._path(name))
            except FileNotFoundError:
                raise BlockNotFound(f"no block {name} in {self.url}") from None
        yield record

    def record_size(self, name: str) -> int | None:
        if not self._local:
            return None  # asking an object store costs a request of its own
        with _translated(self.url):
            try:
                return os.stat(self._path(name)).st_size
            except FileNotFoundError:
                raise BlockNotFound(f"no block {name} in {self.url}") from None

    def _read_local(self, name: str) -> np.ndarray:
        """Read a local file straight into one buffer (fsspec's cat_file would copy it twice)."""
        with open(self._path(name), "rb") as file:
            record = np.empty(os.fstat(file.fileno()).st_size, dtype=np.uint8)
            return record[:file.readinto(record.data)]

    def names(self, prefix: str) -> list[str]:
        directory = self._path(prefix.rstrip("/")) if prefix else self._root
        with _translated(self.url):
            self._fs.invalidate_cache(directory)
            found = self._fs.find(directory) if self._fs.exists(directory) else []
        start = len(self._root) + 1
        return [path[start:] for path in found if path[start:].startswith(prefix)]

    def remove(self, names: Sequence[str]) -> None:
        with _translated(self.url):
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    self._fs.rm_file(self._path(name))
            if self._local:
                for directory in {os.path.dirname(self._path(name)) for name in names}:
                    with contextlib.suppress(OSError):
                        os.rmdir(directory)  # only succeeds once the stream's directory is empty
                    self._made_dirs.discard(directory)


    def close(self) -> None:
        """Nothing to release: fsspec filesystems are cached and shared by fsspec itself."""


class FsspecStore(Store):
    """A `Store` over `FsspecRecords`: `FsspecStore(url)` is `open_store(url)` for an fsspec URL."""

    records: FsspecRecords

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(FsspecRecords(url, storage_options=storage_options))


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


@contextlib.contextmanager
def _translated(url: str) -> Iterator[None]:
    """Turn the filesystem's errors into StoreError (SDK errors pass through)."""
    try:
        yield
    except (BlockNotFound, BackendUnavailable):
        raise
    except Exception as error:  # fsspec backends raise OSError, botocore and aiohttp errors alike
        raise StoreError(f"{url}: {type(error).__name__}: {error}") from error
