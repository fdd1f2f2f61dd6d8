"""A local stand-in for the Hugging Face Hub HTTP API, for tests that run the real client.

The emulator serves exactly the endpoints that `HfApi.create_repo`, `repo_info`/`model_info`,
`list_repo_tree`, `create_commit` and `hf_hub_download` call, for model repos, with git
history so that pinned revisions resolve. Files are always committed inline (preupload
answers `uploadMode: "regular"`), so no LFS or Xet traffic is ever needed.

Faults are injected per request kind (`KINDS`): an HTTP status, a hang (the connection is
then closed without a reply) or a dropped connection, optionally after the request took
effect, which is how a lost commit response looks to a client. `inject_call` runs a function
when a request arrives and then serves it normally, to interleave two clients exactly (for
example another commit landing between a client's read and its own commit).

Usage::

    with HubEmulator() as hub:
        api = HfApi(endpoint=hub.endpoint, token="hf_test")
        hub.inject("commit", status=503)
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

logger = logging.getLogger("speedtronic.tests.hub_emulator")

KINDS = ("create", "preupload", "commit", "info", "tree", "resolve", "other")
"""Request kinds that faults can target; "*" in `inject*` matches every kind."""

# The Hub seeds every new repo with this file in an initial commit; a transport must cope.
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


@dataclass(frozen=True)
class RequestRecord:
    """One request as the emulator saw it, for assertions."""

    method: str
    path: str
    kind: str
    status: int | None  # None when no reply was sent (hang or drop)
    authorization: str | None
    fault: str | None  # "status", "hang", "drop" or "call" when an injected fault fired


@dataclass
class _Fault:
    kind: str
    method: str | None
    remaining: int
    action: str  # "status" | "hang" | "drop" | "call"
    status: int = 503
    retry_after: int | None = None
    seconds: float = 0.0
    after_apply: bool = False
    callback: Callable[[], object] | None = None
    message: str | None = None


@dataclass(frozen=True)
class _Commit:
    sha: str
    parent: str | None
    summary: str
    files: dict[str, bytes]  # mutable on purpose: `tamper` edits it in place
    created: datetime


@dataclass
class _Repo:
    repo_id: str
    private: bool
    created: datetime
    commits: dict[str, _Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)


@dataclass
class _Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Route:
    kind: str
    repo_id: str | None = None
    revision: str | None = None
    path: str = ""


class _HubError(Exception):
    """An error reply shaped like the Hub's: JSON `error`, plus `X-Error-Code` when known."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.reply = _json_reply(status, {"error": message, **(extra or {})})
        self.reply.headers["X-Error-Message"] = message
        if code is not None:
            self.reply.headers["X-Error-Code"] = code
        self.reply.headers.update(headers or {})


