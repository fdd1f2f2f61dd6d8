"""``speedtronic data prepare``: tokenize a corpus once into memory-mappable token shards.

Documents are tokenized whole (no BPE merge is ever split by a chunk edge) and separated by
the tokenizer's EOS id. Two ways to hold out ``eval_fraction`` for the ``eval`` split
(``eval_split``):

- ``documents``: a document goes to ``eval`` when a keyed hash of its text falls below
  ``eval_fraction``: deterministic, independent of file order and worker count, and exact
  duplicates always land in the same split (no train/eval leakage through copies). It holds out
  about the asked fraction only when there are many documents (one text file is one document).
- ``tail``: the last ``eval_fraction`` of the token stream (what nanoGPT's ``prepare.py`` does);
  the only way to hold out part of one book.

The default, ``auto``, is ``tail`` when the corpus has fewer than :data:`TAIL_BELOW_DOCUMENTS`
documents and ``documents`` otherwise. A warning says when the held-out share differs from the
asked one by more than a factor of two.

Work is cut into tasks of a few MiB (line- or document-aligned byte ranges of big files, or
several small files) and tokenized in ``workers`` spawned processes; the results are written in
task order, so the output does not depend on the worker count: the same command always writes
byte-identical files.

Durability: shards are written under temporary names into a hidden staging folder of the output
directory, fsynced and renamed; only when every input has been read are they moved into
``train/`` and ``eval/`` and ``index.json`` written, atomically, last. A failed or interrupted
prepare leaves the previous output as it was; a killed one leaves at worst a directory without
``index.json``, which no reader accepts.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from speedtronic.data.documents import (
    Piece,
    ReadOptions,
    Skips,
    find_inputs,
    plan_pieces,
    read_piece,
)
from speedtronic.data.encoders import Encoder, EncoderSpec, load_encoder_spec
from speedtronic.data.format import (
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    SPLITS,
)
from speedtronic.data.shard_output import (
    SplitWriter,
    check_replaceable,
    commit_output,
    prepare_lock,
    removed_on_failure,
)
from speedtronic.errors import DataError

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "EVAL_SPLITS",
    "TAIL_BELOW_DOCUMENTS",
    "PrepareResult",
    "prepare",
]

log = logging.getLogger("speedtronic.data")

DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_TASK_BYTES = 4 << 20
_STAGING_PREFIX = ".prepare-"
_EVAL_KEY = b"speedtronic-eval-split"
EVAL_SPLITS = ("auto", "documents", "tail")
# Below this many documents, `auto` holds out the stream's tail: a per-document draw from a
# handful of documents gives a fraction far from the asked one (or none at all).
TAIL_BELOW_DOCUMENTS = 100


@dataclass(frozen=True)
class TaskOptions:
    """What every task needs besides its pieces."""

    read: ReadOptions
    append_eos: bool
    eval_threshold: int  # a document is held out when its 64-bit hash is below this


@dataclass
class TaskResult:
    """The tokens of one task, per split, and what was counted on the way."""

    tokens: dict[str, np.ndarray]
    documents: dict[str, int]
    empty: int
    skipped: int
    skip_examples: list[str]
    input_bytes: int


@dataclass
class PrepareResult:
    """What a prepare wrote: counts per split, the index, and how long it took."""

    out: Path
    index: dict[str, Any]
    documents: dict[str, int]
    tokens: dict[str, int]
    shards: dict[str, int]
    empty: int
    skipped: int
    skip_examples: list[str]
    input_files: int
    input_bytes: int
    elapsed_s: float
    workers: int
    eval_split: str = "documents"

    def summary(self) -> str:
        """One line for the terminal."""
        seconds = max(self.elapsed_s, 1e-9)
        total = sum(self.tokens.values())
        line = (
            f"prepared {sum(self.documents.values())} documents from {self.input_files} files "
            f"into {self.out}: train {self.tokens['train']} tokens in {self.shards['train']} "
            f"shards, eval {self.tokens['eval']} tokens in {self.shards['eval']} shards "
            f"({self.index['dtype']}, vocab {self.index['vocab_size']}); "
            f"{self.elapsed_s:.1f}s, {self.input_bytes / seconds / 1e6:.1f} MB/s, "
            f"{total / seconds:,.0f} tokens/s"
        )
        if self.empty:
            line += f"; {self.empty} empty documents left out"
        if self.skipped:
            line += f"; skipped {self.skipped} bad records (first: {self.skip_examples[0]})"
        return line


# ---------------------------------------------------------------------------------- tasks
_worker_encoder: Encoder | None = None


def _init_worker(spec: EncoderSpec, threads: int) -> None:
    """Runs once in each worker process: bound the tokenizer's Rust thread pool, load it."""
    global _worker_encoder
    for name in ("RAYON_NUM_THREADS", "RAYON_RS_NUM_CPUS"):
        os.environ.setdefault(name, str(threads))
    _worker_encoder = spec.load()


def _worker_task(pieces: list[Piece], options: TaskOptions) -> TaskResult:
    assert _worker_encoder is not None, "worker not initialised"
    return run_task(pieces, options, _worker_encoder)


