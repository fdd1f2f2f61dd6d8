"""The emulated HTTP endpoints: routing a request to its kind, and the replies of the calls
``HfApi.create_repo``, ``repo_info``/``model_info``, ``list_repo_tree``, ``create_commit``
(additions and deletions, ``parent_commit`` fencing), ``super_squash_history`` and
``hf_hub_download`` make, shaped like the Hub's (JSON bodies, ``X-Error-Code``,
``X-Repo-Commit``, ``ETag``)."""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol
from urllib.parse import unquote

from hub_emulator.faults import Fault
from hub_emulator.repo import HubError, Repo, Repos, check_path, git_blob_sha


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Route:
    kind: str
    repo_id: str | None = None
    revision: str | None = None
    path: str = ""


class Settings(Protocol):
    """What the endpoints read from the emulator at each request (tests change some live)."""

    require_token: str | None
    user: str
    lfs_suffixes: tuple[str, ...]
    send_repo_commit: bool

    @property
    def endpoint(self) -> str: ...


def json_reply(status: int, payload: Any) -> Reply:
    body = json.dumps(payload).encode()
    return Reply(status, body, {"Content-Type": "application/json; charset=utf-8"})


def error_reply(error: HubError) -> Reply:
    """An error reply shaped like the Hub's: JSON `error`, plus `X-Error-Code` when known."""
    reply = json_reply(error.status, {"error": error.message, **error.extra})
    reply.headers["X-Error-Message"] = error.message
    if error.code is not None:
        reply.headers["X-Error-Code"] = error.code
    reply.headers.update(error.headers)
    return reply


def injected_reply(fault: Fault) -> Reply:
    """The reply of an injected HTTP status."""
    message = f"Injected HTTP {fault.status} by the hub emulator"
    if fault.message is not None:
        message = fault.message
    elif fault.status == 401:
        # The exact text the client uses to tell a bad token from a hidden repo.
        message = "Invalid credentials in Authorization header"
    reply = error_reply(HubError(fault.status, message))
    if fault.retry_after is not None:
        reply.headers["Retry-After"] = str(fault.retry_after)
    return reply


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def parse_route(method: str, raw_path: str) -> Route:
    """Map a request to its kind; segments are unquoted one by one because the client
    quotes revisions and tree paths with `safe=""` (so `/` arrives as `%2F`)."""
    segs = raw_path.strip("/").split("/")
    if method == "POST" and segs == ["api", "repos", "create"]:
        return Route("create")
    if segs[:2] == ["api", "models"] and len(segs) >= 4:
        repo_id = f"{unquote(segs[2])}/{unquote(segs[3])}"
        rest = segs[4:]
        if method == "GET" and (not rest or (rest[0] == "revision" and len(rest) == 2)):
            return Route("info", repo_id, unquote(rest[1]) if rest else "main")
        if method == "POST" and len(rest) == 2 and rest[0] in ("preupload", "commit"):
            return Route(rest[0], repo_id, unquote(rest[1]))
        if method == "POST" and len(rest) == 2 and rest[0] == "super-squash":
            return Route("squash", repo_id, unquote(rest[1]))
        if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
            return Route("tree", repo_id, unquote(rest[1]), unquote("/".join(rest[2:])))
    if method in ("GET", "HEAD") and len(segs) >= 5 and segs[2] == "resolve":
        repo_id = f"{unquote(segs[0])}/{unquote(segs[1])}"
        return Route("resolve", repo_id, unquote(segs[3]), unquote("/".join(segs[4:])))
    return Route("other")


