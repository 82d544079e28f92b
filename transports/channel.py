"""Client and server logic shared by every transport built on a `Channel` (tcp, ucx, nccl/gloo).

`ChannelTransport` sends one request at a time over a lazily opened channel and reopens it on the next
call after any failure (per-link reconnect). `ChannelServer` answers requests from any number of channels
against its store; a backend only opens, accepts and closes channels.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import attrs
import numpy as np
import torch

from .._version import __version__
from ..blocks import BlockKey, check_key, check_stream_id, torch_dtype
from ..codec import TRAILER, RecordHeader, check_out, corrupt, host_view
from ..errors import (
    AccessDenied,
    BlockNotFound,
    ConfigError,
    CorruptBlock,
    DejaVuError,
    ServerBusy,
    StoreClosed,
    StoreError,
    TransportError,
)
from ..records import NamedRecord, record_array, returned_memory
from ..store import Store, manifest_name, progress_key_or_none
from ..urls import ParsedURL, join_host_port, network_address
from .access import AccessPolicy, Scope, client_token
from .base import (
    CLIENT_TIMEOUT,
    CONNECT_TIMEOUT,
    HELLO_TIMEOUT,
    IDLE_TIMEOUT,
    INBOX_SIZE,
    MAX_CONNECTIONS,
    MAX_INFLIGHT_BYTES,
    MAX_UNAUTHENTICATED,
    ROOM_WAIT,
    SERVER_TIMEOUT,
    WORKERS,
    Server,
    ServingTransport,
    Transport,
    check_timeout,
)
from .budget import InflightBudget
from .wire import (
    HELLO_BYTES,
    MAX_RECORD_BYTES,
    Channel,
    IdleTimeout,
    Limits,
    Message,
    NotSent,
    Op,
    OutgoingRecord,
    PeerClosed,
    ProtocolError,
    Status,
    discard_payload,
    message_parts,
    recv_message,
    recv_payload,
    send_message,
)

TENSOR_LABEL = "tensor"
_HELLO_LIMITS = Limits(max_record_bytes=0, max_meta_bytes=HELLO_BYTES)  # nothing larger is allocated for a HELLO
_STATUS_ERRORS: dict[Status, type[DejaVuError]] = {
    Status.NOT_FOUND: BlockNotFound, Status.CORRUPT: CorruptBlock, Status.BAD_REQUEST: TransportError,
    Status.FAILED: StoreError, Status.DENIED: AccessDenied, Status.BUSY: ServerBusy,
}


class ChannelTransport(ServingTransport):
    """A Transport over one channel, opened by `_connect` on first use and after any failure."""

    def __init__(self, url: str, limits: Limits | None = None, token: str | None = None) -> None:
        self.url = url
        self.limits = limits or Limits()
        self._token = client_token(token)
        self._channel: Channel | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._posted = 0  # tensors posted on this channel since the server last answered a request

    @abstractmethod
    def _connect(self) -> Channel:
        """Open a new channel to the peer; TransportError if it cannot be reached in time."""

    # ---- one request, one reply -----------------------------------------------------------
    def _exchange(self, op: Op, meta: bytes = b"", record: OutgoingRecord | None = None,
                  receive: Callable[[Channel, Message], Any] | None = None) -> tuple[Message, Any]:
        """Send a request and read the reply; `receive` reads the reply's record, if it has one.

        A channel the server closed while it sat idle is replaced before the request goes out, or, when
        the close crossed the request, once its first send fails (the server never acted on it).
        """
        with self._lock:
            self._check_posts()
            reused = self._channel is not None
            channel = self._channel or self._open()
            try:
                try:
                    send_message(channel, op, meta=meta, record=record)
                except NotSent:
                    if not reused:
                        raise
                    self._drop()
                    channel = self._open()
                    send_message(channel, op, meta=meta, record=record)
                reply = recv_message(channel, self.limits)
                if reply.has_record and receive is None:
                    raise ProtocolError(f"{self.url} answered {op.name} with an unexpected record")
                received = receive(channel, reply) if receive is not None and reply.has_record else None
            except BaseException:
                self._drop()  # the channel's state is unknown: reopen it next time
                raise
            self._posted = 0  # answered in order, so every earlier post was taken
        if reply.status != Status.OK:
            raise _STATUS_ERRORS.get(reply.status, TransportError)(f"{self.url}: {reply.text}")
        return reply, received

    def _open(self) -> Channel:
        channel = self._connect()
        hello = f"dejavu-sdk {__version__}" + (f"\n{self._token}" if self._token is not None else "")
        try:
            send_message(channel, Op.HELLO, meta=hello.encode())
            reply = recv_message(channel, self.limits)
        except BaseException:
            channel.close()
            raise
        if reply.op != Op.REPLY or reply.status != Status.OK:
            channel.close()
            error = _STATUS_ERRORS.get(reply.status, TransportError)
            raise error(f"{self.url} refused the connection: {reply.text}")
        self._channel = channel
        return channel

    def _check_posts(self) -> None:
        """Before a request: refuse on a closed transport, and replace a channel the server closed, saying so
        when tensors posted on it may not have arrived. Called with the lock held."""
        if self._closed:
            raise StoreClosed(f"{self!r} is closed")
        if self._channel is not None and self._channel.closed_by_peer():
            posted = self._posted
            self._drop()
            if posted:
                raise TransportError(f"{self.url} closed the connection: {posted} tensor(s) posted since its last "
                                     "answer may not have arrived")

    def _drop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._posted = 0

    # ---- blocks and tensors --------------------------------------------------------------
    def flush(self, key: BlockKey, block: Any) -> None:
        name = str(check_key(key))
        self._exchange(Op.PUT, name.encode(), OutgoingRecord.from_block(name, block))

    def fetch(self, key: BlockKey, out: torch.Tensor | None = None) -> torch.Tensor:
        name = str(check_key(key))
        landing = _Landing(name, out)
        reply, intact = self._exchange(Op.GET, name.encode(), receive=landing.receive)
        return landing.result(reply, intact)

    def send_tensor(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"send_tensor takes a torch.Tensor, got {type(tensor).__name__}")
        self._exchange(Op.TENSOR, record=OutgoingRecord.from_block(TENSOR_LABEL, tensor))

    def post_tensor(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"post_tensor takes a torch.Tensor, got {type(tensor).__name__}")
        record = OutgoingRecord.from_block(TENSOR_LABEL, tensor)
        with self._lock:
            self._check_posts()
            channel = self._channel or self._open()
            try:
                send_message(channel, Op.POST, record=record)
            except BaseException as error:
                posted = self._posted
                self._drop()
                if posted and isinstance(error, TransportError):
                    raise TransportError(f"{error}; {posted} tensor(s) posted before it may not have arrived") \
                        from error
                raise
            self._posted += 1

    # ---- the record interface ------------------------------------------------------------
    def put_records(self, records: Sequence[NamedRecord]) -> None:
        if not records:
            return
        arrays = [(name, record_array(record)) for name, record in records]
        meta = "\n".join(f"{record.size} {name}" for name, record in arrays).encode()
        payload = arrays[0][1] if len(arrays) == 1 else np.concatenate([record for _, record in arrays])
        self._exchange(Op.PUT_RECORDS, meta, OutgoingRecord.opaque(payload))

    def get_record(self, name: str) -> contextlib.nullcontext[np.ndarray]:
        def receive(channel: Channel, reply: Message) -> np.ndarray:
            header = _record_header(self.url, reply)
            record = np.empty(header.record_length, np.uint8)
            record[:header.length] = reply.header_bytes
            _, trailer = recv_payload(channel, reply, record[header.length:])
            record[record.size - TRAILER.size:] = np.frombuffer(trailer, np.uint8)
            return record  # verified later, by whoever decodes it

        return contextlib.nullcontext(self._exchange(Op.GET, name.encode(), receive=receive)[1])

    def names(self, prefix: str) -> list[str]:
        reply, _ = self._exchange(Op.LIST, prefix.encode())
        return reply.text.split("\n") if reply.meta else []

    def remove(self, names: Sequence[str]) -> None:
        if names:
            self._exchange(Op.REMOVE, "\n".join(names).encode())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()


class _Landing:
    """Where a fetched block lands: the caller's `out` (or a new tensor), through staging when `out` is not
    contiguous host memory. A wrong `out` is reported only after the record was read off the channel."""

    def __init__(self, name: str, out: torch.Tensor | None) -> None:
        self.name, self.out = name, out
        self.target: torch.Tensor | None = None
        self.staging: torch.Tensor | None = None
        self.error: ConfigError | None = None

    def receive(self, channel: Channel, reply: Message) -> bool:
        header = _record_header(channel.peer, reply)
        view = None
        try:
            self.target = check_out(self.name, header, self.out)
            view = host_view(self.target)
        except ConfigError as error:  # still read the record, so the channel stays in step
            self.error = error
        if view is None:
            pinned = self.target is not None and self.target.device.type == "cuda"
            self.staging = torch.empty(header.payload_length, dtype=torch.uint8, pin_memory=pinned)
            view = self.staging.numpy()
        return recv_payload(channel, reply, view)[0]

    def result(self, reply: Message, intact: bool) -> torch.Tensor:
        if self.error is not None:
            raise self.error
        header = reply.header
        if header is None or self.target is None:
            raise ProtocolError(f"the reply to GET {self.name} carried no block")
        if header.label != self.name:
            raise corrupt(self.name, f"the record holds block {header.label!r}")
        if not intact:
            raise corrupt(self.name, "checksum mismatch")
        if self.staging is not None:
            self.target.copy_(self.staging.view(self.target.dtype).view(header.shape))
        return self.target


def _record_header(peer: str, reply: Message) -> RecordHeader:
    if reply.header is None:
        raise ProtocolError(f"{peer} answered GET with bytes that are not a block record")
    return reply.header


@attrs.frozen
class ServerOptions:
    """How a server treats its peers; `serve(url, store, **options)` builds one from its keyword options.

    `timeout`: seconds a whole request may take to arrive once it has started (not per piece: a client
    that trickles bytes is dropped). `idle_timeout`: seconds a connection may wait between requests (None:
    forever). `max_connections`: connections served at once; more are refused politely (ServerBusy).
    `access`: tokens and their streams. `tls_cert`/`tls_key`: PEM files; TLS for every connection.
    `accept_tensors`: whether peers may send tensors (a store server nobody reads tensors from says no);
    `inbox_size`: tensors held for `recv_tensor`, beyond which more are refused (ServerBusy); a posted tensor
    waits up to `timeout` for room instead, holding its sender back.
    `max_inflight_bytes`: memory for records on their way in or out (copies a GET makes, records being
    received), shared by every connection; a transfer that does not fit waits up to `ROOM_WAIT` (10 s, at most
    `timeout`) for room, then gets ServerBusy. A record larger than this is served alone.
    `hello_timeout`: seconds a new connection has to open with its HELLO (TLS handshake included; gloo links
    have no such wait).
    tcp:// servers also take: `max_unauthenticated`, connections that have not said HELLO yet, held apart
    from `max_connections` (when full, the oldest is dropped for the newest); `workers`, threads that answer
    requests (one more watches every socket), whatever the number of connections.
    """

    timeout: float | None = SERVER_TIMEOUT
    idle_timeout: float | None = IDLE_TIMEOUT
    max_record_bytes: int = MAX_RECORD_BYTES
    max_connections: int = MAX_CONNECTIONS
    access: AccessPolicy = attrs.field(factory=AccessPolicy)
    tls_cert: str | None = None
    tls_key: str | None = None
    accept_tensors: bool = True
    inbox_size: int = INBOX_SIZE
    hello_timeout: float = HELLO_TIMEOUT
    max_unauthenticated: int = MAX_UNAUTHENTICATED
    workers: int = WORKERS
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES

    def __attrs_post_init__(self) -> None:
        check_timeout(self.timeout, "timeout")
        check_timeout(self.idle_timeout, "idle_timeout")
        if check_timeout(self.hello_timeout, "hello_timeout") is None:
            raise ConfigError("hello_timeout must be a positive number of seconds: a connection that never says "
                              "HELLO must not hold its slot forever")
        for name in ("max_connections", "max_unauthenticated", "workers", "max_inflight_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both tls_cert and tls_key (PEM files)")


class AddressedServerFactory(Protocol):
    """How `AddressedTransport.serve` starts its backend's server: every addressed backend's server class
    (TcpServer, UcxServer, DistServer) takes these arguments."""

    def __call__(self, store: Store, host: str, port: int, *, scheme: str, options: ServerOptions) -> Server: ...


class AddressedTransport(ChannelTransport):
    """A ChannelTransport to `scheme://host:port`, with the options every networked backend takes.

    `token`: presented to the server when a connection opens (default: `DEJAVU_TOKEN` from the
    environment). `tls`/`ca`: TLS, verifying the server against the system's CAs or the PEM file `ca`;
    only backends with `supports_tls` take them.
    """

    server_class: ClassVar[AddressedServerFactory]
    supports_tls: ClassVar[bool] = False

    def __init__(self, scheme: str, host: str, port: int, *, timeout: float | None = CLIENT_TIMEOUT,
                 connect_timeout: float = CONNECT_TIMEOUT, max_record_bytes: int = MAX_RECORD_BYTES,
                 token: str | None = None, tls: bool = False, ca: str | None = None) -> None:
        super().__init__(f"{scheme}://{join_host_port(host, port)}", Limits(max_record_bytes=max_record_bytes),
                         token)
        self.scheme, self.host, self.port = scheme, host, port
        self.timeout = check_timeout(timeout, "timeout")
        self.connect_timeout = check_timeout(connect_timeout, "connect_timeout") or CONNECT_TIMEOUT
        if (tls or ca is not None) and not self.supports_tls:
            raise ConfigError(f"{scheme}:// connections have no TLS here; use tcp:// for tls=True and ca=")
        self.tls, self.ca = bool(tls or ca is not None), ca

    @classmethod
    def from_url(cls, url: ParsedURL, *, timeout: float | None = CLIENT_TIMEOUT,
                 connect_timeout: float = CONNECT_TIMEOUT, max_record_bytes: int = MAX_RECORD_BYTES,
                 token: str | None = None, tls: bool = False, ca: str | None = None) -> Transport:
        host, port = network_address(url)
        return cls(url.scheme, host, port, timeout=timeout, connect_timeout=connect_timeout,
                   max_record_bytes=max_record_bytes, token=token, tls=tls, ca=ca)

    @classmethod
    def serve(cls, url: ParsedURL, store: Store, *, timeout: float | None = SERVER_TIMEOUT,
              idle_timeout: float | None = IDLE_TIMEOUT, max_record_bytes: int = MAX_RECORD_BYTES,
              max_connections: int = MAX_CONNECTIONS, token: str | None = None,
              tokens: Mapping[str, str] | None = None, tls_cert: str | None = None, tls_key: str | None = None,
              accept_tensors: bool = True, inbox_size: int = INBOX_SIZE, hello_timeout: float = HELLO_TIMEOUT,
              max_unauthenticated: int = MAX_UNAUTHENTICATED, workers: int = WORKERS,
              max_inflight_bytes: int = MAX_INFLIGHT_BYTES) -> Server:
        """Serve `store` at the URL's host and port (0: any free port); see `ServerOptions` for the options.
        `token` lets its holders reach every stream; `tokens` maps more tokens to the stream-id prefix each
        may reach. Without either, any client that reaches the port may use every stream."""
        if tls_cert is not None and not cls.supports_tls:
            raise ConfigError(f"{url.scheme}:// servers have no TLS here; serve tcp:// for tls_cert and tls_key")
        options = ServerOptions(timeout=timeout, idle_timeout=idle_timeout, max_record_bytes=max_record_bytes,
                                max_connections=max_connections, access=AccessPolicy.from_options(token, tokens),
                                tls_cert=tls_cert, tls_key=tls_key, accept_tensors=accept_tensors,
                                inbox_size=inbox_size, hello_timeout=hello_timeout,
                                max_unauthenticated=max_unauthenticated, workers=workers,
                                max_inflight_bytes=max_inflight_bytes)
        host, port = network_address(url)
        return cls.server_class(store, host, port, scheme=url.scheme, options=options)


@attrs.frozen
class Reply:
    """A server's answer to one request, and what to run once it is out (`release`: give back the memory that
    its record holds). `close`: the connection ends after it (a refused HELLO)."""

    status: Status = Status.OK
    meta: bytes = b""
    record: OutgoingRecord | None = None
    release: Callable[[], None] = attrs.field(default=lambda: None)
    close: bool = False

    def views(self) -> list[memoryview]:
        """The reply as the byte views a byte stream sends, in order."""
        return [memoryview(part.data if isinstance(part, np.ndarray) else part).cast("B")
                for part in message_parts(Op.REPLY, status=self.status, meta=self.meta, record=self.record)]

    def send(self, channel: Channel) -> None:
        """Send it on `channel` (within the channel's timeout), then release its memory."""
        try:
            send_message(channel, Op.REPLY, status=self.status, meta=self.meta, record=self.record)
        finally:
            self.release()


@attrs.frozen
class Wait:
    """A request that waits for `size` bytes of the server's in-flight budget; `resume(granted)` carries it on
    once they are reserved for it (True) or the wait timed out (False)."""

    size: int
    resume: Callable[[bool], Reply | Wait | None]


class ChannelServer(Server):
    """Answers requests on channels against `store`; backends accept channels and call `serve_channel`, or
    read requests themselves and call `respond`.

    Every connection opens with a HELLO that carries the client's token, checked before anything else;
    the connection is then held to the streams that token may reach (see `access.py`).
    """

    def __init__(self, store: Store, options: ServerOptions) -> None:
        self.store = store
        self.records = store.records
        self.options = options
        self.timeout = options.timeout
        self.limits = Limits(max_record_bytes=options.max_record_bytes)
        self.budget = InflightBudget(options.max_inflight_bytes)
        #: Seconds a transfer waits for room in the budget before ServerBusy.
        self.room_wait = ROOM_WAIT if options.timeout is None else min(ROOM_WAIT, options.timeout)
        self.log = logging.getLogger(f"dejavu_sdk.transports.{type(self).__name__}")
        self._inbox: queue.Queue[torch.Tensor] = queue.Queue(maxsize=options.inbox_size)
        self._connections = 0
        self._connections_lock = threading.Lock()

    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor:
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TransportError(f"no tensor arrived at {self.url} within {timeout} s") from None

    def serve_channel(self, channel: Channel) -> None:
        """Answer requests on `channel`, on this thread, until the peer leaves or misbehaves; never raises."""
        with self._connections_lock:
            admitted = self._connections < self.options.max_connections
            self._connections += admitted
        try:
            channel.set_idle_timeout(self.options.hello_timeout)
            try:
                hello = recv_message(channel, _HELLO_LIMITS, idle=True)
            except IdleTimeout:
                self.log.warning("dropping %s: no HELLO within %s s", channel.peer, self.options.hello_timeout)
                return
            scope, reply = self.greet(hello, admitted, channel.peer)
            reply.send(channel)
            if scope is None:
                return
            channel.set_idle_timeout(self.options.idle_timeout)
            while True:
                outcome = self.respond(channel, recv_message(channel, self.limits, idle=True), scope)
                while isinstance(outcome, Wait):
                    outcome = outcome.resume(self.budget.reserve(outcome.size, self.room_wait))
                if outcome is not None:
                    outcome.send(channel)
        except Exception as error:  # every way a connection ends is logged; none escapes
            self.ended(channel, error)
        finally:
            with self._connections_lock:
                self._connections -= admitted
            channel.close()

    def stopping(self) -> bool:
        """Whether the server is stopping: the connections it closes then end no request of a peer's."""
        return False

    def ended(self, channel: Channel, error: Exception) -> None:
        """Log why serving `channel` stopped (telling a peer that broke the protocol why, if it still listens)."""
        if isinstance(error, PeerClosed):
            self.log.info("%s disconnected", channel.peer)
        elif isinstance(error, IdleTimeout):  # it reconnects when it has something to send: nothing to say
            self.log.debug("%s sent no request for %s s: closing its connection", channel.peer,
                           self.options.idle_timeout)
        elif self.stopping() and isinstance(error, TransportError):  # this server closed it, stopping
            self.log.debug("closed the connection of %s as the server stops", channel.peer)
        elif isinstance(error, (ProtocolError, CorruptBlock)):
            self.log.warning("dropping %s: %s", channel.peer, error)
            with contextlib.suppress(TransportError):
                send_message(channel, Op.REPLY, status=Status.BAD_REQUEST, meta=str(error).encode())
        elif isinstance(error, TransportError):
            self.log.warning("lost %s mid-request: %s", channel.peer, error)
        else:
            self.log.error("unexpected error serving %s", channel.peer, exc_info=error)

    def greet(self, hello: Message, admitted: bool, peer: str) -> tuple[Scope | None, Reply]:
        """Answer the HELLO that opens a connection: the token's scope and a welcome, or None and a refusal
        (`admitted`: whether a connection slot is free for it)."""
        if hello.op != Op.HELLO or hello.has_record:
            raise ProtocolError(f"{hello.op.name} before HELLO: a connection opens with HELLO")
        _, _, token = hello.meta.partition(b"\n")
        scope = self.options.access.scope_for(token)
        refusal = None
        if scope is None:
            refusal = Status.DENIED, "a valid token is needed (token= or DEJAVU_TOKEN)"
            self.log.warning("refused %s: %s", peer, "no token" if not token else "a wrong token")
        elif not admitted:
            refusal = Status.BUSY, f"the server serves {self.options.max_connections} connections already"
            self.log.warning("refused %s: %s", peer, refusal[1])
        if refusal is not None:
            return None, Reply(refusal[0], refusal[1].encode(), close=True)
        self.log.info("%s connected", peer)
        return scope, Reply(meta=f"dejavu-sdk {__version__}".encode())

    def respond(self, channel: Channel, request: Message, scope: Scope) -> Reply | Wait | None:
        """Carry out one request (reading any record it carries off `channel`): its reply, a wait for room in
        the in-flight budget, or None for a posted tensor taken. Store errors become error replies; channel
        errors propagate."""
        outside = _outside(request, scope)
        if outside is not None:
            if request.has_record:
                discard_payload(channel, request)  # read it all, so the channel stays in step
            return Reply(Status.DENIED, f"{outside} lies outside the streams this token may reach".encode())
        if request.op in (Op.PUT, Op.TENSOR, Op.PUT_RECORDS, Op.POST):
            if (request.op == Op.PUT_RECORDS) != (request.header is None):
                raise ProtocolError(f"{request.op.name} with{'out' if request.header is None else ''} a record header")
            size = request.payload_length if request.header is None else request.header.record_length
            if not self.budget.try_reserve(size):  # its record waits, unread, until there is room for it
                return Wait(size, functools.partial(self._receive_once_reserved, channel, request, size))
            return self._received(channel, request, size)
        if request.has_record:
            raise ProtocolError(f"{request.op.name} requests carry no record")
        if request.op == Op.GET:
            try:
                name = _block_name(request.text)
            except ConfigError as error:
                return Reply(*_error_reply(error))
            return self._get(channel, name)
        if request.op == Op.HELLO:
            raise ProtocolError("HELLO twice on one connection")
        if request.op == Op.LIST:
            return Reply(*_replied(lambda: "\n".join(
                name for name in self.records.names(_listing_prefix(request.text)) if scope.allows(name)).encode()))
        if request.op == Op.REMOVE:
            return Reply(*_replied(lambda: self.records.remove([_block_name(name)
                                                                for name in request.text.split("\n")])))
        raise ProtocolError(f"{request.op.name} is not a request")

    def _get(self, channel: Channel, name: str, held: int = 0) -> Reply | Wait:
        """The record `name` for a reply. A store that keeps it in memory (`resident`) lends it as kept; any
        other read makes a copy, held in the in-flight budget until it is sent (`held`: bytes already reserved
        for this request; reserved before the read where the store knows the size): a store's own copy
        (files, objects) as it is, a record lent by the store (LMDB) copied out of its read transaction, so
        that a slow reader holds none, into memory that goes back to the system once sent."""
        try:
            expected = None if self.records.resident else self.records.record_size(name)
            if expected is not None:
                held = self._hold(held, expected)
                if held < 0:
                    return Wait(expected, functools.partial(self._get_once_reserved, channel, name, expected))
            with self.records.get_record(name) as stored:
                if self.records.resident:
                    return Reply(record=OutgoingRecord.from_record(stored, name))
                size = memoryview(stored).nbytes
                held = self._hold(held, size)  # its size was unknown before the read, or changed meanwhile
                if held < 0:
                    return Wait(size, functools.partial(self._get_once_reserved, channel, name, size))
                copy = stored
                if self.records.lends_buffers:
                    copy = returned_memory(size)
                    copy[:] = np.frombuffer(stored, np.uint8)
            record = OutgoingRecord.from_record(copy, name)
        except (BlockNotFound, CorruptBlock, ConfigError, StoreError) as error:
            self.budget.release(held)
            return Reply(*_error_reply(error))
        except BaseException:
            self.budget.release(held)
            raise
        return Reply(record=record, release=functools.partial(self.budget.release, held))

    def _hold(self, held: int, size: int) -> int:
        """Hold `size` bytes instead of the `held` reserved: `size` once held, or -1 (none held) when they do
        not fit now (or others wait first)."""
        if size == held:
            return held
        self.budget.release(held)
        return size if self.budget.try_reserve(size) else -1

    def _get_once_reserved(self, channel: Channel, name: str, size: int, granted: bool) -> Reply | Wait:
        if channel.closed_by_peer():  # the reader gave up waiting: read nothing for it
            self.budget.release(size if granted else 0)
            raise PeerClosed(f"{channel.peer} left while its GET waited for room")
        if not granted:
            return self._no_room()
        return self._get(channel, name, size)

    def _no_room(self) -> Reply:
        return Reply(Status.BUSY, f"the server holds {self.budget.limit} bytes for other transfers "
                                  f"(max_inflight_bytes) and none came free within {self.room_wait} s".encode())

    def _receive_once_reserved(self, channel: Channel, request: Message, size: int, granted: bool) -> Reply | None:
        channel.start_deadline()  # the record has the whole timeout again: the wait was the server's
        if granted:
            return self._received(channel, request, size)
        if request.op == Op.POST:  # refused by closing the connection: no need to read the tensor first
            raise ProtocolError(f"refused a posted tensor: no room for it within {self.room_wait} s")
        discard_payload(channel, request)  # read it all, so the channel stays in step
        return self._no_room()

    def _received(self, channel: Channel, request: Message, size: int) -> Reply | None:
        """Receive a request's record into `size` bytes reserved for it, store or queue it, and give the bytes
        back; its reply (None for a posted tensor taken: a refused one closes the connection)."""
        try:
            status, meta = self._store_received(channel, request, size)
        finally:
            self.budget.release(size)
        if request.op == Op.POST:
            if status != Status.OK:
                raise ProtocolError(f"refused a posted tensor: {meta.decode(errors='replace')}")
            return None
        return Reply(status, meta)

    def _store_received(self, channel: Channel, request: Message, size: int) -> tuple[Status, bytes]:
        """Receive records whole and verified, then store or queue them; never store half a record."""
        header = request.header
        record = self.records.allocate(size)
        if header is None:
            intact, _ = recv_payload(channel, request, record)
        else:
            record[:header.length] = request.header_bytes
            intact, trailer = recv_payload(channel, request, record[header.length:])
            record[record.size - TRAILER.size:] = np.frombuffer(trailer, np.uint8)
        if not intact:
            return Status.BAD_REQUEST, f"a record from {channel.peer} was damaged in transit".encode()
        if header is None:  # PUT_RECORDS, as checked above
            return _replied(lambda: self.records.put_records(_split_records(request.text, record)))
        if request.op in (Op.TENSOR, Op.POST):
            return self._take_tensor(record, header, wait=request.op == Op.POST)
        return _replied(lambda: self.records.put_records([(_checked_label(request.text, header), record)]))

    def _take_tensor(self, record: np.ndarray, header: RecordHeader, wait: bool = False) -> tuple[Status, bytes]:
        """Queue a received tensor for `recv_tensor`, or say why not: refused here, or the inbox is full. A
        posted tensor (`wait`) waits up to the server's timeout for room: its sender is held back meanwhile."""
        if not self.options.accept_tensors:
            return Status.BAD_REQUEST, b"this server takes no tensors (it serves a store)"
        payload = torch.from_numpy(record[header.length:header.length + header.payload_length])
        try:
            self._inbox.put(payload.view(torch_dtype(header.dtype)).view(header.shape), block=wait,
                            timeout=self.timeout if wait else None)
        except queue.Full:
            return Status.BUSY, f"the inbox holds {self.options.inbox_size} tensors nobody took yet".encode()
        return Status.OK, b""


def _replied(action: Callable[[], bytes | None]) -> tuple[Status, bytes]:
    """Run a request's store operation: OK with what it returns, or the error reply its failure deserves."""
    try:
        return Status.OK, action() or b""
    except (BlockNotFound, ConfigError, CorruptBlock, StoreError) as error:
        return _error_reply(error)


def _checked_label(name: str, header: RecordHeader) -> str:
    """The block name a PUT names, if the record it carries was encoded under that name."""
    name = _block_name(name)
    if header.label != name:
        raise corrupt(name, f"the record holds block {header.label!r}")
    return name


def _outside(request: Message, scope: Scope) -> str | None:
    """The first name a request reaches that its connection's scope does not allow, if any."""
    if not scope.prefix or request.op in (Op.TENSOR, Op.POST, Op.HELLO):
        return None
    if request.op == Op.LIST:
        prefix = request.text
        return None if not prefix or scope.allows(prefix) else prefix
    if request.op == Op.PUT_RECORDS:
        names = [line.partition(" ")[2] for line in request.text.split("\n")]
    elif request.op == Op.REMOVE:
        names = request.text.split("\n")
    else:
        names = [request.text]
    return next((name for name in names if not scope.allows(name)), None)


def _split_records(meta: str, payload: np.ndarray) -> list[NamedRecord]:
    """PUT_RECORDS' payload cut into its records, as its "size name" lines say; ConfigError if they lie."""
    lines = [line.partition(" ") for line in meta.split("\n")]
    try:
        sizes = [int(size) for size, _, _ in lines]
    except ValueError:
        raise ConfigError("PUT_RECORDS needs one 'size name' line per record") from None
    entries = [(size, _block_name(name)) for size, (_, _, name) in zip(sizes, lines, strict=True)]
    if any(size < 0 for size, _ in entries) or sum(size for size, _ in entries) != payload.size:
        raise ConfigError(f"PUT_RECORDS sizes do not add up to its {payload.size}-byte payload")
    records, start = [], 0
    for size, name in entries:  # views into the one buffer the store allocated: no copies
        records.append((name, payload[start:start + size]))
        start += size
    return records


def _block_name(name: str) -> str:
    """Accept only names of blocks, manifests and progress records, so a peer cannot reach outside the
    store (paths)."""
    stream_id, _, rest = name.partition("/")
    if rest == "manifest" and name == manifest_name(stream_id):
        return name
    if progress_key_or_none(name) is None:
        BlockKey.parse(name)
    return name


def _listing_prefix(prefix: str) -> str:
    """Accept "" (everything) or one stream's "stream_id/"."""
    if prefix and not (prefix.endswith("/") and check_stream_id(prefix[:-1])):
        raise ConfigError(f"cannot list {prefix!r}")
    return prefix


def _error_reply(error: DejaVuError) -> tuple[Status, bytes]:
    if isinstance(error, BlockNotFound):
        status = Status.NOT_FOUND
    elif isinstance(error, CorruptBlock):
        status = Status.CORRUPT
    elif isinstance(error, ConfigError):
        status = Status.BAD_REQUEST
    else:
        status = Status.FAILED
    return status, str(error).encode()
