"""A real S3 API on loopback for the remote-checkpoint tests: moto's standalone server (``moto[server]``).

`s3_server` starts ``moto_server`` on 127.0.0.1 on a free port, creates the bucket ``ckpt``, points fsspec at it
through the environment (``FSSPEC_S3_ENDPOINT_URL`` and the ``AWS_*`` variables, so that spawned ranks, which
inherit the environment, use it too) and always stops it. Tests skip, naming what to install, when moto or the
``distfn[s3]`` extra (fsspec, s3fs) is missing. Nothing here reaches the internet.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

BUCKET = "ckpt"
#: Few, quick attempts: a test that stops the server must fail in seconds, not minutes.
FAST_FAILURE = {"config_kwargs": {"connect_timeout": 2, "read_timeout": 20,
                                                 "retries": {"max_attempts": 2}}}

needs_s3 = pytest.mark.skipif(
    importlib.util.find_spec("fsspec") is None or importlib.util.find_spec("s3fs") is None
    or shutil.which("moto_server", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    is None,
    reason="needs the 'distfn[s3]' extra (fsspec, s3fs) and moto's S3 server: pip install -e '.[s3]' 'moto[server]'")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@attrs.define
class S3Server:
    """A running moto server: its endpoint, the environment that points fsspec at it, and its process."""

    endpoint: str
    env: dict[str, str]
    process: subprocess.Popen[bytes]

    def url(self, *parts: str) -> str:
        """``s3://ckpt/<parts...>``."""
        return "s3://" + "/".join([BUCKET, *parts])

    def stop(self) -> None:
        """Stop the server (tests of a server gone mid-upload call this themselves)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def start(env_extra: dict[str, str] | None = None) -> S3Server:
    """Start a moto server with the bucket `BUCKET` (the caller stops it)."""
    port = _free_port()
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert exe is not None
    process = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env={**os.environ, **(env_extra or {})})
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=2).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.2)
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT"), timeout=10).close()
    env = {"FSSPEC_S3_ENDPOINT_URL": endpoint, "FSSPEC_S3": json.dumps(FAST_FAILURE),
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    return S3Server(endpoint, env, process)


def use(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point this process's fsspec (and the environment its subprocesses inherit) at ``server``."""
    import fsspec.config

    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(fsspec.config.conf, "s3", {**FAST_FAILURE, "endpoint_url": server.endpoint})


@pytest.fixture(scope="module")
def s3_module() -> Iterator[S3Server]:
    server = start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_module: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The module's moto server, with fsspec pointed at it for this test."""
    use(s3_module, monkeypatch)
    return s3_module


def list_keys(server: S3Server, prefix: str = "") -> list[str]:
    """Every key in the bucket under ``prefix`` (straight from the server, no cache)."""
    import s3fs

    s3 = s3fs.S3FileSystem(endpoint_url=server.endpoint, key="testing", secret="testing", skip_instance_cache=True,
                           use_listings_cache=False)
    return sorted(p[len(BUCKET) + 1:] for p in s3.find(f"{BUCKET}/{prefix}"))


def uploads(server: S3Server) -> list[str]:
    """The keys of the unfinished multipart uploads in the bucket."""
    import s3fs

    s3 = s3fs.S3FileSystem(endpoint_url=server.endpoint, key="testing", secret="testing", skip_instance_cache=True)
    return sorted(u["Key"] for u in s3.list_multipart_uploads(BUCKET))


REPO = Path(__file__).resolve().parents[1]


class Killed(Exception):
    """What every S3 request raises once `Requests` has "killed" the process (its writer can reach the store no
    more: its cleanup cannot run, exactly as after SIGKILL)."""