def _eval_hash(text: str) -> int:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=_EVAL_KEY).digest()
    return int.from_bytes(digest, "little")


def run_task(pieces: Sequence[Piece], options: TaskOptions, encoder: Encoder) -> TaskResult:
    """Read, split and tokenize the documents of ``pieces``, in order."""
    skips = Skips()
    docs: dict[str, list[str]] = {split: [] for split in SPLITS}
    empty = 0
    threshold = options.eval_threshold
    for piece in pieces:
        for text in read_piece(piece, options.read, skips):
            if not text:
                empty += 1
            elif threshold and _eval_hash(text) < threshold:
                docs["eval"].append(text)
            else:
                docs["train"].append(text)
    return TaskResult(
        tokens={split: encoder.encode(texts, options.append_eos) for split, texts in docs.items()},
        documents={split: len(texts) for split, texts in docs.items()},
        empty=empty,
        skipped=skips.count,
        skip_examples=skips.examples,
        input_bytes=sum(piece.size for piece in pieces),
    )


def group_tasks(pieces: Sequence[Piece], task_bytes: int) -> list[list[Piece]]:
    """Consecutive pieces grouped into tasks of about ``task_bytes`` (small files together)."""
    tasks: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for piece in pieces:
        if current and size + piece.size > task_bytes:
            tasks.append(current)
            current, size = [], 0
        current.append(piece)
        size += piece.size
    if current:
        tasks.append(current)
    return tasks


def _results(
    tasks: list[list[Piece]], options: TaskOptions, spec: EncoderSpec, workers: int
) -> Iterator[TaskResult]:
    """Task results in task order; at most ``2 * workers`` tasks in flight."""
    if workers <= 1 or len(tasks) <= 1:
        encoder = spec.load()
        for task in tasks:
            yield run_task(task, options, encoder)
        return
    workers = min(workers, len(tasks))
    threads = max(1, (os.cpu_count() or 1) // workers)
    pool = ProcessPoolExecutor(
        max_workers=workers,
        # spawn: workers must not inherit a parent's threads (torch, rich, tokenizers) mid-lock.
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(spec, threads),
    )
    pending: deque[Future[TaskResult]] = deque()
    queue = iter(tasks)
    try:
        for task in queue:
            pending.append(pool.submit(_worker_task, task, options))
            if len(pending) >= 2 * workers:
                break
        while pending:
            try:
                result = pending.popleft().result()
            except BrokenProcessPool:
                raise DataError(
                    "a prepare worker process died (out of memory, killed, or it could not "
                    "start: a script that calls prepare() with workers > 1 must guard its "
                    "entry point with `if __name__ == '__main__':`); try fewer --workers"
                ) from None
            for task in queue:
                pending.append(pool.submit(_worker_task, task, options))
                break
            yield result
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def _progress_bar(enabled: bool, total: int) -> Any:
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    progress = Progress(
        TextColumn("[bold]prepare"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[documents]:,} docs"),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    progress.start()
    progress.add_task("prepare", total=total, documents=0, tokens=0)
    return progress


def _fewer_documents(tasks: list[list[Piece]], read: ReadOptions, limit: int) -> bool:
    """True when the corpus holds fewer than ``limit`` non-empty documents; stops reading at
    the ``limit``-th, so a large corpus costs only its first documents."""
    count = 0
    for task in tasks:
        for piece in task:
            for text in read_piece(piece, read, Skips()):
                count += bool(text)
                if count >= limit:
                    return False
    return True


def _check_fraction(asked: float, held: int, total: int, split: str) -> None:
    """Warn when the held-out share is off the asked one by more than a factor of two."""
    if not asked or not total:
        return
    realised = held / total
    if asked / 2 <= realised <= asked * 2:
        return
    advice = (
        "; with few documents use --eval-split tail (the last fraction of the token stream) "
        "or --blank-line-documents (one document per blank-line-separated block)"
        if split == "documents"
        else ""
    )
    log.warning(
        "--eval-fraction %g held out %.4g of the tokens (%d of %d) with --eval-split %s%s",
        asked,
        realised,
        held,
        total,
        split,
        advice,
    )


def _default_workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, 16))


