"""The repository model: model repos with git history (whole file trees per commit), branches,
and the git object ids the Hub reports. Thread-safe: every method takes the model's lock."""

from __future__ import annotations

import hashlib
import itertools
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

# The Hub seeds every new repo with this file in an initial commit; a transport must cope.
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha(data: bytes) -> str:
    """Git's object id for a blob: what the Hub reports as `oid` and serves as `ETag`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubError(Exception):
    """A failure the Hub answers with an HTTP error: status, message, `X-Error-Code`, extra
    headers and extra JSON fields (the HTTP layer turns it into a reply)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})


@dataclass(frozen=True)
class Commit:
    sha: str
    parent: str | None
    summary: str
    files: dict[str, bytes]  # mutable on purpose: `tamper` edits it in place
    created: datetime


@dataclass
class Repo:
    repo_id: str
    private: bool
    created: datetime
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)


def check_path(path: str) -> str:
    """``path`` when it is a valid file path inside a repo, else a 400 HubError."""
    if not path or path.startswith("/") or ".." in path.split("/"):
        raise HubError(400, f"Invalid path in repo: {path!r}")
    return path


class Repos:
    """Every emulated repository. ``lock`` guards them; the HTTP endpoints hold it for a whole
    request, the inspection methods below take it themselves."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._repos: dict[str, Repo] = {}
        self._counter = itertools.count(1)

    # -- inspection and seeding (take the lock) -----------------------------------------

    def add(
        self, repo_id: str, private: bool = False, files: dict[str, bytes] | None = None
    ) -> str:
        """Create a repo (optionally with a second commit of ``files``); its head sha."""
        with self.lock:
            repo = self.new_repo(repo_id, private)
            if files:
                head = repo.commits[repo.branches["main"]]
                self.new_commit(repo, "main", head, {**head.files, **files}, "Seed files")
            return repo.branches["main"]

    def set_visibility(self, repo_id: str, private: bool) -> None:
        with self.lock:
            self._repos[repo_id].private = private

    def head(self, repo_id: str, branch: str = "main") -> str:
        with self.lock:
            return self._repos[repo_id].branches[branch]

    def history(self, repo_id: str, branch: str = "main") -> list[str]:
        with self.lock:
            repo = self._repos[repo_id]
            shas: list[str] = []
            sha: str | None = repo.branches[branch]
            while sha is not None:
                shas.append(sha)
                sha = repo.commits[sha].parent
            return shas[::-1]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        with self.lock:
            return dict(self.commit_at(self._repos[repo_id], revision).files)

    def stored_bytes(self, repo_id: str) -> int:
        """Bytes of the distinct file contents every stored commit holds: what the Hub's
        storage of this repository would be (history included, deduplicated by content)."""
        with self.lock:
            blobs: dict[str, int] = {}
            for commit in self._repos[repo_id].commits.values():
                for data in commit.files.values():
                    blobs.setdefault(hashlib.sha256(data).hexdigest(), len(data))
            return sum(blobs.values())

    def tamper(self, repo_id: str, path: str, data: bytes, revision: str = "main") -> None:
        with self.lock:
            commit = self.commit_at(self._repos[repo_id], revision)
            if path not in commit.files:
                raise KeyError(f"{path!r} not in {repo_id}@{revision}")
            commit.files[path] = data

    # -- the model (caller holds the lock) ----------------------------------------------

    def exists(self, repo_id: str) -> bool:
        return repo_id in self._repos

    def get(self, repo_id: str) -> Repo:
        """The repo, or 404 RepoNotFound."""
        repo = self._repos.get(repo_id)
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def new_repo(self, repo_id: str, private: bool) -> Repo:
        if repo_id in self._repos:
            raise ValueError(f"repo {repo_id} already exists")
        repo = Repo(repo_id, private, datetime.now(timezone.utc))
        self._repos[repo_id] = repo
        self.new_commit(repo, "main", None, {".gitattributes": GITATTRIBUTES}, "initial commit")
        return repo

    def new_commit(
        self,
        repo: Repo,
        branch: str,
        parent: Commit | None,
        files: dict[str, bytes],
        summary: str,
    ) -> str:
        parent_sha = parent.sha if parent is not None else None
        # A counter keeps shas unique even for identical trees committed twice.
        seed = f"{repo.repo_id}\n{parent_sha}\n{next(self._counter)}\n{summary}"
        sha = hashlib.sha1(seed.encode()).hexdigest()
        commit = Commit(sha, parent_sha, summary, files, datetime.now(timezone.utc))
        repo.commits[sha] = commit
        repo.branches[branch] = sha
        return sha

    def squash(self, repo: Repo, branch: str, summary: str) -> str:
        """Replace ``branch``'s history by one commit of its head's files; commits no other
        branch reaches are dropped."""
        head = repo.commits[repo.branches[branch]]
        sha = self.new_commit(repo, branch, None, dict(head.files), summary)
        reachable: set[str] = set()
        for tip in repo.branches.values():
            at: str | None = tip
            while at is not None and at not in reachable:
                reachable.add(at)
                at = repo.commits[at].parent
        for old in [c for c in repo.commits if c not in reachable]:
            del repo.commits[old]
        return sha

    @staticmethod
    def branch(repo: Repo, revision: str) -> str:
        """``revision`` when it names a branch, else 404 RevisionNotFound."""
        if revision not in repo.branches:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return revision

    @staticmethod
    def commit_at(repo: Repo, revision: str) -> Commit:
        """The commit a branch name or commit sha names, else 404 RevisionNotFound."""
        sha = repo.branches.get(revision, revision)
        if sha not in repo.commits:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return repo.commits[sha]