@attrs.define
class Requests:
    """Every S3 API request this process makes (aiobotocore's ``_make_api_call``, below s3fs's and distfn's retries:
    uploads, parts, completions, look-ups, listings), counted, with a fault at a chosen one.

    ``kill_at=k``: request ``k`` (0-based) and every later one raise `Killed`, until `revive`. ``hook``: called
    with ``(index, operation, params)`` before each request (to pause a writer, or to inject an answer by raising).
    """

    seen: list[tuple[str, str]] = attrs.field(factory=list)
    kill_at: int | None = None
    hook: object = None

    def revive(self) -> None:
        self.kill_at = None


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> Requests:
    """Count (and fault) this process's S3 requests for one test (`Requests`)."""
    from aiobotocore.client import AioBaseClient

    record = Requests()
    real = AioBaseClient._make_api_call

    async def call(self, operation_name, api_params):  # type: ignore[no-untyped-def]
        index = len(record.seen)
        record.seen.append((operation_name, str(api_params.get("Key", ""))))
        if record.kill_at is not None and index >= record.kill_at:
            raise Killed(f"killed before request {index} ({operation_name})")
        if callable(record.hook):
            record.hook(index, operation_name, api_params)
        return await real(self, operation_name, api_params)

    monkeypatch.setattr(AioBaseClient, "_make_api_call", call)
    return record


# -- a fault-injecting proxy in front of the server ----------------------------------------------------------------
_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your '
              b'request rate.</Message></Error>')


class FaultProxy:
    """A loopback HTTP proxy in front of an `S3Server` that answers chosen requests wrongly (issue 41 part B).

    ``faults[i]`` is what request ``i`` (0-based, counted by the proxy) gets instead of the server's answer:
    ``"drop"`` (the connection closes without an answer), ``"truncate"`` (the server's headers, half its body, then
    the connection closes), ``"500"``, ``"503"``, ``"slowdown"`` (S3's 503 SlowDown), ``"delay:<seconds>"`` (the
    server's answer, late). Requests are forwarded as they came (moto does not check signatures). ``log`` holds
    ``(index, method, path)`` of every request.
    """

    def __init__(self, server: S3Server) -> None:
        import http.client
        import http.server
        import threading
        import urllib.parse

        upstream = urllib.parse.urlsplit(server.endpoint)
        self.faults: dict[int, str] = {}
        self.log: list[tuple[int, str, str]] = []
        lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _body(self) -> bytes:
                if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
                    return self.rfile.read(int(self.headers.get("Content-Length") or 0))
                data = bytearray()  # HTTP chunks, forwarded whole with a length (an aws-chunked body stays framed)
                while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                    data += self.rfile.read(size)
                    self.rfile.readline()
                while self.rfile.readline().strip():  # trailers
                    pass
                return bytes(data)

            def _forward(self) -> None:
                body = self._body()
                with lock:
                    index = len(proxy.log)
                    proxy.log.append((index, self.command, self.path))
                    fault = proxy.faults.get(index, "")
                if fault == "drop":
                    self.close_connection = True
                    return
                if fault in ("500", "503", "slowdown"):
                    payload = _SLOW_DOWN if fault == "slowdown" else b"<Error><Code>InternalError</Code></Error>"
                    self._answer(500 if fault == "500" else 503, [("Content-Type", "application/xml")], payload)
                    return
                conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in ("expect", "connection", "transfer-encoding", "content-length")}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                    kept = [(k, v) for k, v in answer.getheaders()
                            if k.lower() not in ("content-length", "transfer-encoding", "connection")]
                finally:
                    conn.close()
                if fault.startswith("delay:"):
                    time.sleep(float(fault.split(":", 1)[1]))
                if fault == "truncate" and self.command != "HEAD":
                    self.send_response(answer.status)
                    for k, v in kept:
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.close_connection = True
                    return
                head = self.command == "HEAD"  # no body, and the object's own length
                self._answer(answer.status, kept, b"" if head else data,
                             length=int(answer.getheader("Content-Length") or 0) if head else None)

            def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes,
                        length: int | None = None) -> None:
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data) if length is None else length))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True, name="fault-proxy").start()

    def at(self, offset: int, fault: str) -> int:
        """Give request ``len(log) + offset`` (counted from now) the fault; its absolute index."""
        index = len(self.log) + offset
        self.faults[index] = fault
        return index

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
