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

The rooms: `repo` (repositories, commits, branches, git ids), `faults` (what the next requests
of a kind get), `handlers` (routing and the endpoints' replies), `server` (`HubEmulator` and
the threaded HTTP server).

Usage::

    with HubEmulator() as hub:
        api = HfApi(endpoint=hub.endpoint, token="hf_test")
        hub.inject("commit", status=503)
"""

from __future__ import annotations

from hub_emulator.faults import KINDS
from hub_emulator.repo import GITATTRIBUTES, git_blob_sha
from hub_emulator.server import HubEmulator, RequestRecord

__all__ = ["GITATTRIBUTES", "KINDS", "HubEmulator", "RequestRecord", "git_blob_sha"]
