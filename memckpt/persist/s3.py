"""S3 (or any S3-compatible endpoint) as a storage backend, through boto3.

An object appears whole when its (multipart) upload completes. Credentials and region come
from the standard AWS chain; the endpoint from ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``
(read by boto3 itself) or ``MEMCKPT_S3_ENDPOINT_URL``. Messages never carry credentials.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import re
import threading
from typing import Any, Callable, Iterable, Optional

import numpy as np

from memckpt.persist.backend import (
    CHUNK,
    Data,
    MiB,
    StorageBackend,
    as_bytes_view,
    check_key,
    check_prefix,
    check_range,
    sanitize_url,
    scrub,
)
from memckpt.errors import ObjectNotFoundError, PersistError, UnsafeKeyError

log = logging.getLogger("memckpt.persist")

_S3_URI = re.compile(r"^s3://([^/]+)/?(.*)$")
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


class _MemoryFile(io.RawIOBase):
    """A seekable file over a memoryview of bytes (no copy)."""

    def __init__(self, buf: memoryview) -> None:
        super().__init__()
        self._buf, self._pos = buf, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._buf)}[whence]
        self._pos = max(0, base + offset)
        return self._pos


class _Reader(_MemoryFile):
    """Read-only, for boto3 uploads."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._buf) - self._pos))
        out[:n] = self._buf[self._pos: self._pos + n]
        self._pos += n
        return n


class _Writer(_MemoryFile):
    """Writing into a preallocated uint8 array, for boto3 downloads; ``received()`` after
    each write (bytes arriving are progress; bytes sent are not: a retry re-sends them)."""

    def __init__(self, out: np.ndarray, received: Callable[[], None]) -> None:
        super().__init__(memoryview(out))
        self._received = received
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        end = self._pos + len(data)
        if end > len(self._buf):
            raise OSError(errno.EFBIG, "the object grew while it was downloaded")
        self._buf[self._pos: end] = data
        self._pos = end
        self.written += len(data)
        self._received()
        return len(data)


_RETRYABLE_CODES = {"SlowDown", "RequestTimeout", "RequestTimeoutException", "Throttling",
                    "ThrottlingException", "InternalError", "ServiceUnavailable",
                    "RequestLimitExceeded", "BandwidthLimitExceeded", "503", "500"}
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
               "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "403"}
_MISSING_CODES = {"NoSuchKey", "NotFound", "404"}


def _stream(body: Any, writer: _Writer, size: int) -> None:
    """Copy a GET's streaming body into ``writer`` (up to ``size`` bytes), then close it."""
    try:
        while writer.written < size:
            chunk = body.read(min(CHUNK, size - writer.written))
            if not chunk:
                break
            writer.write(chunk)
    finally:
        body.close()