class HubApi:
    """The endpoints over ``repos``; ``settings`` is the emulator."""

    def __init__(self, repos: Repos, settings: Settings) -> None:
        self.repos = repos
        self.settings = settings

    def handle(
        self, route: Route, method: str, query: dict[str, list[str]], auth: str | None, body: bytes
    ) -> Reply:
        """The reply to one request (errors included)."""
        try:
            required = self.settings.require_token
            if required is not None and auth != f"Bearer {required}":
                raise HubError(401, "Invalid credentials in Authorization header")
            with self.repos.lock:
                return self._dispatch(route, method, query, auth, body)
        except HubError as error:
            return error_reply(error)
        except (ValueError, KeyError, TypeError) as error:  # malformed body
            return error_reply(HubError(400, f"Bad request: {error!r}"))

    def _dispatch(
        self, route: Route, method: str, query: dict[str, list[str]], auth: str | None, body: bytes
    ) -> Reply:
        if route.kind == "create":
            return self._create(auth, body)
        if route.kind == "other":
            raise HubError(404, f"Not emulated: {method} {route}")
        repo = self._readable_repo(route.repo_id or "", auth)
        revision = route.revision or "main"
        if route.kind == "info":
            return self._info(repo, revision, "blobs" in query)
        if route.kind == "tree":
            recursive = query.get("recursive", ["false"])[0] == "true"
            return self._tree(repo, revision, route.path, recursive)
        if route.kind == "resolve":
            return self._resolve(repo, revision, route.path)
        _require_writer(auth)
        if route.kind == "preupload":
            return self._preupload(repo, revision, body)
        if route.kind == "squash":
            return self._squash(repo, revision, body)
        if "create_pr" in query:
            raise HubError(400, "Pull requests are not emulated")
        return self._commit(repo, revision, body)

    # -- endpoint implementations (the repos' lock is held) ------------------------------

    def _create(self, auth: str | None, body: bytes) -> Reply:
        _require_writer(auth)
        payload = json.loads(body or b"{}")
        if payload.get("type", "model") != "model":
            raise HubError(400, "Only model repos are emulated")
        repo_id = f"{payload.get('organization') or self.settings.user}/{payload['name']}"
        url = f"{self.settings.endpoint}/{repo_id}"
        if self.repos.exists(repo_id):
            raise HubError(409, "You already created this model repo", extra={"url": url})
        self.repos.new_repo(repo_id, payload.get("visibility") == "private")
        return json_reply(200, {"url": url, "name": repo_id, "id": repo_id})

    def _info(self, repo: Repo, revision: str, blobs: bool) -> Reply:
        commit = self.repos.commit_at(repo, revision)
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
        return json_reply(200, info)

    def _tree(self, repo: Repo, revision: str, prefix: str, recursive: bool) -> Reply:
        files = self.repos.commit_at(repo, revision).files
        prefix = prefix.strip("/")
        dirs: dict[str, list[str]] = {}
        for path in files:
            parts = path.split("/")
            for depth in range(1, len(parts)):
                dirs.setdefault("/".join(parts[:depth]), []).append(path)
        if prefix and prefix not in dirs:
            raise HubError(404, f"Entry not found: {prefix}", "EntryNotFound")
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
        return json_reply(200, entries)

    def _file_entry(self, path: str, data: bytes) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "type": "file",
            "oid": git_blob_sha(data),
            "size": len(data),
            "path": path,
        }
        suffixes = self.settings.lfs_suffixes
        if suffixes and path.endswith(suffixes):
            sha256 = hashlib.sha256(data).hexdigest()
            pointer = (
                f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n"
                f"size {len(data)}\n"
            ).encode()
            entry["oid"] = git_blob_sha(pointer)
            entry["lfs"] = {"oid": sha256, "size": len(data), "pointerSize": len(pointer)}
        return entry

    def _resolve(self, repo: Repo, revision: str, path: str) -> Reply:
        commit = self.repos.commit_at(repo, revision)
        sha_header = {"X-Repo-Commit": commit.sha} if self.settings.send_repo_commit else {}
        if path not in commit.files:
            raise HubError(404, "Entry not found", "EntryNotFound", headers=sha_header)
        data = commit.files[path]
        headers = {
            **sha_header,
            "ETag": f'"{git_blob_sha(data)}"',
            "Content-Type": "application/octet-stream",
        }
        return Reply(200, data, headers)

    def _preupload(self, repo: Repo, revision: str, body: bytes) -> Reply:
        commit = self.repos.commit_at(repo, self.repos.branch(repo, revision))
        answers = []
        for entry in json.loads(body)["files"]:
            path = check_path(entry["path"])
            answer = {"path": path, "uploadMode": "regular", "shouldIgnore": False}
            if path in commit.files:
                # The client skips files whose git oid is unchanged, as against the real Hub.
                answer["oid"] = git_blob_sha(commit.files[path])
            answers.append(answer)
        return json_reply(200, {"files": answers, "commitOid": commit.sha})

    def _commit(self, repo: Repo, revision: str, body: bytes) -> Reply:
        branch = self.repos.branch(repo, revision)
        head = repo.commits[repo.branches[branch]]
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The first line of a commit must be its header")
        header = lines[0]["value"]
        parent = header.get("parentCommit")
        if parent is not None and parent != head.sha:
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(head.files)
        for line in lines[1:]:
            _apply(files, line.get("key"), line.get("value", {}))
        sha = self.repos.new_commit(repo, branch, head, files, str(header.get("summary", "")))
        payload = {
            "success": True,
            "commitOid": sha,
            "commitUrl": f"{self.settings.endpoint}/{repo.repo_id}/commit/{sha}",
            "hookOutput": "",
        }
        return json_reply(200, payload)

    def _squash(self, repo: Repo, revision: str, body: bytes) -> Reply:
        """``super_squash_history``: the branch becomes one commit with the head's files; the
        commits only that branch reached are gone (their shas no longer resolve)."""
        branch = self.repos.branch(repo, revision)
        message = str(json.loads(body or b"{}").get("message") or "Super-squash")
        sha = self.repos.squash(repo, branch, message)
        return json_reply(200, {"commitOid": sha})

    def _readable_repo(self, repo_id: str, auth: str | None) -> Repo:
        repo = self.repos.get(repo_id)
        if repo.private and auth is None:
            # The Hub hides private repos from anonymous callers behind a 401 "not found".
            raise HubError(401, "Repository not found", "RepoNotFound")
        return repo


def _apply(files: dict[str, bytes], key: Any, value: dict[str, Any]) -> None:
    """One operation line of a commit, applied to the new tree ``files``."""
    path = check_path(str(value.get("path", "")).rstrip("/"))
    if key == "file":
        if value.get("encoding") != "base64":
            raise HubError(400, "Only base64 file content is emulated")
        files[path] = base64.b64decode(value["content"])
    elif key == "deletedFile":
        if files.pop(path, None) is None:
            raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
    elif key == "deletedFolder":
        doomed = [p for p in files if p.startswith(f"{path}/")]
        if not doomed:
            raise HubError(404, "A folder with this name doesn't exist", "EntryNotFound")
        for doomed_path in doomed:
            del files[doomed_path]
    else:
        raise HubError(400, f"Commit operation {key!r} is not emulated (no LFS/Xet)")


def _require_writer(auth: str | None) -> None:
    if auth is None:
        raise HubError(401, "You must be authenticated to write to the Hub")
