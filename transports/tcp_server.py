"""The `tcp://` server: one thread watches every socket, a bounded pool of workers answers requests.

A connection costs a worker only while its requests are read and answered (and up to `LINGER` seconds after
one, for the next, while no other connection waits for a worker). The rest of the time the watcher holds
it: it accepts, runs TLS handshakes, reads the HELLO that opens every connection (within
`hello_timeout`; when `max_unauthenticated` connections wait for theirs, the oldest is dropped for the
newest), watches authenticated connections for their next request (closing them after `idle_timeout`),
and sends whatever part of a reply the kernel could not take at once (within `timeout`: a reader that
stops reading is dropped then, and the memory its reply held given back). So the server runs `workers`
threads plus one whatever the number of sockets, and a connection that has not said HELLO costs its
socket and the bytes of its HELLO so far.

What a worker may still wait for: the rest of a request once its first byte came (up to `timeout`, as
before: a client that trickles is dropped then), and room in the in-flight budget for a record it
receives. A GET that finds no room waits without a worker.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import errno
import functools
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable

import attrs
import numpy as np

from ..errors import TransportError
from ..store import Store
from ..urls import join_host_port
from .access import Scope
from .channel import ChannelServer, Reply, ServerOptions, Wait
from .sockets import READ_AHEAD_BYTES, SocketChannel, server_tls_context
from .wire import CONTROL, HELLO_BYTES, MAGIC, Channel, IdleTimeout, Message, Op, ProtocolError, recv_message

#: Connections the kernel queues before the server accepts them.
LISTEN_BACKLOG = 1024
#: Seconds a worker waits for a connection's next request before handing it back to the watcher (when no
#: other connection waits for a worker): a client that sends one request after another keeps its worker,
#: as a pipeline's activations and a cache's decode steps do, and pays no hand-over per request.
LINGER = 0.05
_TICK = 0.1  # seconds between checks of every deadline
_ACCEPTS_PER_TURN = 64
_WAKE = object()
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class _Phase(enum.Enum):
    HANDSHAKE = "TLS handshake"
    HELLO = "waiting for HELLO"
    IDLE = "waiting for a request"
    WORKING = "with a worker"
    SENDING = "sending a reply"
    CLOSED = "closed"


@attrs.define(eq=False)
class _Connection:
    """One client's socket and where it is; owned by the watcher, or by one worker while `WORKING`."""

    sock: socket.socket
    peer: str
    phase: _Phase
    since: float  # when the current phase began: accepted, reply started, went idle
    hello: bytearray = attrs.Factory(bytearray)
    channel: SocketChannel | None = None
    scope: Scope | None = None
    outgoing: list[memoryview] = attrs.Factory(list)
    release: Callable[[], None] | None = None  # gives back the memory of the reply being sent
    close_after: bool = False
    admitted: bool = False  # holds one of `max_connections`
    events: int = 0  # what the watcher's selector waits for on it (0: not registered)

    def carry(self, reply: Reply, views: list[memoryview]) -> None:
        """Take on the rest of `reply` (`views`) to send, and what to do once it is out."""
        self.outgoing, self.release, self.close_after = views, reply.release, reply.close


class _BytesChannel(Channel):
    """Bytes already received, read as a channel: parses a HELLO that arrived in pieces (all of them)."""

    byte_stream = True

    def __init__(self, data: bytes, peer: str) -> None:
        self._data, self._at, self.peer = memoryview(data), 0, peer

    @property
    def rest(self) -> bytes:
        return bytes(self._data[self._at:])

    def send(self, *buffers: object) -> None:
        raise ProtocolError("nothing is sent before the HELLO is answered")

    def recv_into(self, buffer: np.ndarray, idle: bool = False) -> None:
        end = self._at + buffer.nbytes
        if end > len(self._data):
            raise ProtocolError(f"{self.peer} sent a HELLO shorter than its control frame says")
        buffer.data.cast("B")[:] = self._data[self._at:end]
        self._at = end

    def close(self) -> None:
        pass


