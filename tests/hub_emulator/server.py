"""The HTTP server: :class:`HubEmulator` (lifecycle, fault injection, inspection) and the
threaded server and request handler it runs."""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from hub_emulator.faults import Fault, FaultQueue
from hub_emulator.handlers import HubApi, Reply, injected_reply, parse_route
from hub_emulator.repo import Repos

logger = logging.getLogger("speedtronic.tests.hub_emulator")


@dataclass(frozen=True)
class RequestRecord:
    """One request as the emulator saw it, for assertions."""

    method: str
    path: str
    kind: str
    status: int | None  # None when no reply was sent (hang or drop)
    authorization: str | None
    fault: str | None  # "status", "hang", "drop" or "call" when an injected fault fired


class HubEmulator:
    """A threaded HTTP server emulating the Hub endpoints used by the DiLoCo transport.

    Args:
        require_token: if set, every request must send `Authorization: Bearer <token>`,
            otherwise it gets 401 "Invalid credentials in Authorization header".
        user: namespace for repos created without one (`create_repo("name")`).

        lfs_suffixes: files whose names end with one of these are listed as LFS files, as
            the real Hub lists them (`lfs.oid` = sha256 of the content, `oid` = the git id
            of the pointer file); their content is still stored and served inline.

    Without `require_token`, any token is accepted; writes still need some token, and
    private repos answer 401 RepoNotFound to anonymous reads, as on the real Hub.
    """

    def __init__(
        self,
        require_token: str | None = None,
        user: str = "emulator-user",
        lfs_suffixes: tuple[str, ...] = (),
    ) -> None:
        self.require_token = require_token
        self.user = user
        self.lfs_suffixes = tuple(lfs_suffixes)
        # False models a proxy that strips the header naming the commit a file was served from.
        self.send_repo_commit = True
        self._repos = Repos()
        self._api = HubApi(self._repos, self)
        self._faults = FaultQueue()
        self._log_lock = threading.Lock()
        self._log: list[RequestRecord] = []
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> HubEmulator:
        """Bind a free port on 127.0.0.1 and serve in a background thread."""
        self._stopping.clear()
        self._server = _Server(("127.0.0.1", 0), _Handler, self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; releases hung requests and closes kept-alive client connections."""
        if self._server is None:
            return
        self._stopping.set()
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> HubEmulator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """Base URL to pass as `HfApi(endpoint=...)` / `hf_hub_download(endpoint=...)`."""
        if self._server is None:
            raise RuntimeError("HubEmulator is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- fault injection ---------------------------------------------------------------

    def inject(
        self,
        kind: str,
        status: int = 503,
        count: int = 1,
        retry_after: int | None = None,
        method: str | None = None,
        message: str | None = None,
    ) -> None:
        """Answer the next `count` requests of `kind` with `status` (and `Retry-After`;
        `message` replaces the error text the reply carries)."""
        self._faults.add(Fault(kind, method, count, "status", status, retry_after, message=message))

    def inject_hang(
        self, kind: str, seconds: float, count: int = 1, method: str | None = None
    ) -> None:
        """Hold the next `count` requests of `kind` for `seconds` (or until `stop`), then
        close the connection without replying and without applying the request."""
        self._faults.add(Fault(kind, method, count, "hang", seconds=seconds))

    def inject_drop(
        self, kind: str, count: int = 1, after_apply: bool = False, method: str | None = None
    ) -> None:
        """Close the connection of the next `count` requests of `kind` without a reply.

        With `after_apply`, the request takes effect first (e.g. the commit lands) and only
        the response is lost.
        """
        self._faults.add(Fault(kind, method, count, "drop", after_apply=after_apply))

    def inject_call(
        self, kind: str, callback: Callable[[], object], count: int = 1, method: str | None = None
    ) -> None:
        """Run `callback()` when the next `count` requests of `kind` arrive, then serve them
        normally. The callback runs in the server thread without the emulator's lock, so it
        may itself make requests (another client committing first, say); its exceptions
        are logged and the request is served anyway."""
        self._faults.add(Fault(kind, method, count, "call", callback=callback))

    def clear_faults(self) -> None:
        """Forget every pending fault."""
        self._faults.clear()

    def faults_left(self) -> int:
        """How many injected failures have not fired yet."""
        return self._faults.left()

    # -- state inspection and seeding --------------------------------------------------

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request served so far, oldest first."""
        with self._log_lock:
            return list(self._log)

    def add_repo(
        self, repo_id: str, private: bool = False, files: dict[str, bytes] | None = None
    ) -> str:
        """Create a repo server-side (bypassing HTTP); returns the head commit sha."""
        return self._repos.add(repo_id, private, files)

    def set_visibility(self, repo_id: str, private: bool) -> None:
        """Make a repo private or public."""
        self._repos.set_visibility(repo_id, private)

    def head(self, repo_id: str, branch: str = "main") -> str:
        """Commit sha a branch points to."""
        return self._repos.head(repo_id, branch)

    def history(self, repo_id: str, branch: str = "main") -> list[str]:
        """Commit shas of a branch, oldest first."""
        return self._repos.history(repo_id, branch)

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Copy of the file contents at a branch or commit sha."""
        return self._repos.files(repo_id, revision)

    def stored_bytes(self, repo_id: str) -> int:
        """Bytes the repository's stored commits hold (history included, each distinct file
        content counted once)."""
        return self._repos.stored_bytes(repo_id)

    def tamper(self, repo_id: str, path: str, data: bytes, revision: str = "main") -> None:
        """Replace a file's bytes inside an existing commit, keeping its sha.

        Models corruption a checksum recorded elsewhere must catch. A client cache that
        already holds this commit's file keeps serving the old bytes.
        """
        self._repos.tamper(repo_id, path, data, revision)

    # -- request handling (called from server threads) ---------------------------------

    def serve(self, handler: _Handler, body: bytes) -> Reply | None:
        """Apply faults and route one request; None means: close without replying."""
        method = handler.command
        url = urlsplit(handler.path)
        route = parse_route(method, url.path)
        auth = handler.headers.get("Authorization")
        fault = self._faults.take(route.kind, method)
        action = fault.action if fault is not None else None

        def answer() -> Reply:
            return self._api.handle(route, method, parse_qs(url.query), auth, body)

        def record(status: int | None) -> None:
            entry = RequestRecord(method, url.path, route.kind, status, auth, action)
            with self._log_lock:
                self._log.append(entry)

        if fault is not None and fault.callback is not None:
            try:
                fault.callback()
            except Exception:
                logger.exception("inject_call callback failed")
            # Served normally from here on; the record still says a callback ran first.
            reply = answer()
            record(reply.status)
            return reply
        if fault is not None and action == "hang":
            # Logged on arrival so a test can see the hang while its client is still waiting.
            record(None)
            self._stopping.wait(fault.seconds)
            return None
        reply: Reply | None = None
        if fault is not None and action == "status":
            reply = injected_reply(fault)
        elif fault is None or fault.after_apply:
            reply = answer()
        record(reply.status if reply is not None and action != "drop" else None)
        return None if action == "drop" else reply


class _Server(ThreadingHTTPServer):
    """Threaded server that remembers open connections so `stop` can close kept-alive ones."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, hub: HubEmulator) -> None:
        self.hub = hub
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, handler)

    def track(self, conn: socket.socket, open_: bool) -> None:
        with self._connections_lock:
            if open_:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    def close_connections(self) -> None:
        with self._connections_lock:
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by the peer

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that reset a kept-alive connection is normal here (timeouts, drops): log
        it instead of printing a traceback to stderr; anything else is reported as usual."""
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            logger.debug("client %s reset the connection", client_address)
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 keeps connections alive, as httpx pools them against the real Hub.
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        # Headers and body leave in separate writes; without this, Nagle's algorithm and the
        # client's delayed ACK add ~40 ms to every request.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.track(self.connection, True)

    def finish(self) -> None:
        self.server.track(self.connection, False)
        super().finish()

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def _handle(self) -> None:
        # Read the whole body first: closing a socket with unread input sends a RST, and a
        # dropped connection must reach the client as a clean EOF.
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        reply = self.server.hub.serve(self, body)
        if reply is None:
            self.close_connection = True
            return
        try:
            self.send_response(reply.status)
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(reply.body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up (e.g. its timeout fired)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s - " + format, self.address_string(), *args)
