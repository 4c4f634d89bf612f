"""Requests to object storage: bounded retries, and errors a user can act on that name the URL.

Every request of `distfn.checkpoint.remote` goes through `attempts`: a throttling answer or a network error is
tried again (at most `ATTEMPTS` times, backing off, each retry logged, and no new attempt once `RETRY_WINDOW_S`
has passed), and what is left becomes the `explain` ed `OSError` (wrong credentials, a missing bucket, an
unreachable server, throttling).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Final, TypeVar

from loguru import logger

from ..errors import CheckpointError

__all__ = ["ATTEMPTS", "RETRY_WINDOW_S", "S3_CONFIG", "as_checkpoint_error", "attempts", "explain", "transient"]

T = TypeVar("T")

#: Attempts of one storage request before a throttling answer or a network error becomes a `CheckpointError`.
ATTEMPTS = 5
#: No new attempt starts once this many seconds have passed since the first: with `S3_CONFIG`'s timeouts a server
#: that accepts connections and never answers fails a call within about 80 s (3 botocore attempts of at most
#: 5 + 20 s, then this window is over), not after minutes of layered retries.
RETRY_WINDOW_S = 30.0
#: The botocore settings distfn gives an ``s3://`` file system when neither the call's ``storage_options`` nor
#: fsspec's configuration set ``config_kwargs``: bounded waits (botocore's own default read timeout is 60 s, and
#: s3fs multiplies its attempts by 5). Throttling answers, 5xx and network errors are retried by botocore
#: (``standard`` mode) and by `attempts`; s3fs's extra layer of attempts is turned off (`locate`).
S3_CONFIG: Final = {"connect_timeout": 5, "read_timeout": 20, "retries": {"mode": "standard", "total_max_attempts": 3}}
_THROTTLED: Final = ("SlowDown", "Throttl", "RequestLimitExceeded", "TooManyRequests", "reduce your request rate",
                     "503", "429")
_DENIED: Final = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                  "InvalidToken", "Forbidden", "403", "NoCredentials", "Unable to locate credentials")

def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def throttled(exc: BaseException) -> bool:
    return any(mark in _text(exc) for mark in _THROTTLED)


def transient(exc: BaseException) -> bool:
    """A throttling answer or a network failure: worth another attempt."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, FileExistsError)):
        return False
    names = {t.__name__ for t in type(exc).__mro__}
    network = bool(names & {"ConnectionError", "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                            "HTTPClientError", "ClientConnectorError", "ServerDisconnectedError", "TimeoutError",
                            "ClientOSError", "IncompleteRead", "ResponseParserError"})
    return network or throttled(exc)


def explain(exc: BaseException, url: object) -> OSError:
    """``exc`` (from fsspec or its storage library) as an `OSError` whose message names ``url`` and the cause: wrong
    credentials, a missing bucket, an unreachable server, throttling."""
    text = _text(exc)
    if isinstance(exc, FileNotFoundError) and "NoSuchBucket" not in text and "bucket" not in text.lower():
        return FileNotFoundError(f"no such object: {url}")
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        return FileNotFoundError(f"the bucket of {url} does not exist ({text}); create it first, or fix the URL")
    if any(mark in text for mark in _DENIED) or isinstance(exc, PermissionError):
        return PermissionError(f"access to {url} was denied: wrong or missing credentials? ({text}). distfn "
                               "uses fsspec's configuration: the storage library's environment variables and "
                               "config files, FSSPEC_<PROTOCOL>_* variables, or storage_options=")
    if throttled(exc):
        return ConnectionError(f"the storage service kept throttling requests for {url} after {ATTEMPTS} "
                               f"attempts ({text}); save less often or from fewer ranks, or raise its limits")
    if transient(exc):
        return ConnectionError(f"cannot reach the storage service for {url} ({text}): is the endpoint right and "
                               "the server up?")
    if isinstance(exc, OSError):
        return exc
    return OSError(f"{url}: {text}")


def attempts(what: str, url: object, call: Callable[[], T]) -> T:
    """``call()``, again after a throttling answer or a network error (at most `ATTEMPTS` times, backing off,
    each retry logged); any failure left becomes the `explain` ed `OSError`."""
    start = time.monotonic()
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return call()
        except CheckpointError:  # distfn's own refusal (a key `urls` refuses): the user's news as it is
            raise
        except Exception as exc:  # the storage libraries raise many types: all are explained
            if attempt == ATTEMPTS or not transient(exc) or time.monotonic() - start > RETRY_WINDOW_S:
                raise explain(exc, url) from exc
            delay = min(0.1 * 2 ** attempt, 5.0)
            logger.warning("{} {}: {} (attempt {} of {}; retrying in {:.1f} s)", what, url, _text(exc), attempt,
                           ATTEMPTS, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


@contextlib.contextmanager
def as_checkpoint_error() -> Iterator[None]:
    """For the metadata operations whose callers expect no `OSError` (`kind`, `listdir`): a failure there (no
    access, no server) is the user's news, not a missing file."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(str(exc)) from exc
