"""The Hub emulator driven by the real `huggingface_hub` client, with no network.

These tests pin down both the emulator and the client behaviour the DiLoCo Hub transport
relies on: which exception each failure surfaces as, and which calls retry by themselves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
from hub_emulator import HubEmulator
from hub_fixtures import HANG_TIMEOUT, client_sleeps_fixture, hub_fixture  # noqa: F401
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    constants,
    hf_hub_download,
)
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import _http as hf_http

TOKEN = "hf_emulator_token"
REPO = "speedtronic/diloco-run"


@pytest.fixture
def api(hub: HubEmulator) -> HfApi:
    return HfApi(endpoint=hub.endpoint, token=TOKEN)


@pytest.fixture
def download(hub: HubEmulator, tmp_path: Path) -> Callable[..., str]:
    """`hf_hub_download` bound to the emulator and a per-test cache (never ~/.cache)."""
    return partial(
        hf_hub_download, endpoint=hub.endpoint, token=TOKEN, cache_dir=tmp_path / "cache"
    )


def _kinds(hub: HubEmulator) -> list[str]:
    return [record.kind for record in hub.requests]


# -- repos and commits -------------------------------------------------------------------


def test_create_repo_private_then_exist_ok(hub: HubEmulator, api: HfApi) -> None:
    url = api.create_repo(REPO, private=True)
    assert url.repo_id == REPO
    assert url == f"{hub.endpoint}/{REPO}"
    assert api.create_repo(REPO, private=True, exist_ok=True) == url  # 409 carries the url

    with pytest.raises(HfHubHTTPError) as conflict:
        api.create_repo(REPO)
    assert conflict.value.response.status_code == 409

    info = api.model_info(REPO)
    assert (info.id, info.private, info.sha) == (REPO, True, hub.head(REPO))
    assert [s.rfilename for s in info.siblings] == [".gitattributes"]
    assert {r.authorization for r in hub.requests} == {f"Bearer {TOKEN}"}

    with pytest.raises(RepositoryNotFoundError):  # private repos hide from anonymous callers
        HfApi(endpoint=hub.endpoint, token=False).model_info(REPO)
    hub.set_visibility(REPO, private=False)
    assert HfApi(endpoint=hub.endpoint, token=False).model_info(REPO).private is False


def test_required_token_is_enforced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with HubEmulator(require_token="hf_right") as hub:
        with pytest.raises(HfHubHTTPError) as denied:
            HfApi(endpoint=hub.endpoint, token="hf_wrong").create_repo(REPO)
        assert denied.value.response.status_code == 401
        HfApi(endpoint=hub.endpoint, token="hf_right").create_repo(REPO)
        assert hub.files(REPO).keys() == {".gitattributes"}
    huggingface_hub.close_session()


def test_commit_with_adds_and_deletes_makes_one_commit(hub: HubEmulator, api: HfApi) -> None:
    seed = hub.add_repo(
        REPO, files={"old.bin": b"old", "shards/0.bin": b"s0", "shards/1.bin": b"s1"}
    )
    operations = [
        CommitOperationAdd("round-1/delta.bin", b"\x00\x01\x02"),
        CommitOperationAdd("round-1/manifest.json", b"{}"),
        CommitOperationDelete("old.bin"),
        CommitOperationDelete("shards/"),
    ]
    info = api.create_commit(REPO, operations, commit_message="round 1", parent_commit=seed)

    assert hub.history(REPO)[-2:] == [seed, info.oid]
    assert info.commit_url == f"{hub.endpoint}/{REPO}/commit/{info.oid}"
    assert hub.files(REPO) == {
        ".gitattributes": hub.files(REPO, seed)[".gitattributes"],
        "round-1/delta.bin": b"\x00\x01\x02",
        "round-1/manifest.json": b"{}",
    }
    assert _kinds(hub) == ["preupload", "commit"]


def test_stale_parent_commit_is_rejected_with_412(hub: HubEmulator, api: HfApi) -> None:
    first = hub.add_repo(REPO)
    api.create_commit(REPO, [CommitOperationAdd("a", b"1")], commit_message="a")
    with pytest.raises(HfHubHTTPError) as stale:
        api.create_commit(
            REPO, [CommitOperationAdd("b", b"2")], commit_message="b", parent_commit=first
        )
    assert stale.value.response.status_code == 412
    assert "b" not in hub.files(REPO)


def test_unchanged_files_are_skipped_by_the_client(hub: HubEmulator, api: HfApi) -> None:
    head = hub.add_repo(REPO, files={"same.bin": b"same"})
    info = api.create_commit(REPO, [CommitOperationAdd("same.bin", b"same")], commit_message="x")
    assert info.oid == head  # preupload reported the same git oid: no commit was sent
    assert "commit" not in _kinds(hub)


def test_list_repo_tree_recursive_and_by_folder(hub: HubEmulator, api: HfApi) -> None:
    hub.add_repo(REPO, files={"top.txt": b"12345", "d/a.bin": b"ab", "d/e/b.bin": b"b"})

    everything = {
        e.path: getattr(e, "size", None) for e in api.list_repo_tree(REPO, recursive=True)
    }
    assert everything == {
        ".gitattributes": len(hub.files(REPO)[".gitattributes"]),
        "top.txt": 5,
        "d": None,
        "d/a.bin": 2,
        "d/e": None,
        "d/e/b.bin": 1,
    }
    assert {e.path for e in api.list_repo_tree(REPO, "d")} == {"d/a.bin", "d/e"}
    with pytest.raises(RemoteEntryNotFoundError):
        list(api.list_repo_tree(REPO, "missing"))


# -- downloads ---------------------------------------------------------------------------


def test_download_latest_and_pinned_revision(
    hub: HubEmulator, api: HfApi, download: Callable[..., str]
) -> None:
    old = hub.add_repo(REPO, files={"w.bin": b"v1"})
    api.create_commit(REPO, [CommitOperationAdd("w.bin", b"v2")], commit_message="v2")

    assert Path(download(REPO, "w.bin")).read_bytes() == b"v2"
    assert Path(download(REPO, "w.bin", revision=old)).read_bytes() == b"v1"
    head = [r for r in hub.requests if r.method == "HEAD"]
    assert [r.path for r in head] == [
        f"/{REPO}/resolve/main/w.bin",
        f"/{REPO}/resolve/{old}/w.bin",
    ]


def test_download_not_found_errors(hub: HubEmulator, download: Callable[..., str]) -> None:
    hub.add_repo(REPO)
    with pytest.raises(RemoteEntryNotFoundError):
        download(REPO, "missing.bin")
    with pytest.raises(RevisionNotFoundError):
        download(REPO, ".gitattributes", revision="no-such-branch")
    with pytest.raises(RepositoryNotFoundError):
        download("speedtronic/absent", "x.bin")


def test_tampered_bytes_are_served_under_the_same_commit(
    hub: HubEmulator, download: Callable[..., str]
) -> None:
    head = hub.add_repo(REPO, files={"w.bin": b"good"})
    hub.tamper(REPO, "w.bin", b"evil")
    assert Path(download(REPO, "w.bin")).read_bytes() == b"evil"
    assert hub.head(REPO) == head


# -- injected failures -------------------------------------------------------------------


@pytest.mark.parametrize("status", [401, 403, 429, 503])
def test_hfapi_call_surfaces_injected_status_without_retry(
    hub: HubEmulator, api: HfApi, status: int
) -> None:
    hub.add_repo(REPO)
    hub.inject("info", status=status, retry_after=7)
    with pytest.raises(HfHubHTTPError) as failure:
        api.model_info(REPO)
    assert failure.value.response.status_code == status
    assert failure.value.response.headers["Retry-After"] == "7"
    assert _kinds(hub) == ["info"]  # model_info never retries


def test_download_401_raises_http_error_403_raises_local_entry_error(
    hub: HubEmulator, download: Callable[..., str]
) -> None:
    hub.add_repo(REPO, files={"w.bin": b"w"})
    hub.inject("resolve", status=401, method="HEAD")
    with pytest.raises(HfHubHTTPError) as unauthorized:
        download(REPO, "w.bin")
    assert unauthorized.value.response.status_code == 401

    hub.inject("resolve", status=403, method="HEAD")
    with pytest.raises(LocalEntryNotFoundError) as forbidden:
        download(REPO, "w.bin")
    assert isinstance(forbidden.value.__cause__, HfHubHTTPError)
    assert forbidden.value.__cause__.response.status_code == 403


def test_retrying_calls_honour_retry_after_and_recover(
    hub: HubEmulator, api: HfApi, download: Callable[..., str], client_sleeps: list[float]
) -> None:
    hub.add_repo(REPO, files={"w.bin": b"w"})

    hub.inject("tree", status=429, retry_after=2)
    assert [e.path for e in api.list_repo_tree(REPO)] == [".gitattributes", "w.bin"]
    assert client_sleeps == [3.0]  # Retry-After + 1 second

    hub.inject("preupload", status=503)
    api.create_commit(REPO, [CommitOperationAdd("x", b"x")], commit_message="x")
    assert client_sleeps == [3.0, 1]

    hub.inject("resolve", status=503, method="HEAD")
    assert Path(download(REPO, "w.bin")).read_bytes() == b"w"  # second HEAD, no sleep
    assert hub.faults_left() == 0


def test_persistent_503_on_download_exhausts_retries(
    hub: HubEmulator, download: Callable[..., str], client_sleeps: list[float]
) -> None:
    hub.add_repo(REPO, files={"w.bin": b"w"})
    hub.inject("resolve", status=503, count=100)
    with pytest.raises(LocalEntryNotFoundError) as unavailable:
        download(REPO, "w.bin")
    assert unavailable.value.__cause__.response.status_code == 503
    assert client_sleeps == [1, 2, 4, 8, 8]
    assert _kinds(hub).count("resolve") == 7  # 1 plain HEAD + 1 + 5 retried HEADs


def test_hang_times_out_with_a_short_client_timeout(hub: HubEmulator, api: HfApi) -> None:
    hub.add_repo(REPO)
    hub.inject_hang("info", seconds=60)
    # A hang that ran out would close the connection (RemoteProtocolError): the client's
    # timeout fired first, whatever the machine's speed.
    with pytest.raises(httpx2.TimeoutException):
        api.model_info(REPO, timeout=0.3)
    assert hub.requests[-1].fault == "hang"


def test_client_factory_hook_bounds_calls_without_a_timeout_argument(
    hub: HubEmulator, api: HfApi
) -> None:
    """create_commit takes no timeout; a request hook on the shared client bounds it."""

    def bound_timeout(request: httpx2.Request) -> None:
        request.extensions["timeout"] = httpx2.Timeout(HANG_TIMEOUT).as_dict()

    def bounded_client() -> httpx2.Client:
        client = hf_http.default_client_factory()
        client.event_hooks["request"].append(bound_timeout)
        return client

    head = hub.add_repo(REPO)
    hub.inject_hang("commit", seconds=30)
    huggingface_hub.set_client_factory(bounded_client)
    try:
        with pytest.raises(httpx2.TimeoutException):
            api.create_commit(REPO, [CommitOperationAdd("x", b"x")], commit_message="x")
    finally:
        huggingface_hub.set_client_factory(hf_http.default_client_factory)
    assert hub.head(REPO) == head  # a hung request never takes effect


def test_dropped_connection_surfaces_as_remote_protocol_error(
    hub: HubEmulator, api: HfApi, download: Callable[..., str]
) -> None:
    hub.add_repo(REPO, files={"w.bin": b"w"})
    hub.inject_drop("info")
    with pytest.raises(httpx2.RemoteProtocolError):
        api.model_info(REPO)

    hub.inject_drop("resolve", method="HEAD")
    with pytest.raises(httpx2.RemoteProtocolError):  # not wrapped, not retried
        download(REPO, "w.bin")
    assert [r.fault for r in hub.requests] == ["drop", "drop"]


def test_lost_commit_response_still_lands(hub: HubEmulator, api: HfApi) -> None:
    parent = hub.add_repo(REPO)
    hub.inject_drop("commit", after_apply=True)
    with pytest.raises(httpx2.RemoteProtocolError):
        api.create_commit(
            REPO, [CommitOperationAdd("x", b"x")], commit_message="x", parent_commit=parent
        )
    assert hub.files(REPO)["x"] == b"x"
    with pytest.raises(HfHubHTTPError) as stale:  # a blind retry now conflicts
        api.create_commit(
            REPO, [CommitOperationAdd("x", b"y")], commit_message="x", parent_commit=parent
        )
    assert stale.value.response.status_code == 412


def test_unknown_fault_kind_is_refused(hub: HubEmulator) -> None:
    with pytest.raises(ValueError, match="unknown request kind"):
        hub.inject("upload")


def test_download_recovers_from_one_hung_head(
    hub: HubEmulator, download: Callable[..., str]
) -> None:
    """After a failed HEAD the client retries it once more with a fixed 60 s timeout."""
    hub.add_repo(REPO, files={"w.bin": b"w"})
    hub.inject_hang("resolve", seconds=30, method="HEAD")
    assert Path(download(REPO, "w.bin", etag_timeout=0.3)).read_bytes() == b"w"
    assert [(r.method, r.fault) for r in hub.requests] == [
        ("HEAD", "hang"),
        ("HEAD", None),
        ("GET", None),
    ]


def test_download_resumes_after_a_dropped_get(
    hub: HubEmulator, download: Callable[..., str], client_sleeps: list[float]
) -> None:
    hub.add_repo(REPO, files={"w.bin": b"w"})
    hub.inject_drop("resolve", method="GET")
    assert Path(download(REPO, "w.bin")).read_bytes() == b"w"
    assert client_sleeps == [1]


def test_inject_call_runs_before_the_request_is_served(hub: HubEmulator, api: HfApi) -> None:
    """Interleaving two clients: another commit lands between a read and a commit."""
    head = hub.add_repo(REPO)
    hub.inject_call(
        "commit",
        lambda: api.create_commit(
            REPO, [CommitOperationAdd("other", b"o")], commit_message="other"
        ),
    )
    with pytest.raises(HfHubHTTPError) as stale:
        api.create_commit(
            REPO, [CommitOperationAdd("mine", b"m")], commit_message="mine", parent_commit=head
        )
    assert stale.value.response.status_code == 412
    assert "other" in hub.files(REPO) and "mine" not in hub.files(REPO)
    assert [(r.kind, r.fault) for r in hub.requests if r.kind == "commit"] == [
        ("commit", None),
        ("commit", "call"),
    ]


def test_lfs_listing_and_stripped_commit_header(hub: HubEmulator, api: HfApi) -> None:
    hub.add_repo(REPO, files={"w.safetensors": b"weights", "notes.txt": b"n"})
    hub.lfs_suffixes = (".safetensors",)
    entries = {e.path: e for e in api.list_repo_tree(REPO)}
    assert entries["w.safetensors"].lfs.sha256 == hashlib.sha256(b"weights").hexdigest()
    assert entries["notes.txt"].lfs is None
    hub.send_repo_commit = False
    response = huggingface_hub.get_session().get(f"{hub.endpoint}/{REPO}/resolve/main/notes.txt")
    assert response.content == b"n" and "X-Repo-Commit" not in response.headers