class TcpServer(ChannelServer):
    """Serves a store on a TCP port: one watcher thread and `options.workers` workers. Port 0 picks a free
    port (see `url`). With `options.tls_cert`, every connection is TLS, its handshake run by the watcher
    without blocking, within `hello_timeout`."""

    def __init__(self, store: Store, host: str = "127.0.0.1", port: int = 0, *, scheme: str = "tcp",
                 options: ServerOptions | None = None) -> None:
        settings = options or ServerOptions()
        super().__init__(store, settings)
        self._tls = None if settings.tls_cert is None or settings.tls_key is None else \
            server_tls_context(settings.tls_cert, settings.tls_key)
        self._listener = _listen(scheme, host, port)
        self.url = f"{scheme}://{join_host_port(host, self._listener.getsockname()[1])}"
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        for sock in (self._listener, self._wake_reader, self._wake_writer):
            sock.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, _WAKE)
        self._handed_back: queue.SimpleQueue[tuple[_Connection, _Phase]] = queue.SimpleQueue()
        self._unauthenticated: dict[_Connection, None] = {}  # in the order they came
        self._accepting_again: float | None = None  # when a pause in accepting (no descriptors left) ends
        self._out_of_descriptors = False  # accepting failed for want of them, and has not worked since
        self._open: set[_Connection] = set()
        self._admitted = 0
        self._stopping = False
        self._queued = 0  # connections handed to the pool that no worker took yet
        self._busy = 0  # workers serving a connection
        self._jobs: set[concurrent.futures.Future[None]] = set()  # handed to the pool and not done
        self._queue_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(settings.workers, thread_name_prefix="dejavu-serve-worker")
        self._watcher = threading.Thread(target=self._watch, name=f"dejavu-serve {self.url}", daemon=True)
        self._watcher.start()

    # ---- the watcher ----------------------------------------------------------------------------
    def _watch(self) -> None:
        next_check = 0.0
        while not self._stopping:
            try:
                for key, _ in self._selector.select(_TICK):
                    if key.data is None:
                        self._accept()
                    elif key.data is _WAKE:
                        with contextlib.suppress(OSError):
                            self._wake_reader.recv(4096)
                    else:
                        self._on_ready(key.data)
                self._take_back()
                now = time.monotonic()
                if now >= next_check:
                    self._expire(now)
                    next_check = now + _TICK
            except Exception:  # noqa: PERF203 - a bug here must cost one turn, never the server
                self.log.exception("the watcher of %s failed a turn", self.url)

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                if error.errno not in _OUT_OF_RESOURCES:  # that one connection failed: go on with the next
                    continue
                if not self._out_of_descriptors:  # said once per stretch without them, not every pause
                    self.log.warning("cannot accept connections on %s: %s; pausing %s s at a time", self.url, error,
                                     _TICK)
                    self._out_of_descriptors = True
                self._selector.unregister(self._listener)  # instead of spinning on a listener that stays readable
                self._accepting_again = time.monotonic() + _TICK
                return
            self._out_of_descriptors = False
            sock.setblocking(False)
            phase = _Phase.HELLO
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                phase = _Phase.HANDSHAKE
            if len(self._unauthenticated) >= self.options.max_unauthenticated:
                oldest = next(iter(self._unauthenticated))
                self.log.warning("dropping %s: %d connections wait for their HELLO, and it waited longest",
                                 oldest.peer, len(self._unauthenticated))
                self._close(oldest)
            connection = _Connection(sock, "tcp://" + join_host_port(*address[:2]), phase, time.monotonic())
            self._unauthenticated[connection] = None
            self._open.add(connection)
            self._watch_for(connection, selectors.EVENT_READ)

    def _on_ready(self, connection: _Connection) -> None:
        try:
            if connection.phase is _Phase.HANDSHAKE:
                self._handshake(connection)
            elif connection.phase is _Phase.HELLO:
                self._read_hello(connection)
            elif connection.phase is _Phase.SENDING:
                self._send_more(connection)
            elif connection.phase is _Phase.IDLE:
                self._dispatch(connection)
        except Exception as error:  # whatever a client sent, only its connection pays
            self.log.warning("dropping %s (%s): %s", connection.peer, connection.phase.value, error)
            self._close(connection)

    def _handshake(self, connection: _Connection) -> None:
        sock = connection.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._watch_for(connection, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._watch_for(connection, selectors.EVENT_WRITE)
            return
        connection.phase = _Phase.HELLO
        self._watch_for(connection, selectors.EVENT_READ)
        self._read_hello(connection)  # it may have come with the handshake's last flight

    def _read_hello(self, connection: _Connection) -> None:
        """Read the HELLO as far as it has come, no further than its control frame says it reaches; answer it
        once whole."""
        while True:
            size = _hello_size(connection.hello, connection.peer)
            if size is not None and len(connection.hello) >= size:
                received = _BytesChannel(bytes(connection.hello), connection.peer)
                self._welcome(connection, recv_message(received, self.limits), received.rest)
                return
            try:
                data = connection.sock.recv((size or CONTROL.size) - len(connection.hello))
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                self._watch_for(connection, selectors.EVENT_READ)
                return
            except ssl.SSLWantWriteError:
                self._watch_for(connection, selectors.EVENT_WRITE)
                return
            if not data:
                self.log.info("%s left without saying HELLO", connection.peer)
                self._close(connection)
                return
            connection.hello += data

    def _welcome(self, connection: _Connection, hello: Message, rest: bytes) -> None:
        """Answer a connection's HELLO: from now on it is authenticated (or refused, and closed once told)."""
        del self._unauthenticated[connection]
        connection.hello = bytearray()
        scope, reply = self.greet(hello, self._admitted < self.options.max_connections, connection.peer)
        connection.channel = SocketChannel(connection.sock, connection.peer, self.options.timeout, LINGER)
        connection.channel.prefill(rest)
        if scope is not None:
            connection.scope, connection.admitted = scope, True
            self._admitted += 1
        connection.carry(reply, reply.views())
        connection.phase, connection.since = _Phase.SENDING, time.monotonic()
        self._send_more(connection)

    def _send_more(self, connection: _Connection) -> None:
        assert connection.channel is not None
        connection.outgoing = connection.channel.send_within(connection.outgoing, 0)
        if connection.outgoing:
            self._watch_for(connection, selectors.EVENT_WRITE)
            return
        self._give_back_memory(connection)
        if connection.close_after:
            self._close(connection)
        elif connection.channel.buffered():
            self._dispatch(connection)
        else:
            self._go_idle(connection)

    def _go_idle(self, connection: _Connection) -> None:
        connection.phase, connection.since = _Phase.IDLE, time.monotonic()
        self._watch_for(connection, selectors.EVENT_READ)

    def _dispatch(self, connection: _Connection) -> None:
        connection.phase = _Phase.WORKING
        self._watch_for(connection, 0)
        self._submit(connection, None)

    def _take_back(self) -> None:
        """Connections the workers are done with: watched again, sending the rest of a reply, or closed."""
        while True:
            try:
                connection, phase = self._handed_back.get_nowait()
            except queue.Empty:
                return
            if self._stopping or phase is _Phase.CLOSED:
                self._close(connection)
            elif phase is _Phase.SENDING:
                connection.phase, connection.since = phase, time.monotonic()
                self._watch_for(connection, selectors.EVENT_WRITE)
            else:
                self._go_idle(connection)

    def _expire(self, now: float) -> None:
        """Drop connections past their deadline: no HELLO in time, idle too long, a reply not read in time; and
        accept again after a pause."""
        if self._accepting_again is not None and now >= self._accepting_again:
            self._accepting_again = None
            self._selector.register(self._listener, selectors.EVENT_READ, None)
        for connection in list(self._unauthenticated):
            if now - connection.since < self.options.hello_timeout:
                break  # in the order they came: the rest are younger
            self.log.warning("dropping %s: no HELLO within %s s", connection.peer, self.options.hello_timeout)
            self._close(connection)
        idle, timeout = self.options.idle_timeout, self.options.timeout
        for connection in list(self._open):
            if connection.phase is _Phase.IDLE and idle is not None and now - connection.since > idle:
                self.log.debug("%s sent no request for %s s: closing its connection", connection.peer, idle)
                self._close(connection)
            elif connection.phase is _Phase.SENDING and timeout is not None and now - connection.since > timeout:
                self.log.warning("dropping %s: it did not read its reply within %s s", connection.peer, timeout)
                self._close(connection)
        self.budget.expire(now)

    def _watch_for(self, connection: _Connection, events: int) -> None:
        if events == connection.events:
            return
        if not events:
            self._selector.unregister(connection.sock)
        elif connection.events:
            self._selector.modify(connection.sock, events, connection)
        else:
            self._selector.register(connection.sock, events, connection)
        connection.events = events

    def _give_back_memory(self, connection: _Connection) -> None:
        release, connection.release, connection.outgoing = connection.release, None, []
        if release is not None:
            release()

    def _close(self, connection: _Connection) -> None:
        self._unauthenticated.pop(connection, None)
        self._open.discard(connection)
        if connection.events:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(connection.sock)
            connection.events = 0
        self._give_back_memory(connection)
        if connection.admitted:
            connection.admitted = False
            self._admitted -= 1
        connection.phase = _Phase.CLOSED
        _close_socket(connection.sock)

    # ---- the workers ----------------------------------------------------------------------------
    def _submit(self, connection: _Connection, resumed: Callable[[], Reply | Wait | None] | None) -> None:
        with self._queue_lock:
            self._queued += 1
            job = self._pool.submit(self._work, connection, resumed)
            self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)

    def _work(self, connection: _Connection, resumed: Callable[[], Reply | Wait | None] | None) -> None:
        """Answer a connection's requests while they come (for up to `LINGER` seconds between two, while no
        other connection waits for a worker), then hand it back to the watcher."""
        with self._queue_lock:
            self._queued -= 1
            self._busy += 1
        try:
            self._serve(connection, resumed)
        finally:
            with self._queue_lock:
                self._busy -= 1

    def _serve(self, connection: _Connection, resumed: Callable[[], Reply | Wait | None] | None) -> None:
        channel = connection.channel
        assert channel is not None
        channel.lend_read_ahead(_worker_read_ahead())
        try:
            after = self._answer_while_they_come(connection, resumed)
        except Exception as error:  # every way a connection ends is logged; none escapes
            self.ended(channel, error)
            after = _Phase.CLOSED
        finally:
            channel.keep_unread()  # before any other thread may serve the connection
        if isinstance(after, Wait):
            deadline = time.monotonic() + self.room_wait
            self.budget.wait(after.size, deadline, functools.partial(self._resume, connection, after))
        else:
            self._hand_back(connection, after)

    def _answer_while_they_come(self, connection: _Connection,
                                resumed: Callable[[], Reply | Wait | None] | None) -> _Phase | Wait:
        """Answer the connection's requests (carrying on `resumed` first) while they come; what comes next:
        the phase to hand it back in, or a wait for room in the budget."""
        channel, scope = connection.channel, connection.scope
        assert channel is not None
        assert scope is not None
        while True:
            if resumed is None:
                try:  # the first request is there already; the next ones may come within LINGER
                    request = recv_message(channel, self.limits, idle=True)
                except IdleTimeout:
                    return _Phase.IDLE
                outcome = self.respond(channel, request, scope)
            else:
                outcome, resumed = resumed(), None
            if isinstance(outcome, Wait):
                return outcome
            if outcome is not None and self._sent_part(connection, outcome):
                return _Phase.SENDING
            outcome = None  # its copy goes now, not after the next request
            if not channel.buffered() and (self._queued or self._busy >= self.options.workers):
                return _Phase.IDLE  # no worker would be free for another connection's request meanwhile

    def _sent_part(self, connection: _Connection, reply: Reply) -> bool:
        """Send what the socket takes of `reply` within `LINGER`; whether some is left for the watcher to send
        (a slow reader's)."""
        assert connection.channel is not None
        try:
            rest = connection.channel.send_within(reply.views(), LINGER)
        except BaseException:
            reply.release()
            raise
        if not rest:
            reply.release()
            return False
        connection.carry(reply, rest)
        return True

    def _resume(self, connection: _Connection, wait: Wait, granted: bool) -> None:
        try:
            if self._stopping:
                raise RuntimeError("stopping")
            self._submit(connection, functools.partial(wait.resume, granted))
        except RuntimeError:  # the pool is shut down: nobody will carry the request on
            if granted:
                self.budget.release(wait.size)

    def _hand_back(self, connection: _Connection, phase: _Phase) -> None:
        """Give a connection back to the watcher, which alone changes its phase from `WORKING`."""
        self._handed_back.put((connection, phase))
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"\0")

    # ---- stopping -------------------------------------------------------------------------------
    def stopping(self) -> bool:
        return self._stopping

    def _stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"\0")
        self._watcher.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for connection in list(self._open):  # workers' too: their next call on it fails, and they stop
            self._close(connection)
        with self._queue_lock:
            running = list(self._jobs)
        concurrent.futures.wait(running, timeout=10)  # none may touch the store once this returns
        self._take_back()
        for sock in (self._listener, self._wake_reader, self._wake_writer):
            _close_socket(sock)
        self._selector.close()


