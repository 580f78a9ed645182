"""A real S3 endpoint for the tests: moto's server on a loopback port.

Use it from a test module with ``pytest_plugins = ["tests.s3_server"]`` or by
importing the fixtures. ``s3_endpoint`` (session-scoped) starts
``moto.server.ThreadedMotoServer`` on a free 127.0.0.1 port, sets dummy
credentials and ``AWS_DEFAULT_REGION=us-east-1`` in ``os.environ`` for the
session (restored afterwards), creates the bucket :data:`BUCKET` through boto3
with the endpoint URL and yields the URL. :func:`start_moto` starts an extra,
short-lived server (to stop it under a client).

Endpoints that misbehave, for the storage-failure tests: :class:`MotoProcess` (moto
in its own process, to SIGKILL and restart on the same port), :class:`BlackHole` (a
TCP server that accepts connections and never answers) and :class:`FaultProxy` (a
real HTTP proxy in front of an endpoint that answers S3 errors while told to).
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, Optional

import pytest

from conftest import wait_for

BUCKET = "memckpt-test"
_DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto():
    """Start a moto S3 server on a free loopback port; returns (server, endpoint_url)."""
    from moto.server import ThreadedMotoServer

    last: Exception | None = None
    for _ in range(5):
        port = _free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        try:
            server.start()
        except OSError as e:  # the port was taken between the probe and the bind
            last = e
            continue
        url = f"http://127.0.0.1:{port}"
        _wait_up(port)
        return server, url
    raise RuntimeError(f"cannot start moto's S3 server: {last}")


def _wait_up(port: int, timeout: float = 10.0) -> None:
    def listening() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False

    wait_for(listening, timeout, f"moto's S3 server to listen on port {port}")


def make_bucket(endpoint_url: str, bucket: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1").create_bucket(Bucket=bucket)


class MotoProcess:
    """moto's S3 server in its own process (so stopping it drops every connection and
    its in-memory buckets, as a real endpoint going down would)."""

    def __init__(self, port: int) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.p = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                   "-p", str(port)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            _wait_up(port, timeout=20)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGKILL: connections are refused from here on."""
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


class BlackHole:
    """A TCP server on a loopback port that accepts every connection and never answers
    (a firewall dropping replies, a wedged proxy): a request to it hangs until its timeout."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self._held.append(conn)
            self.accepted += 1

    def close(self) -> None:
        self.sock.close()
        for conn in self._held:
            conn.close()


_S3_ERRORS = {503: ("SlowDown", "Please reduce your request rate."),
              500: ("InternalError", "We encountered an internal error. Please try again.")}
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
        "upgrade", "expect", "content-length"}


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hung up
            super().handle_error(request, client_address)


class FaultProxy:
    """An HTTP proxy on a loopback port in front of ``upstream``: forwards every request,
    except that while ``fail_with`` is 503 or 500 it answers S3's SlowDown / InternalError
    instead, and the next ``fail_next`` requests are answered 503 whatever ``fail_with``."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit("//", 1)[1].split(":")
        self.upstream = (host, int(port))
        self.fail_with: Optional[int] = None
        self.fail_next = 0
        self.failed = 0  # requests answered with an error
        self.forwarded = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, and "Expect: 100-continue" answered

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                body = self._body()
                status = proxy._fault()
                if status is not None:
                    code, message = _S3_ERRORS[status]
                    xml = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>"
                           f"<Message>{message}</Message></Error>").encode()
                    self._reply(status, [("Content-Type", "application/xml")], xml)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    keep = _HOP - ({"content-length"} if self.command == "HEAD" else set())
                    self._reply(resp.status, [(k, v) for k, v in resp.getheaders()
                                              if k.lower() not in keep], data)
                finally:
                    conn.close()
                with proxy._lock:
                    proxy.forwarded += 1

            def _reply(self, status: int, headers: list, data: bytes) -> None:
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                if self.command != "HEAD" or status >= 300:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _fault(self) -> Optional[int]:
        with self._lock:
            if self.fail_next > 0:
                self.fail_next -= 1
                self.failed += 1
                return 503
            if self.fail_with is not None:
                self.failed += 1
            return self.fail_with

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="session")
def aws_test_env() -> Iterator[None]:
    """Dummy AWS credentials and region for the session; the real environment comes back after."""
    saved = {k: os.environ.get(k) for k in (*_DUMMY_ENV, "AWS_PROFILE", "AWS_ENDPOINT_URL",
                                             "AWS_ENDPOINT_URL_S3", "MEMCKPT_S3_ENDPOINT_URL")}
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "MEMCKPT_S3_ENDPOINT_URL"):
        os.environ.pop(k, None)
    os.environ.update(_DUMMY_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3_endpoint(aws_test_env) -> Iterator[str]:
    """The URL of a running moto S3 server holding the bucket :data:`BUCKET`."""
    server, url = start_moto()
    try:
        make_bucket(url, BUCKET)
        yield url
    finally:
        server.stop()


@pytest.fixture
def s3_uri(s3_endpoint) -> str:
    """A fresh ``s3://BUCKET/<unique prefix>`` per test."""
    return f"s3://{BUCKET}/t-{uuid.uuid4().hex[:10]}"
