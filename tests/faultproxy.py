"""A fault-injecting HTTP proxy for the storage tests: it sits on 127.0.0.1 between an S3
client (``AWS_ENDPOINT_URL`` pointed at :attr:`FaultProxy.url`) and the real test server, and
answers chosen requests with the faults object storage shows under load:

- ``"503"``: ``503 SlowDown`` with S3's XML error body (throttling), request not forwarded;
- ``"reset"``: the connection closed abruptly (TCP RST) after the request was read;
- ``"reset_mid"``: the request forwarded, the response's head and part of its body sent, then
  the connection reset (a download cut off half way);
- ``"stall"``: no answer for ``seconds``; then the request is forwarded if the client is still
  waiting (a slow server) or dropped if it gave up (no late duplicate reaches the server).

Faults are a bounded schedule (:meth:`FaultProxy.inject`), matched by method and a regex on
the request target; :attr:`FaultProxy.served` counts the faults actually served. One request
per connection (``Connection: close``), one thread per connection, every socket with a
timeout: nothing outlives :meth:`FaultProxy.stop`. Request bodies are relayed byte for byte
(``Content-Length`` or chunked), so the client's signatures stay valid.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType

KINDS = ("503", "reset", "reset_mid", "stall")
_TIMEOUT = 30.0  # seconds any socket read may block
_MAX_HEAD = 64 * 1024

_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message>"
    b"<RequestId>faultproxy</RequestId></Error>"
)


@dataclass
class Fault:
    """``count`` more requests matching ``method`` and ``path_regex`` get fault ``kind``."""

    kind: str
    count: int
    method: str | None = None
    path_regex: str | None = None
    seconds: float = 0.0  # stall
    after_bytes: int = 1024  # reset_mid: body bytes sent before the reset

    def matches(self, method: str, target: str) -> bool:
        return (
            self.count > 0
            and (self.method is None or self.method == method)
            and (self.path_regex is None or re.search(self.path_regex, target) is not None)
        )


@dataclass
class _Request:
    method: str
    target: str
    head: bytes  # request line and headers, as forwarded
    body: bytes  # raw, framing included when chunked
    headers: dict[str, str] = field(default_factory=dict)


class _ClosedError(Exception):
    """The peer closed the connection before a whole message arrived."""


def _read_head(sock: socket.socket, buf: bytearray) -> bytes:
    while b"\r\n\r\n" not in buf:
        if len(buf) > _MAX_HEAD:
            raise _ClosedError("head too large")
        data = sock.recv(65536)
        if not data:
            raise _ClosedError("closed before the head")
        buf += data
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end])
    del buf[:end]
    return head


def _read_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        data = sock.recv(max(65536, n - len(buf)))
        if not data:
            raise _ClosedError("closed in the body")
        buf += data
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _read_line(sock: socket.socket, buf: bytearray) -> bytes:
    while b"\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            raise _ClosedError("closed in a chunk")
        buf += data
    end = buf.index(b"\r\n") + 2
    line = bytes(buf[:end])
    del buf[:end]
    return line


def _read_chunked(sock: socket.socket, buf: bytearray) -> bytes:
    """A chunked body, framing and trailers included, as received."""
    out = bytearray()
    while True:
        line = _read_line(sock, buf)
        out += line
        size = int(line.split(b";")[0].strip(), 16)
        if size == 0:
            while True:  # trailers up to the empty line
                trailer = _read_line(sock, buf)
                out += trailer
                if trailer == b"\r\n":
                    return bytes(out)
        out += _read_exact(sock, buf, size + 2)


def _parse_headers(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
    return lines[0], headers


def _build_head(first: str, headers: list[tuple[str, str]]) -> bytes:
    return ("\r\n".join([first, *(f"{k}: {v}" for k, v in headers)]) + "\r\n\r\n").encode("latin-1")


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP RST (SO_LINGER 0), as a crashed server or a middlebox does."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _client_gone(sock: socket.socket) -> bool:
    """Whether the client closed its end (a readable socket with nothing to read)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class FaultProxy:
    """The proxy, on a free port of 127.0.0.1, forwarding to ``upstream``
    (``http://127.0.0.1:PORT``). Use as a context manager, or :meth:`start` / :meth:`stop`."""

    def __init__(self, upstream: str) -> None:
        match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/?", upstream)
        if not match:
            raise ValueError(f"upstream must be http://127.0.0.1:PORT, not {upstream}")
        self.upstream = ("127.0.0.1", int(match.group(1)))
        self.served: Counter[str] = Counter()
        self.requests: list[tuple[str, str]] = []  # (method, target) of every request seen
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # ---------------------------------------------------------------- control

    def inject(
        self,
        kind: str,
        count: int = 1,
        method: str | None = None,
        path_regex: str | None = None,
        seconds: float = 0.0,
        after_bytes: int = 1024,
    ) -> None:
        """The next ``count`` requests matching ``method`` (any when None) and ``path_regex``
        (searched in the request target, path and query) get fault ``kind``."""
        if kind not in KINDS:
            raise ValueError(f"fault kind {kind!r}: one of {KINDS}")
        if kind == "stall" and not 0 < seconds <= _TIMEOUT:
            raise ValueError(f"a stall needs 0 < seconds <= {_TIMEOUT}")
        with self._lock:
            self._faults.append(Fault(kind, count, method, path_regex, seconds, after_bytes))

    def clear(self) -> None:
        """Drop the faults not served yet."""
        with self._lock:
            self._faults.clear()

    @property
    def pending(self) -> int:
        """Faults scheduled and not served yet."""
        with self._lock:
            return sum(f.count for f in self._faults)

    def _take(self, method: str, target: str) -> Fault | None:
        with self._lock:
            self.requests.append((method, target))
            for fault in self._faults:
                if fault.matches(method, target):
                    fault.count -= 1
                    self.served[fault.kind] += 1
                    return fault
        return None

    # ---------------------------------------------------------------- life cycle

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._handle(self.request)

        server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler, bind_and_activate=True)
        server.daemon_threads = True
        self._server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---------------------------------------------------------------- one connection

    def _handle(self, client: socket.socket) -> None:
        client.settimeout(_TIMEOUT)
        try:
            request = self._read_request(client)
        except (_ClosedError, OSError, ValueError):
            client.close()
            return
        fault = self._take(request.method, request.target)
        try:
            if fault is None:
                self._forward(client, request)
            elif fault.kind == "503":
                self._answer_503(client)
            elif fault.kind == "reset":
                _reset(client)
                return
            elif fault.kind == "reset_mid":
                self._forward(client, request, reset_after=fault.after_bytes)
                return
            elif fault.kind == "stall":
                deadline = time.monotonic() + fault.seconds
                while time.monotonic() < deadline and not _client_gone(client):
                    time.sleep(0.05)
                if _client_gone(client):
                    client.close()
                    return
                self._forward(client, request)
        except (_ClosedError, OSError):
            pass
        finally:
            with contextlib.suppress(OSError):
                client.close()

    def _read_request(self, client: socket.socket) -> _Request:
        buf = bytearray()
        head = _read_head(client, buf)
        first, headers = _parse_headers(head)
        method, target, _version = first.split(" ", 2)
        names = {k.lower(): v for k, v in headers}
        if names.get("expect", "").lower() == "100-continue":
            # answer it here, so that the body is sent before any fault or forwarding
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if "chunked" in names.get("transfer-encoding", "").lower():
            body = _read_chunked(client, buf)
        else:
            body = _read_exact(client, buf, int(names.get("content-length", "0")))
        # Expect is never signed (SigV4 leaves it out); the upstream gets one request per
        # connection: Connection is not signed either
        kept = [(k, v) for k, v in headers if k.lower() not in ("expect", "connection")]
        kept.append(("Connection", "close"))
        return _Request(method, target, _build_head(first, kept), body, names)

    def _answer_503(self, client: socket.socket) -> None:
        head = _build_head(
            "HTTP/1.1 503 Slow Down",
            [
                ("Content-Type", "application/xml"),
                ("Content-Length", str(len(_SLOWDOWN))),
                ("Connection", "close"),
            ],
        )
        client.sendall(head + _SLOWDOWN)

    def _forward(self, client: socket.socket, request: _Request, reset_after: int = -1) -> None:
        with socket.create_connection(self.upstream, timeout=_TIMEOUT) as up:
            up.sendall(request.head + request.body)
            buf = bytearray()
            head = _read_head(up, buf)
            while head.startswith(b"HTTP/1.1 100") or head.startswith(b"HTTP/1.0 100"):
                head = _read_head(up, buf)
            first, headers = _parse_headers(head)
            kept = [(k, v) for k, v in headers if k.lower() not in ("connection", "keep-alive")]
            kept.append(("Connection", "close"))
            client.sendall(_build_head(first, kept))
            sent = 0
            while True:  # the upstream closes after the response (Connection: close)
                if buf:
                    data = bytes(buf)
                    buf.clear()
                else:
                    data = up.recv(65536)
                if not data:
                    return
                if reset_after >= 0 and sent + len(data) >= reset_after:
                    client.sendall(data[: max(reset_after - sent, 0)])
                    _reset(client)
                    return
                client.sendall(data)
                sent += len(data)
