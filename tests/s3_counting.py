"""moto's S3 server with a record of every request it answers: what the listing-once tests and
benchmarks/bench_listing.py count (LISTs, HEADs, GETs of each object and the bytes each sent).

The server is moto's own WSGI application (the one ``ThreadedMotoServer`` serves) behind a werkzeug
server on 127.0.0.1, wrapped by a WSGI middleware that records (method, key, query, Range header,
status, bytes of the body sent). Real HTTP: pyarrow's S3 client (the one the project uses) talks to it
as to a bucket.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from urllib.parse import unquote

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server


class _Quiet(MotoRequestHandler):
    def log_request(self, *args, **kwargs) -> None:  # one line per request on stderr otherwise
        pass


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # /bucket/key, unquoted
    query: str
    range: str
    status: int
    sent: int  # bytes of the response body

    def is_listing(self) -> bool:
        """A ListObjects / ListObjectsV2 of a bucket (GET on the bucket with list-type, prefix or delimiter)."""
        return self.method == "GET" and "/" not in self.path.strip("/") and \
            ("list-type" in self.query or "prefix=" in self.query or "delimiter" in self.query)


class CountingS3:
    """start() / stop(), ``requests`` (everything since start or ``clear()``); ``port`` 0 picks a free port."""

    def __init__(self, port: int = 0):
        self.port, self.requests, self._lock = port, [], threading.Lock()
        self._server = self._thread = None

    def _app(self, app):
        def counting(environ, start_response):
            status = []

            def start(code, headers, exc_info=None):
                status.append(int(code.split()[0]))
                return start_response(code, headers, exc_info)

            body = app(environ, start)
            sent = 0
            try:
                for chunk in body:
                    sent += len(chunk)
                    yield chunk
            finally:
                if hasattr(body, "close"):
                    body.close()
                with self._lock:
                    self.requests.append(Request(environ["REQUEST_METHOD"], unquote(environ.get("PATH_INFO", "")),
                                                 environ.get("QUERY_STRING", ""), environ.get("HTTP_RANGE", ""),
                                                 status[0] if status else 0, sent))
        return counting

    def start(self) -> CountingS3:
        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", self.port, self._app(app), True, request_handler=_Quiet)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = None

    def clear(self) -> None:
        with self._lock:
            self.requests = []

    def seen(self) -> list[Request]:
        with self._lock:
            return list(self.requests)

    def listings(self, prefix: str = "") -> list[Request]:
        """The LIST requests (under ``prefix``, a key prefix, when given)."""
        return [r for r in self.seen() if r.is_listing() and prefix in unquote(r.query)]

    def gets(self, key_suffix: str = "") -> list[Request]:
        """The object GETs (whole or ranged) of keys ending with ``key_suffix``."""
        return [r for r in self.seen() if r.method == "GET" and "/" in r.path.strip("/")
                and r.path.endswith(key_suffix)]

    def heads(self, key_suffix: str = "") -> list[Request]:
        return [r for r in self.seen() if r.method == "HEAD" and r.path.endswith(key_suffix)]

    def bytes_sent(self, key_suffix: str = "") -> int:
        return sum(r.sent for r in self.gets(key_suffix))