def _hello_size(received: bytearray, peer: str) -> int | None:
    """How many bytes the HELLO that `received` begins takes, once its control frame is in (else None);
    ProtocolError for a frame that cannot be a HELLO, before anything is allocated for it."""
    if len(received) < CONTROL.size:
        return None
    magic, _, op, _, meta_length, header_length, payload_length, _ = CONTROL.unpack_from(received)
    if magic != MAGIC:
        raise ProtocolError(f"{peer} sent a frame that does not start with {MAGIC!r}")
    if op != Op.HELLO or header_length or payload_length or CONTROL.size + meta_length > HELLO_BYTES:
        raise ProtocolError(f"{peer} did not open with a HELLO (op {op}, {meta_length} + {header_length} + "
                            f"{payload_length} bytes): a connection opens with HELLO and its token")
    return CONTROL.size + meta_length


_read_ahead = threading.local()


def _worker_read_ahead() -> memoryview:
    """This worker thread's read-ahead buffer, lent to each connection it serves."""
    buffer = getattr(_read_ahead, "buffer", None)
    if buffer is None:
        buffer = _read_ahead.buffer = memoryview(bytearray(READ_AHEAD_BYTES))
    return buffer


def _listen(scheme: str, host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(LISTEN_BACKLOG)
    except OSError as error:
        listener.close()
        raise TransportError(f"cannot listen on {scheme}://{join_host_port(host, port)}: {error}") from error
    return listener


def _close_socket(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
