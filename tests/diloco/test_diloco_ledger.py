"""The processed-delta ledger (speedtronic_diloco.ledger): identity by content, bounded size,
the published form a fresh master continues from, and what the store may delete."""

from __future__ import annotations

import json

import pytest

from speedtronic_diloco.ledger import (
    LOCAL_WINDOW,
    PUBLISHED_WINDOW,
    DeltaLedger,
    Verdict,
    delta_norm,
)
from speedtronic_diloco.transports import DeltaInfo, GlobalMetadata


def info(node: str, step: int, etag: str = "e") -> DeltaInfo:
    return DeltaInfo(node, step, f"nodes/{node}/delta_{step}.safetensors", 10, etag)


def recorded(ledger: DeltaLedger, node: str, step: int, content: str, outer: int = 1) -> None:
    ledger.record(info(node, step, f"etag-{content}"), content, outer_step=outer, accepted=True)


def test_verdicts_identify_a_delta_by_its_content_not_its_listing() -> None:
    ledger = DeltaLedger()
    assert ledger.verdict(info("a", 5)) is Verdict.NEW
    recorded(ledger, "a", 5, "c1")
    assert ledger.verdict(info("a", 5, "etag-c1")) is Verdict.KNOWN
    touched = info("a", 5, "etag-after-touch")
    assert ledger.verdict(touched) is Verdict.CHECK  # looked at again ...
    assert ledger.same_content(touched, "c1")  # ... and recognised by its content
    assert ledger.verdict(touched) is Verdict.KNOWN
    reused = info("a", 5, "etag-new-bytes")  # a restarted worker re-used the step number
    assert ledger.verdict(reused) is Verdict.CHECK
    assert not ledger.same_content(reused, "c2")
    assert ledger.verdict(info("a", 6)) is Verdict.NEW


def test_the_ledger_stays_bounded_and_still_knows_every_old_delta() -> None:
    ledger = DeltaLedger()
    for step in range(1, 5001):
        recorded(ledger, "a", step, f"c{step}", outer=step)
    assert len(ledger) == LOCAL_WINDOW
    assert ledger.verdict(info("a", 1, "anything")) is Verdict.OLD  # long gone from the window
    assert ledger.verdict(info("a", 5000, "etag-c5000")) is Verdict.KNOWN
    assert ledger.verdict(info("a", 5001)) is Verdict.NEW
    assert ledger.candidates([info("a", s, "x") for s in range(1, 4900)]) == []


def test_the_published_form_has_a_constant_size_per_node() -> None:
    sizes = []
    ledger = DeltaLedger()
    for rounds in (10, 100, 1000):
        while ledger.nodes.get("a") is None or ledger.nodes["a"].high < rounds:
            step = (ledger.nodes["a"].high + 1) if "a" in ledger.nodes else 1
            for node in ("a", "b", "c"):
                recorded(ledger, node, step, f"{node}{step:064d}"[-64:], outer=step)
        processed, nodes = ledger.published()
        meta = GlobalMetadata(rounds, "0" * 64, 1, processed=processed, nodes=nodes)
        sizes.append(len(meta.dumps()))
        assert len(processed) == 3 * PUBLISHED_WINDOW
    # Step numbers get a digit longer (about 1 %); nothing grows with the number of rounds.
    assert max(sizes) / min(sizes) < 1.05, sizes


def test_a_fresh_master_from_the_published_ledger_recognises_history() -> None:
    old = DeltaLedger()
    for step in range(1, 200):
        recorded(old, "a", step, f"c{step}")
    processed, nodes = old.published()
    fresh = DeltaLedger()
    fresh.merge_published(processed, nodes)
    # In the published window: the content id is known (a listing of it matches or is checked).
    assert fresh.verdict(info("a", 199, "c199")) is Verdict.KNOWN  # an LFS sha256 etag
    shared_dir_etag = info("a", 199, "10-123-456-789")
    assert fresh.verdict(shared_dir_etag) is Verdict.CHECK
    assert fresh.same_content(shared_dir_etag, "c199")
    # Below it: old. Above it: new.
    assert fresh.verdict(info("a", 3, "x")) is Verdict.OLD
    assert fresh.verdict(info("a", 200)) is Verdict.NEW
    assert fresh.nodes["a"].accepted == 199


def test_legacy_triples_count_as_processed_whatever_their_content() -> None:
    ledger = DeltaLedger.from_json([["a", 5, "5-1234"], ["b", 7, None]])
    legacy = info("a", 5, "5-1234-99-1")  # the newer shared-dir etag of the same file
    assert ledger.verdict(legacy) is Verdict.CHECK
    assert ledger.same_content(legacy, "whatever")
    assert ledger.verdict(info("b", 3)) is Verdict.OLD


def test_round_trip_through_state_and_checkpoints() -> None:
    ledger = DeltaLedger()
    recorded(ledger, "a", 5, "c5", outer=3)
    ledger.record(
        info("b", 7, "eb"), "cb", outer_step=3, accepted=False, reason="non-finite", norm=2.5
    )
    meta = ledger.state_meta()
    assert json.loads(meta["processed"]) == [["a", 5, "c5"], ["b", 7, "cb"]]
    again = DeltaLedger.from_state_meta(meta)
    assert again.to_json() == ledger.to_json()
    assert DeltaLedger.from_json(json.loads(json.dumps(ledger.to_json()))).to_json() == (
        ledger.to_json()
    )
    summary = again.nodes["b"].summary()
    assert summary["rejected"] == 1 and summary["last_reason"] == "non-finite"
    assert set(again) == {("a", 5), ("b", 7)} and ("a", 5) in again
    with pytest.raises(ValueError):
        DeltaLedger.from_json({"no": "nodes"})


def test_deletable_is_what_is_processed_and_old_enough() -> None:
    ledger = DeltaLedger(window=4)
    for step in range(1, 9):
        recorded(ledger, "a", step, f"c{step}", outer=step)
    listing = [info("a", s, f"etag-c{s}") for s in range(1, 10)]
    listing.append(info("a", 7, "changed"))  # replaced since: not the processed file
    doomed = {i.local_step for i in ledger.deletable(listing, outer_step=8, keep=2)}
    # 1-4: older than the window (processed long ago); 5, 6: processed >= 2 outer steps ago;
    # 7, 8: too recent; 9: not processed.
    assert doomed == {1, 2, 3, 4, 5, 6}
    # keep_outer_steps is honoured for deltas older than the window too.
    assert ledger.deletable(listing, outer_step=8, keep=100) == []


def test_delta_norm() -> None:
    import torch

    assert delta_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])}) == 5.0