class S3Backend(StorageBackend):
    """Objects under ``s3://bucket/prefix`` (S3 or any S3-compatible endpoint).

    Large objects are uploaded and downloaded in parallel parts (boto3's
    transfer manager): above ``multipart_threshold`` bytes, in parts of
    ``multipart_chunksize`` (at least 5 MiB, S3's minimum), ``max_concurrency``
    at a time. botocore retries transient errors ``max_attempts`` times before a
    :class:`PersistError` is raised. Each attempt gives up after ``connect_timeout``
    seconds to connect and ``read_timeout`` seconds waiting for an answer, so a hung
    endpoint costs at most about ``max_attempts`` times that per request. The backend
    can be pickled (to a Ray actor): the client is re-created on first use.
    """

    def __init__(self, uri: str, *, endpoint_url: Optional[str] = None, region: Optional[str] = None,
                 multipart_threshold: int = 64 * MiB, multipart_chunksize: int = 16 * MiB,
                 max_concurrency: int = 8, max_attempts: int = 3, connect_timeout: float = 10.0,
                 read_timeout: float = 120.0) -> None:
        m = _S3_URI.match(uri) if isinstance(uri, str) else None
        if not m or not _S3_BUCKET.match(m.group(1)) or ".." in m.group(1):
            raise PersistError(f"{uri!r} is not a valid S3 URI: write s3://bucket/prefix with a bucket "
                               "name of 3-63 lowercase letters, digits, dots or hyphens")
        self.bucket = m.group(1)
        prefix = m.group(2).strip("/")
        if prefix:
            check_key(prefix, "S3 prefix")
        self.prefix = prefix + "/" if prefix else ""
        self.uri = f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"
        self._endpoint_arg = endpoint_url or os.environ.get("MEMCKPT_S3_ENDPOINT_URL") or None
        self.region = region
        self.multipart_threshold = int(multipart_threshold)
        self.multipart_chunksize = max(int(multipart_chunksize), 5 * MiB)
        self.max_concurrency = int(max_concurrency)
        self.max_attempts = int(max_attempts)
        self.connect_timeout, self.read_timeout = float(connect_timeout), float(read_timeout)
        self._lock = threading.Lock()
        self._client: Any = None
        self._manager: Any = None

    # pickling: ship the settings, not the client or its thread pools
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_lock=None, _client=None, _manager=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def describe(self) -> str:
        return self.uri

    def location(self) -> str:
        return f"{self.uri} (endpoint {self.endpoint})"

    @property
    def endpoint(self) -> str:
        """The endpoint in use (without any user:password), for messages."""
        if self._client is not None:
            return sanitize_url(self._client.meta.endpoint_url) or "AWS S3"
        url = (self._endpoint_arg or os.environ.get("AWS_ENDPOINT_URL_S3")
               or os.environ.get("AWS_ENDPOINT_URL"))
        return sanitize_url(url) or "AWS S3"

    @property
    def client(self) -> Any:
        """The boto3 client this backend sends its requests through (endpoint, retries and
        timeouts as configured): for a raw write to compare with the tier's own."""
        return self._s3()[0]

    def prepare(self) -> None:
        # Importing boto3 and loading its S3 model costs ~1 s of CPU, much of it in long C
        # calls that hold the GIL: done on the uploader's thread mid-run, every GIL hand-back
        # of a training step waited behind them (a 1.2 s step seen on 2 cores).
        try:
            self._s3()
        except PersistError:
            pass  # a bad endpoint or region: the first upload reports it

    def _s3(self) -> tuple[Any, Any]:
        with self._lock:
            if self._client is None:
                import boto3
                from boto3.s3.transfer import TransferConfig, create_transfer_manager
                from botocore.config import Config as BotoConfig

                custom = (self._endpoint_arg or os.environ.get("AWS_ENDPOINT_URL_S3")
                          or os.environ.get("AWS_ENDPOINT_URL"))
                cfg = BotoConfig(
                    retries={"max_attempts": self.max_attempts, "mode": "standard"},
                    connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                    max_pool_connections=max(10, 2 * self.max_concurrency),
                    # S3-compatible endpoints (MinIO, moto, Ceph) want path-style addressing.
                    s3={"addressing_style": "path"} if custom else None)
                session = boto3.session.Session(region_name=self.region)
                try:
                    self._client = session.client("s3", endpoint_url=self._endpoint_arg, config=cfg)
                except Exception as e:  # bad endpoint URL, unknown region...
                    raise PersistError(f"cannot create an S3 client for {self.uri}: {scrub(str(e))}: "
                                       "check the endpoint URL (AWS_ENDPOINT_URL / "
                                       "MEMCKPT_S3_ENDPOINT_URL) and the region (AWS_DEFAULT_REGION)",
                                       uri=self.uri) from None
                self._client.meta.events.register("after-call.s3", self._answered)
                self._manager = create_transfer_manager(self._client, TransferConfig(
                    multipart_threshold=self.multipart_threshold,
                    multipart_chunksize=self.multipart_chunksize,
                    max_concurrency=self.max_concurrency, use_threads=True,
                    preferred_transfer_client="classic"))
            return self._client, self._manager

    def _answered(self, http_response: Any = None, **_: Any) -> None:
        # botocore's after-call hook: an answer that is not a throttle or a server error
        status = getattr(http_response, "status_code", 500)
        if status < 500 and status != 429:
            self.progressed()

    def close(self) -> None:
        with self._lock:
            if self._manager is not None:
                self._manager.shutdown()
            self._client = self._manager = None

    def _full(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _error(self, op: str, key: str, e: BaseException) -> PersistError:
        from botocore import exceptions as bx

        where = f"{op} {self.uri}/{key}" if key else f"{op} {self.uri}"
        ep = self.endpoint
        if isinstance(e, PersistError):
            return e
        if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError,
                          bx.CredentialRetrievalError, bx.UnknownCredentialError)):
            return PersistError(f"{where} failed: no usable AWS credentials ({type(e).__name__}): set "
                                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or "
                                "give the node an instance / pod role", uri=self.uri)
        streaming = tuple(getattr(bx, n) for n in ("IncompleteReadError", "ResponseStreamingError")
                          if hasattr(bx, n))
        if isinstance(e, (bx.ReadTimeoutError, bx.ConnectTimeoutError)):
            limit = self.read_timeout if isinstance(e, bx.ReadTimeoutError) else self.connect_timeout
            return PersistError(f"{where} failed: the S3 endpoint {ep} did not answer within "
                                f"{limit:g} s ({type(e).__name__}, {self.max_attempts} attempts): "
                                "check that it is up and reachable from this node (network, "
                                "firewall, proxy) and that AWS_ENDPOINT_URL / "
                                "MEMCKPT_S3_ENDPOINT_URL is right", retryable=True, uri=self.uri)
        if isinstance(e, (bx.ConnectionError, bx.HTTPClientError) + streaming):
            return PersistError(f"{where} failed: cannot reach the S3 endpoint {ep} "
                                f"({type(e).__name__}): check that it is up and reachable from this "
                                "node and that AWS_ENDPOINT_URL / MEMCKPT_S3_ENDPOINT_URL is right",
                                retryable=True, uri=self.uri)
        if isinstance(e, bx.ClientError):
            err = e.response.get("Error", {}) if isinstance(e.response, dict) else {}
            code = str(err.get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            detail = scrub(str(err.get("Message", "")) or code)
            if code == "NoSuchBucket":
                return PersistError(f"{where} failed: bucket {self.bucket!r} does not exist at {ep}: "
                                    "create it or fix the URI / endpoint", uri=self.uri)
            if code in _MISSING_CODES or (status == 404 and code != "NoSuchUpload"):
                return ObjectNotFoundError(f"{self.uri}/{key} does not exist", uri=self.uri)
            if code in _AUTH_CODES or status == 403:
                return PersistError(f"{where} failed: access denied ({code}: {detail}): check the "
                                    "credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE / role), that they "
                                    f"may read, write, list and delete in bucket {self.bucket!r}, "
                                    f"and the endpoint {ep}", uri=self.uri)
            if code in _RETRYABLE_CODES or status >= 500 or status == 429:
                return PersistError(f"{where} failed: the S3 endpoint {ep} answered {status or ''} "
                                    f"{code}: {detail} (transient; retry later)", retryable=True,
                                    uri=self.uri)
            return PersistError(f"{where} failed: {code or status}: {detail}: check the bucket "
                                f"{self.bucket!r}, the endpoint {ep} and the credentials",
                                uri=self.uri)
        try:
            from s3transfer.exceptions import RetriesExceededError
            if isinstance(e, RetriesExceededError):
                return PersistError(f"{where} failed: the download kept breaking off "
                                    f"({scrub(str(e))}): check the network to {ep}",
                                    retryable=True, uri=self.uri)
        except ImportError:  # pragma: no cover
            pass
        if isinstance(e, bx.BotoCoreError):
            return PersistError(f"{where} failed: {type(e).__name__}: {scrub(str(e))}: check the "
                                f"endpoint {ep}, the region and the credentials", uri=self.uri)
        if isinstance(e, OSError):
            return PersistError(f"{where} failed: {type(e).__name__}: {scrub(str(e))}",
                                retryable=True, uri=self.uri)
        return PersistError(f"{where} failed: {type(e).__name__}: {scrub(str(e))}", uri=self.uri)

    def put(self, key: str, data: Data) -> None:
        full = self._full(key)
        view = as_bytes_view(data)
        try:
            _, manager = self._s3()
            manager.upload(_Reader(view), self.bucket, full).result()
        except Exception as e:
            raise self._error("put", key, e) from e

    def get(self, key: str) -> np.ndarray:
        full = self._full(key)
        try:
            client, manager = self._s3()
            resp = client.get_object(Bucket=self.bucket, Key=full)
            size = int(resp["ContentLength"])
            out = np.empty(size, dtype=np.uint8)
            writer = _Writer(out, self.progressed)
            if size <= self.multipart_threshold:  # one request: stream the body into the array
                _stream(resp["Body"], writer, size)
            else:  # large: parallel ranged GETs through the transfer manager
                resp["Body"].close()
                from s3transfer.subscribers import BaseSubscriber

                class _Size(BaseSubscriber):
                    def on_queued(self, future: Any, **kwargs: Any) -> None:
                        future.meta.provide_transfer_size(size)

                manager.download(self.bucket, full, writer, subscribers=[_Size()]).result()
        except Exception as e:
            raise self._error("get", key, e) from e
        if writer.written != size:
            raise PersistError(f"get {self.uri}/{key}: received {writer.written} of {size} bytes "
                               "(the object changed while it was read)", retryable=True, uri=self.uri)
        return out

    def get_range(self, key: str, offset: int, length: int) -> np.ndarray:
        check_range(offset, length)
        out = np.empty(length, dtype=np.uint8)
        if not length:
            return out
        full = self._full(key)
        writer = _Writer(out, self.progressed)
        try:
            client, _ = self._s3()
            resp = client.get_object(Bucket=self.bucket, Key=full,
                                     Range=f"bytes={offset}-{offset + length - 1}")
            _stream(resp["Body"], writer, length)
        except Exception as e:
            err = self._error("get", key, e)
            if "InvalidRange" in str(e):  # the object ends before offset
                return out[:0].copy()
            raise err from e
        return out if writer.written == length else out[: writer.written].copy()

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        check_prefix(prefix)
        out: dict[str, int] = {}
        try:
            client, _ = self._s3()
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = obj["Key"][len(self.prefix):]
                    try:
                        check_key(key)
                    except UnsafeKeyError:
                        continue  # "folder" markers and keys other tools wrote
                    out[key] = int(obj["Size"])
        except Exception as e:
            raise self._error("list", prefix, e) from e
        return dict(sorted(out.items()))

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            client, _ = self._s3()
            client.delete_object(Bucket=self.bucket, Key=full)
        except Exception as e:
            err = self._error("delete", key, e)
            if isinstance(err, ObjectNotFoundError):
                return
            raise err from e

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = [self._full(k) for k in keys]
        try:
            client, _ = self._s3()
            for i in range(0, len(keys), 1000):
                resp = client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": k} for k in keys[i: i + 1000]], "Quiet": True})
                errors = [x for x in resp.get("Errors", ()) if x.get("Code") != "NoSuchKey"]
                if errors:
                    first = errors[0]
                    raise PersistError(
                        f"delete under {self.uri} failed for {len(errors)} keys, first "
                        f"{first.get('Key', '')[len(self.prefix):]!r}: {first.get('Code')}: "
                        f"{scrub(str(first.get('Message', '')))}",
                        retryable=first.get("Code") in _RETRYABLE_CODES, uri=self.uri)
        except Exception as e:
            raise self._error("delete", "", e) from e

    def exists(self, key: str) -> bool:
        full = self._full(key)
        try:
            client, _ = self._s3()
            client.head_object(Bucket=self.bucket, Key=full)
            return True
        except Exception as e:
            err = self._error("exists", key, e)
            if isinstance(err, ObjectNotFoundError):
                return False
            raise err from e
