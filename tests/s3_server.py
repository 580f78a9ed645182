"""A real S3 endpoint for the tests: moto's server on a loopback port.

Use it from a test module with ``pytest_plugins = ["tests.s3_server"]`` or by
importing the fixtures. ``s3_endpoint`` (session-scoped) starts
``moto.server.ThreadedMotoServer`` on a free 127.0.0.1 port, sets dummy
credentials and ``AWS_DEFAULT_REGION=us-east-1`` in ``os.environ`` for the
session (restored afterwards), creates the bucket :data:`BUCKET` through boto3
with the endpoint URL and yields the URL. :func:`start_moto` starts an extra,
short-lived server (to stop it under a client).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from typing import Iterator

import pytest

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
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"moto's S3 server did not listen on port {port}")


def make_bucket(endpoint_url: str, bucket: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1").create_bucket(Bucket=bucket)


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