def git_blob_sha(data: bytes) -> str:
    """Git's object id for a blob: what the Hub reports as `oid` and serves as `ETag`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _json_reply(status: int, payload: Any) -> _Reply:
    body = json.dumps(payload).encode()
    return _Reply(status, body, {"Content-Type": "application/json; charset=utf-8"})


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _parse_route(method: str, raw_path: str) -> _Route:
    """Map a request to its kind; segments are unquoted one by one because the client
    quotes revisions and tree paths with `safe=""` (so `/` arrives as `%2F`)."""
    segs = raw_path.strip("/").split("/")
    if method == "POST" and segs == ["api", "repos", "create"]:
        return _Route("create")
    if segs[:2] == ["api", "models"] and len(segs) >= 4:
        repo_id = f"{unquote(segs[2])}/{unquote(segs[3])}"
        rest = segs[4:]
        if method == "GET" and (not rest or (rest[0] == "revision" and len(rest) == 2)):
            return _Route("info", repo_id, unquote(rest[1]) if rest else "main")
        if method == "POST" and len(rest) == 2 and rest[0] in ("preupload", "commit"):
            return _Route(rest[0], repo_id, unquote(rest[1]))
        if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
            return _Route("tree", repo_id, unquote(rest[1]), unquote("/".join(rest[2:])))
    if method in ("GET", "HEAD") and len(segs) >= 5 and segs[2] == "resolve":
        repo_id = f"{unquote(segs[0])}/{unquote(segs[1])}"
        return _Route("resolve", repo_id, unquote(segs[3]), unquote("/".join(segs[4:])))
    return _Route("other")


def _check_path(path: str) -> str:
    if not path or path.startswith("/") or ".." in path.split("/"):
        raise _HubError(400, f"Invalid path in repo: {path!r}")
    return path


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
        self._lock = threading.Lock()
        self._repos: dict[str, _Repo] = {}
        self._faults: list[_Fault] = []
        self._log: list[RequestRecord] = []
        self._counter = itertools.count(1)
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
        self._add_fault(_Fault(kind, method, count, "status", status, retry_after, message=message))

    def inject_hang(
        self, kind: str, seconds: float, count: int = 1, method: str | None = None
    ) -> None:
        """Hold the next `count` requests of `kind` for `seconds` (or until `stop`), then
        close the connection without replying and without applying the request."""
        self._add_fault(_Fault(kind, method, count, "hang", seconds=seconds))

    def inject_drop(
        self, kind: str, count: int = 1, after_apply: bool = False, method: str | None = None
    ) -> None:
        """Close the connection of the next `count` requests of `kind` without a reply.

        With `after_apply`, the request takes effect first (e.g. the commit lands) and only
        the response is lost.
        """
        self._add_fault(_Fault(kind, method, count, "drop", after_apply=after_apply))

    def inject_call(
        self, kind: str, callback: Callable[[], object], count: int = 1, method: str | None = None
    ) -> None:
        """Run `callback()` when the next `count` requests of `kind` arrive, then serve them
        normally. The callback runs in the server thread without the emulator's lock, so it
        may itself make requests (another client committing first, say); its exceptions
        are logged and the request is served anyway."""
        self._add_fault(_Fault(kind, method, count, "call", callback=callback))

    def clear_faults(self) -> None:
        """Forget every pending fault."""
        with self._lock:
            self._faults.clear()

    def faults_left(self) -> int:
        """How many injected failures have not fired yet."""
        with self._lock:
            return sum(f.remaining for f in self._faults)

    def _add_fault(self, fault: _Fault) -> None:
        if fault.kind != "*" and fault.kind not in KINDS:
            raise ValueError(f"unknown request kind {fault.kind!r}; expected one of {KINDS}")
        if fault.remaining < 1:
            raise ValueError("count must be >= 1")
        with self._lock:
            self._faults.append(fault)

    def _take_fault(self, kind: str, method: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.kind in ("*", kind) and fault.method in (None, method):
                    fault.remaining -= 1
                    if fault.remaining == 0:
                        self._faults.remove(fault)
                    return fault
        return None

    # -- state inspection and seeding --------------------------------------------------

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request served so far, oldest first."""
        with self._lock:
            return list(self._log)

    def add_repo(
        self, repo_id: str, private: bool = False, files: dict[str, bytes] | None = None
    ) -> str:
        """Create a repo server-side (bypassing HTTP); returns the head commit sha."""
        with self._lock:
            repo = self._new_repo(repo_id, private)
            if files:
                head = repo.commits[repo.branches["main"]]
                self._new_commit(repo, "main", head, {**head.files, **files}, "Seed files")
            return repo.branches["main"]

    def set_visibility(self, repo_id: str, private: bool) -> None:
        """Make a repo private or public."""
        with self._lock:
            self._repos[repo_id].private = private

    def head(self, repo_id: str, branch: str = "main") -> str:
        """Commit sha a branch points to."""
        with self._lock:
            return self._repos[repo_id].branches[branch]

    def history(self, repo_id: str, branch: str = "main") -> list[str]:
        """Commit shas of a branch, oldest first."""
        with self._lock:
            repo = self._repos[repo_id]
            shas: list[str] = []
            sha: str | None = repo.branches[branch]
            while sha is not None:
                shas.append(sha)
                sha = repo.commits[sha].parent
            return shas[::-1]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Copy of the file contents at a branch or commit sha."""
        with self._lock:
            return dict(self._commit_at(self._repos[repo_id], revision).files)

    def tamper(self, repo_id: str, path: str, data: bytes, revision: str = "main") -> None:
        """Replace a file's bytes inside an existing commit, keeping its sha.

        Models corruption a checksum recorded elsewhere must catch. A client cache that
        already holds this commit's file keeps serving the old bytes.
        """
        with self._lock:
            commit = self._commit_at(self._repos[repo_id], revision)
            if path not in commit.files:
                raise KeyError(f"{path!r} not in {repo_id}@{revision}")
            commit.files[path] = data

    # -- request handling (called from server threads) ---------------------------------

    def _serve(self, handler: _Handler, body: bytes) -> _Reply | None:
        """Apply faults and route one request; None means: close without replying."""
        method = handler.command
        url = urlsplit(handler.path)
        route = _parse_route(method, url.path)
        auth = handler.headers.get("Authorization")
        fault = self._take_fault(route.kind, method)

        action = fault.action if fault is not None else None
        if fault is not None and fault.callback is not None:
            try:
                fault.callback()
            except Exception:
                logger.exception("inject_call callback failed")
            # Served normally from here on; the record still says a callback ran first.
            reply = self._route(route, method, parse_qs(url.query), auth, body)
            self._record(RequestRecord(method, url.path, route.kind, reply.status, auth, action))
            return reply
        if fault is not None and action == "hang":
            # Logged on arrival so a test can see the hang while its client is still waiting.
            self._record(RequestRecord(method, url.path, route.kind, None, auth, action))
            self._stopping.wait(fault.seconds)
            return None
        reply: _Reply | None = None
        if fault is not None and action == "status":
            reply = self._injected_reply(fault)
        elif fault is None or fault.after_apply:
            reply = self._route(route, method, parse_qs(url.query), auth, body)
        status = reply.status if reply is not None and action != "drop" else None
        self._record(RequestRecord(method, url.path, route.kind, status, auth, action))
        return None if action == "drop" else reply

    def _record(self, record: RequestRecord) -> None:
        with self._lock:
            self._log.append(record)

    @staticmethod
    def _injected_reply(fault: _Fault) -> _Reply:
        message = f"Injected HTTP {fault.status} by the hub emulator"
        if fault.message is not None:
            message = fault.message
        elif fault.status == 401:
            # The exact text the client uses to tell a bad token from a hidden repo.
            message = "Invalid credentials in Authorization header"
        reply = _HubError(fault.status, message).reply
        if fault.retry_after is not None:
            reply.headers["Retry-After"] = str(fault.retry_after)
        return reply

    def _route(
        self, route: _Route, method: str, query: dict[str, list[str]], auth: str | None, body: bytes
    ) -> _Reply:
        try:
            if self.require_token is not None and auth != f"Bearer {self.require_token}":
                raise _HubError(401, "Invalid credentials in Authorization header")
            with self._lock:
                if route.kind == "create":
                    return self._create(auth, body)
                if route.kind == "other":
                    raise _HubError(404, f"Not emulated: {method} {route}")
                repo = self._readable_repo(route.repo_id or "", auth)
                if route.kind == "info":
                    return self._info(repo, route.revision or "main", "blobs" in query)
                if route.kind == "tree":
                    recursive = query.get("recursive", ["false"])[0] == "true"
                    return self._tree(repo, route.revision or "main", route.path, recursive)
                if route.kind == "resolve":
                    return self._resolve(repo, route.revision or "main", route.path)
                self._require_writer(auth)
                if route.kind == "preupload":
                    return self._preupload(repo, route.revision or "main", body)
                if "create_pr" in query:
                    raise _HubError(400, "Pull requests are not emulated")
                return self._commit(repo, route.revision or "main", body)
        except _HubError as error:
            return error.reply
        except (ValueError, KeyError, TypeError) as error:  # malformed body
            return _HubError(400, f"Bad request: {error!r}").reply

    # -- endpoint implementations (called with the lock held) --------------------------

    def _create(self, auth: str | None, body: bytes) -> _Reply:
        self._require_writer(auth)
        payload = json.loads(body or b"{}")
        if payload.get("type", "model") != "model":
            raise _HubError(400, "Only model repos are emulated")
        repo_id = f"{payload.get('organization') or self.user}/{payload['name']}"
        url = f"{self.endpoint}/{repo_id}"
        if repo_id in self._repos:
            raise _HubError(409, "You already created this model repo", extra={"url": url})
        self._new_repo(repo_id, payload.get("visibility") == "private")
        return _json_reply(200, {"url": url, "name": repo_id, "id": repo_id})

    def _info(self, repo: _Repo, revision: str, blobs: bool) -> _Reply:
        commit = self._commit_at(repo, revision)
        siblings = []
        for path, data in sorted(commit.files.items()):
            sibling: dict[str, Any] = {"rfilename": path}
            if blobs:
                sibling.update(size=len(data), blobId=git_blob_sha(data))
            siblings.append(sibling)
        author = repo.repo_id.split("/")[0]
        info = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": author,
            "sha": commit.sha,
            "lastModified": _iso(commit.created),
            "createdAt": _iso(repo.created),
            "private": repo.private,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        return _json_reply(200, info)

    def _tree(self, repo: _Repo, revision: str, prefix: str, recursive: bool) -> _Reply:
        files = self._commit_at(repo, revision).files
        prefix = prefix.strip("/")
        dirs: dict[str, list[str]] = {}
        for path in files:
            parts = path.split("/")
            for depth in range(1, len(parts)):
                dirs.setdefault("/".join(parts[:depth]), []).append(path)
        if prefix and prefix not in dirs:
            raise _HubError(404, f"Entry not found: {prefix}", "EntryNotFound")
        base = f"{prefix}/" if prefix else ""

        def wanted(path: str) -> bool:
            return path.startswith(base) and (recursive or "/" not in path[len(base) :])

        entries: list[dict[str, Any]] = []
        for path, members in dirs.items():
            if wanted(path):
                listing = "".join(f"{m}:{git_blob_sha(files[m])}\n" for m in sorted(members))
                oid = hashlib.sha1(listing.encode()).hexdigest()
                entries.append({"type": "directory", "oid": oid, "size": 0, "path": path})
        for path, data in files.items():
            if wanted(path):
                entries.append(self._file_entry(path, data))
        entries.sort(key=lambda entry: entry["path"])
        return _json_reply(200, entries)

    def _file_entry(self, path: str, data: bytes) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "type": "file",
            "oid": git_blob_sha(data),
            "size": len(data),
            "path": path,
        }
        if path.endswith(self.lfs_suffixes) and self.lfs_suffixes:
            sha256 = hashlib.sha256(data).hexdigest()
            pointer = (
                f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
                f"size {len(data)}\n"
            ).encode()
            entry["oid"] = git_blob_sha(pointer)
            entry["lfs"] = {"oid": sha256, "size": len(data), "pointerSize": len(pointer)}
        return entry

    def _resolve(self, repo: _Repo, revision: str, path: str) -> _Reply:
        commit = self._commit_at(repo, revision)
        sha_header = {"X-Repo-Commit": commit.sha} if self.send_repo_commit else {}
        if path not in commit.files:
            raise _HubError(404, "Entry not found", "EntryNotFound", headers=sha_header)
        data = commit.files[path]
        headers = {
            **sha_header,
            "ETag": f'"{git_blob_sha(data)}"',
            "Content-Type": "application/octet-stream",
        }
        return _Reply(200, data, headers)

    def _preupload(self, repo: _Repo, revision: str, body: bytes) -> _Reply:
        commit = self._commit_at(repo, self._branch(repo, revision))
        answers = []
        for entry in json.loads(body)["files"]:
            path = _check_path(entry["path"])
            answer = {"path": path, "uploadMode": "regular", "shouldIgnore": False}
            if path in commit.files:
                # The client skips files whose git oid is unchanged, as against the real Hub.
                answer["oid"] = git_blob_sha(commit.files[path])
            answers.append(answer)
        return _json_reply(200, {"files": answers, "commitOid": commit.sha})

    def _commit(self, repo: _Repo, revision: str, body: bytes) -> _Reply:
        branch = self._branch(repo, revision)
        head = repo.commits[repo.branches[branch]]
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise _HubError(400, "The first line of a commit must be its header")
        header = lines[0]["value"]
        parent = header.get("parentCommit")
        if parent is not None and parent != head.sha:
            raise _HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(head.files)
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            path = _check_path(str(value.get("path", "")).rstrip("/"))
            if key == "file":
                if value.get("encoding") != "base64":
                    raise _HubError(400, "Only base64 file content is emulated")
                files[path] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if files.pop(path, None) is None:
                    raise _HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            elif key == "deletedFolder":
                doomed = [p for p in files if p.startswith(f"{path}/")]
                if not doomed:
                    raise _HubError(404, "A folder with this name doesn't exist", "EntryNotFound")
                for doomed_path in doomed:
                    del files[doomed_path]
            else:
                raise _HubError(400, f"Commit operation {key!r} is not emulated (no LFS/Xet)")
        sha = self._new_commit(repo, branch, head, files, str(header.get("summary", "")))
        payload = {
            "success": True,
            "commitOid": sha,
            "commitUrl": f"{self.endpoint}/{repo.repo_id}/commit/{sha}",
            "hookOutput": "",
        }
        return _json_reply(200, payload)

    # -- repository helpers (lock held) ------------------------------------------------

    def _new_repo(self, repo_id: str, private: bool) -> _Repo:
        if repo_id in self._repos:
            raise ValueError(f"repo {repo_id} already exists")
        repo = _Repo(repo_id, private, datetime.now(timezone.utc))
        self._repos[repo_id] = repo
        self._new_commit(repo, "main", None, {".gitattributes": GITATTRIBUTES}, "initial commit")
        return repo

    def _new_commit(
        self,
        repo: _Repo,
        branch: str,
        parent: _Commit | None,
        files: dict[str, bytes],
        summary: str,
    ) -> str:
        parent_sha = parent.sha if parent is not None else None
        # A counter keeps shas unique even for identical trees committed twice.
        seed = f"{repo.repo_id}\n{parent_sha}\n{next(self._counter)}\n{summary}"
        sha = hashlib.sha1(seed.encode()).hexdigest()
        commit = _Commit(sha, parent_sha, summary, files, datetime.now(timezone.utc))
        repo.commits[sha] = commit
        repo.branches[branch] = sha
        return sha

    def _readable_repo(self, repo_id: str, auth: str | None) -> _Repo:
        repo = self._repos.get(repo_id)
        if repo is None:
            raise _HubError(404, "Repository not found", "RepoNotFound")
        if repo.private and auth is None:
            # The Hub hides private repos from anonymous callers behind a 401 "not found".
            raise _HubError(401, "Repository not found", "RepoNotFound")
        return repo

    @staticmethod
    def _require_writer(auth: str | None) -> None:
        if auth is None:
            raise _HubError(401, "You must be authenticated to write to the Hub")

    @staticmethod
    def _branch(repo: _Repo, revision: str) -> str:
        if revision not in repo.branches:
            raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return revision

    @staticmethod
    def _commit_at(repo: _Repo, revision: str) -> _Commit:
        sha = repo.branches.get(revision, revision)
        if sha not in repo.commits:
            raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return repo.commits[sha]


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
        reply = self.server.hub._serve(self, body)
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