def prepare(
    inputs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] = "bytes",
    text_field: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    eval_fraction: float = 0.0,
    eval_split: str = "auto",
    workers: int | None = None,
    append_eos: bool = True,
    eos_token: str | None = None,
    split_blank_lines: bool = False,
    skip_bad: bool = False,
    max_doc_bytes: int = 64 << 20,
    progress: bool | None = None,
    task_bytes: int = DEFAULT_TASK_BYTES,
    on_result: Callable[[TaskResult], None] | None = None,
) -> PrepareResult:
    """Tokenize ``inputs`` into the token-shard directory ``out`` (see the module docstring).

    ``eval_split`` is ``documents``, ``tail`` or ``auto`` (see the module docstring).
    ``progress`` shows a rich progress bar on stderr (default: when stderr is a terminal).
    ``workers`` defaults to the usable CPU cores (at most 16). ``on_result`` is called with
    each task's result, in order, before it is written.
    """
    started = time.perf_counter()
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if eval_split not in EVAL_SPLITS:
        raise DataError(f"--eval-split must be one of {', '.join(EVAL_SPLITS)}, got {eval_split!r}")
    if workers is not None and workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}")
    if max_doc_bytes < 1 or task_bytes < 1:
        raise DataError("--max-doc-bytes and the task size must be positive")
    if not text_field:
        raise DataError("--text-field must not be empty")
    workers = workers or _default_workers()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not a directory")
    check_replaceable(out)

    spec = load_encoder_spec(tokenizer, eos_token, append_eos)
    dtype = DTYPES[spec.dtype]
    read = ReadOptions(text_field, split_blank_lines, skip_bad, max_doc_bytes)
    files = find_inputs(inputs, exclude=out)
    skips = Skips()
    tasks = group_tasks(plan_pieces(files, read, task_bytes, skips), task_bytes)
    if eval_split == "auto":
        few = eval_fraction > 0 and _fewer_documents(tasks, read, TAIL_BELOW_DOCUMENTS)
        eval_split = "tail" if few else "documents"
        if few:
            log.info(
                "fewer than %d documents: holding out the last %g of the token stream "
                "(--eval-split tail)",
                TAIL_BELOW_DOCUMENTS,
                eval_fraction,
            )
    threshold = int(eval_fraction * 2**64) if eval_split == "documents" else 0
    options = TaskOptions(read, append_eos, threshold)

    # The highest directory this prepare creates (--out or a missing parent of it).
    created: Path | None = None
    for candidate in (out, *out.parents):
        if candidate.exists():
            break
        created = candidate
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"--out {out}: cannot create it: {exc.strerror or exc}") from None
    documents = dict.fromkeys(SPLITS, 0)
    tokens = dict.fromkeys(SPLITS, 0)
    empty = input_bytes = 0
    with removed_on_failure(out, created), prepare_lock(out):
        for stale in out.glob(_STAGING_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed prepare
        staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=out))
        writers = {split: SplitWriter(staging, split, dtype, shard_tokens) for split in SPLITS}
        enabled = sys.stderr.isatty() if progress is None else progress
        bar = _progress_bar(enabled, sum(piece.size for task in tasks for piece in task))
        try:
            for result in _results(tasks, options, spec, workers):
                if on_result is not None:
                    on_result(result)
                for split in SPLITS:
                    writers[split].write(result.tokens[split])
                    documents[split] += result.documents[split]
                    tokens[split] += int(result.tokens[split].size)
                empty += result.empty
                input_bytes += result.input_bytes
                skips.merge(result.skipped, result.skip_examples)
                if bar is not None:
                    bar.update(
                        bar.task_ids[0],
                        advance=result.input_bytes,
                        documents=sum(documents.values()),
                        tokens=sum(tokens.values()),
                    )
            writers["train"].close()
            if eval_split == "tail" and eval_fraction:
                held = round(eval_fraction * tokens["train"])
                writers["train"].cut_tail(held, writers["eval"])
                tokens["train"] -= held
                tokens["eval"] += held
            shards = {split: writer.close() for split, writer in writers.items()}
            _check_fraction(eval_fraction, tokens["eval"], sum(tokens.values()), eval_split)
            if not tokens["train"]:
                raise DataError(
                    f"no documents to train on in {', '.join(map(str, inputs))} "
                    f"({len(files)} files read, {empty} empty documents, {skips.count} bad "
                    f"records skipped, {documents['eval']} held out for eval)"
                    + (
                        "; to hold out part of few documents use --eval-split tail"
                        if documents["eval"]
                        else ""
                    )
                )
            index = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "dtype": spec.dtype,
                "byte_order": "little",
                "vocab_size": spec.vocab_size,
                "eos_id": spec.eos_id,
                "append_eos": append_eos,
                "tokenizer": spec.describe(),
                "text_field": text_field,
                "split_blank_lines": split_blank_lines,
                "shard_tokens": shard_tokens,
                "eval_fraction": eval_fraction,
                "eval_split": eval_split,
                "counts": {"empty_documents": empty, "skipped_records": skips.count},
                "splits": {
                    split: {
                        "documents": documents[split],
                        "tokens": tokens[split],
                        "shards": shards[split],
                    }
                    for split in SPLITS
                },
            }
            commit_output(out, staging, index)
        finally:
            if bar is not None:
                bar.stop()
            for writer in writers.values():
                writer.abort()
            shutil.rmtree(staging, ignore_errors=True)
    if skips.count:
        for example in skips.examples:
            log.warning("skipped: %s", example)
    return PrepareResult(
        out=out,
        index=index,
        documents=documents,
        tokens=tokens,
        shards={split: len(shards[split]) for split in SPLITS},
        empty=empty,
        skipped=skips.count,
        skip_examples=skips.examples,
        input_files=len(files),
        input_bytes=input_bytes,
        elapsed_s=time.perf_counter() - started,
        workers=workers,
        eval_split=eval_split,
    )
