"""Finding, splitting and reading the documents of ``speedtronic data prepare``.

Every input is treated as hostile: lines and documents are read with a size bound, JSON is
parsed with the standard library only (no pickle, no eval), and each problem is one
:class:`~speedtronic.errors.DataError` naming the file and line (or parquet row), or, with
``skip_bad``, a counted skip.

Inputs: ``.txt`` (one document per file, or per blank-line-separated block), ``.jsonl`` and
``.jsonl.gz`` (one JSON object per line, the text in one field), ``.parquet`` (one string
column; needs ``pyarrow``), and directories of them (walked in sorted order, hidden entries
skipped).
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, BinaryIO

from speedtronic._files import regular_file_problem
from speedtronic.errors import DataError

__all__ = [
    "SUFFIXES",
    "InputFile",
    "Piece",
    "ReadOptions",
    "Skips",
    "find_inputs",
    "plan_pieces",
    "read_piece",
]

SUFFIXES = {".jsonl.gz": "jsonl.gz", ".jsonl": "jsonl", ".txt": "txt", ".parquet": "parquet"}
_SCAN = 1 << 16


@dataclass(frozen=True)
class ReadOptions:
    """How documents are read."""

    text_field: str = "text"
    split_blank_lines: bool = False
    skip_bad: bool = False
    max_doc_bytes: int = 64 << 20


@dataclass(frozen=True)
class InputFile:
    """One input file, its kind (a key of :data:`SUFFIXES`'s values) and size."""

    path: str
    kind: str
    size: int


@dataclass(frozen=True)
class Piece:
    """A unit of reading: a byte range ``[start, end)`` of a text or JSONL file (edges at line
    or, for blank-line documents, at document boundaries), a whole ``.jsonl.gz`` file, or one
    row group of a parquet file (``first_row`` is its first row's number, from 0)."""

    path: str
    kind: str
    start: int = 0
    end: int | None = None
    row_group: int | None = None
    first_row: int = 0
    size: int = 0


@dataclass
class Skips:
    """Bad records skipped under ``skip_bad``: how many, and the first few messages."""

    count: int = 0
    examples: list[str] = field(default_factory=list)
    keep: int = 5

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.examples) < self.keep:
            self.examples.append(message)

    def merge(self, count: int, examples: Sequence[str]) -> None:
        self.count += count
        self.examples.extend(examples[: self.keep - len(self.examples)])


def kind_of(path: Path) -> str | None:
    """The input kind of a file name, or None if prepare does not read it."""
    name = path.name.lower()
    return next((kind for suffix, kind in SUFFIXES.items() if name.endswith(suffix)), None)


def find_inputs(
    inputs: Sequence[str | os.PathLike[str]], exclude: Path | None = None
) -> list[InputFile]:
    """The input files, in order: each argument in turn, a directory's files sorted by path.
    The same file given twice is read once; files under ``exclude`` (the output) never."""
    if not inputs:
        raise DataError("no inputs: give at least one file or directory")
    excluded = exclude.resolve() if exclude is not None else None
    found: list[InputFile] = []
    seen: set[Path] = set()

    def add(path: Path, kind: str) -> None:
        resolved = path.resolve()
        if resolved in seen:
            return
        if excluded is not None and (resolved == excluded or excluded in resolved.parents):
            return
        seen.add(resolved)
        try:
            info = path.stat()
        except OSError as exc:
            raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
        problem = regular_file_problem(info.st_mode)
        if problem is not None:  # reading a FIFO or a device would block or never end
            raise DataError(f"{path}: cannot read: {problem}; prepare reads regular files only")
        found.append(InputFile(str(path), kind, info.st_size))

    for argument in inputs:
        path = Path(argument)
        if path.is_dir():
            before = len(found)
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(files):
                    file = Path(root) / name
                    kind = kind_of(file)
                    if kind and not name.startswith("."):
                        add(file, kind)
            if len(found) == before:
                raise DataError(
                    f"{path}: no input files in this directory (looked for {', '.join(SUFFIXES)})"
                )
        elif path.exists():
            kind = kind_of(path)
            if kind is None:
                raise DataError(f"{path}: unsupported input type (expected {', '.join(SUFFIXES)})")
            add(path, kind)
        else:
            raise DataError(f"{path}: input not found")
    return found


def plan_pieces(
    files: Sequence[InputFile], options: ReadOptions, piece_bytes: int, skips: Skips
) -> list[Piece]:
    """Cut the inputs into pieces of about ``piece_bytes`` that can be read independently."""
    pieces: list[Piece] = []
    for file in files:
        if file.kind == "parquet":
            try:
                pieces.extend(_parquet_pieces(file))
            except _BadParquet as exc:
                if not options.skip_bad:
                    raise
                skips.add(str(exc))
        elif file.kind == "jsonl.gz" or (file.kind == "txt" and not options.split_blank_lines):
            pieces.append(Piece(file.path, file.kind, size=file.size))
        else:
            edges = _edges(file, options, piece_bytes)
            for start, end in pairwise(edges):
                pieces.append(Piece(file.path, file.kind, start, end, size=end - start))
    return pieces


def _edges(file: InputFile, options: ReadOptions, piece_bytes: int) -> list[int]:
    points = [0]
    if file.size > piece_bytes:
        try:
            with open(file.path, "rb") as handle:
                while points[-1] + piece_bytes < file.size:
                    edge = _edge(handle, points[-1] + piece_bytes, options)
                    if edge is None or edge >= file.size:
                        break
                    points.append(edge)
        except OSError:
            pass  # the reader reports it, with the file's name, as for any file
    return [*points, file.size]


def _edge(handle: BinaryIO, nominal: int, options: ReadOptions) -> int | None:
    """Just after the first newline at or after byte ``nominal - 1`` (for blank-line documents:
    just after the first blank line from there), or None if none is near enough."""
    handle.seek(nominal - 1)
    scanned = 0
    while True:
        window = handle.read(_SCAN)
        if not window:
            return None
        newline = window.find(b"\n")
        if newline >= 0:
            position = nominal - 1 + scanned + newline + 1
            break
        scanned += len(window)
        if scanned > options.max_doc_bytes:
            return None
    if not options.split_blank_lines:
        return position
    handle.seek(position)
    limit = options.max_doc_bytes
    while True:
        line = handle.readline(limit + 1)
        if not line or len(line) > limit:
            return None
        position += len(line)
        if not line.strip():
            return position
        if position - nominal > limit:
            return None


def _parquet_pieces(file: InputFile) -> list[Piece]:
    metadata = _parquet_file(file.path).metadata
    pieces, row = [], 0
    for group in range(metadata.num_row_groups):
        info = metadata.row_group(group)
        pieces.append(
            Piece(file.path, "parquet", row_group=group, first_row=row, size=info.total_byte_size)
        )
        row += info.num_rows
    return pieces


class _BadParquet(DataError):
    """A parquet file that cannot be opened (skippable, unlike a missing pyarrow)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem

    def __reduce__(self) -> Any:
        return (type(self), (self.path, self.problem))


def _parquet_file(path: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading .parquet needs pyarrow: pip install 'speedtronic-core[parquet]'"
        ) from None
    try:
        return pq.ParquetFile(path)
    except OSError as exc:
        if exc.strerror:
            raise _BadParquet(path, f"cannot read: {exc.strerror}") from None
        raise _BadParquet(path, f"not a readable parquet file ({_short(exc)})") from None
    except Exception as exc:  # pyarrow.ArrowInvalid and friends
        raise _BadParquet(path, f"not a readable parquet file ({_short(exc)})") from None


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


class _Reader:
    """Reads one piece, reporting problems at ``path:line``."""

    def __init__(self, piece: Piece, options: ReadOptions, skips: Skips) -> None:
        self.piece = piece
        self.options = options
        self.skips = skips
        self._line_base: int | None = None if piece.start else 0

    def line(self, local: int) -> int:
        """The file's line number of the piece's line ``local`` (from 1)."""
        if self._line_base is None:  # only when reporting, so counting lines costs nothing else
            count = 0
            with open(self.piece.path, "rb") as handle:
                remaining = self.piece.start
                while remaining > 0 and (block := handle.read(min(remaining, 1 << 20))):
                    count += block.count(b"\n")
                    remaining -= len(block)
            self._line_base = count
        return self._line_base + local

    def bad(self, where: str, problem: str) -> None:
        message = f"{self.piece.path}{where}: {problem}"
        if not self.options.skip_bad:
            raise DataError(message)
        self.skips.add(message)

    def read(self) -> Iterator[str]:
        kind = self.piece.kind
        try:
            if kind == "parquet":
                yield from self._parquet()
            elif kind == "txt" and not self.options.split_blank_lines:
                yield from self._whole_file()
            else:
                yield from self._lines()
        except _BadParquet as exc:
            self.bad("", exc.problem)
        except OSError as exc:
            self.bad("", f"cannot read: {exc.strerror or _short(exc)}")

    # ------------------------------------------------------------------ .txt, one per file
    def _whole_file(self) -> Iterator[str]:
        limit = self.options.max_doc_bytes
        with open(self.piece.path, "rb") as handle:
            raw = handle.read(limit + 1)
        if len(raw) > limit:
            self.bad("", f"document larger than --max-doc-bytes {limit}")
            return
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw.count(b"\n", 0, exc.start) + 1
            self.bad(f":{line}", f"not valid UTF-8 (byte {exc.start})")
            return
        yield text.removeprefix("\ufeff")

    # ------------------------------------------------------------------ line-based kinds
    def _open(self) -> BinaryIO:
        if self.piece.kind == "jsonl.gz":
            return gzip.open(self.piece.path, "rb")  # type: ignore[return-value]
        handle = open(self.piece.path, "rb")  # noqa: SIM115 - closed by the caller
        handle.seek(self.piece.start)
        return handle

    def _lines(self) -> Iterator[str]:
        limit = self.options.max_doc_bytes
        jsonl = self.piece.kind != "txt"
        remaining = None if self.piece.end is None else self.piece.end - self.piece.start
        block: list[bytes] = []
        block_line = block_bytes = 0
        local = 0
        with self._open() as handle:
            while remaining is None or remaining > 0:
                try:
                    line = handle.readline(limit + 1)
                except (EOFError, zlib.error, gzip.BadGzipFile) as exc:  # truncated, corrupt
                    self.bad(f":{self.line(local + 1)}", f"corrupt gzip data ({_short(exc)})")
                    return
                if not line:
                    break
                local += 1
                if remaining is not None:
                    remaining -= len(line)
                if len(line) > limit and not line.endswith(b"\n"):
                    remaining = self._skip_rest(handle, remaining)
                    self.bad(f":{self.line(local)}", f"line longer than --max-doc-bytes {limit}")
                    if not jsonl:
                        block, block_bytes = [], 0
                    continue
                if jsonl:
                    text = self._json_text(line, local)
                    if text is not None:
                        yield text
                    continue
                if line.strip():
                    if not block:
                        block_line = local
                    block.append(line)
                    block_bytes += len(line)
                    continue
                if block:
                    text = self._block_text(block, block_bytes, block_line)
                    block, block_bytes = [], 0
                    if text is not None:
                        yield text
        if block:
            text = self._block_text(block, block_bytes, block_line)
            if text is not None:
                yield text

    def _skip_rest(self, handle: BinaryIO, remaining: int | None) -> int | None:
        while True:
            more = handle.readline(self.options.max_doc_bytes + 1)
            if remaining is not None:
                remaining -= len(more)
            if not more or more.endswith(b"\n"):
                return remaining

    def _json_text(self, line: bytes, local: int) -> str | None:
        if not line.strip():
            return None  # blank lines between records are fine
        field_name = self.options.text_field
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            self.bad(f":{self.line(local)}", f"not valid UTF-8 (byte {exc.start} of the line)")
            return None
        except json.JSONDecodeError as exc:
            self.bad(f":{self.line(local)}", f"invalid JSON: {exc.msg} (column {exc.colno})")
            return None
        except (ValueError, RecursionError) as exc:
            self.bad(f":{self.line(local)}", f"invalid JSON: {_short(exc)}")
            return None
        if not isinstance(record, dict):
            self.bad(f":{self.line(local)}", f"expected a JSON object, got {type(record).__name__}")
            return None
        if field_name not in record:
            keys = ", ".join(sorted(map(str, record))[:8]) or "none"
            self.bad(
                f":{self.line(local)}",
                f"missing field {field_name!r} (fields: {keys}; choose one with --text-field)",
            )
            return None
        text = record[field_name]
        if not isinstance(text, str):
            self.bad(
                f":{self.line(local)}",
                f"field {field_name!r} is {type(text).__name__}, not a string",
            )
            return None
        if not text.isascii():
            try:  # JSON may escape lone surrogates ("\ud800"), which no UTF-8 text holds
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                self.bad(
                    f":{self.line(local)}",
                    f"field {field_name!r} is not valid Unicode (an unpaired surrogate at "
                    f"character {exc.start})",
                )
                return None
        return text

    def _block_text(self, block: list[bytes], size: int, first_line: int) -> str | None:
        limit = self.options.max_doc_bytes
        if size > limit:
            self.bad(f":{self.line(first_line)}", f"document larger than --max-doc-bytes {limit}")
            return None
        raw = b"".join(block)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = first_line + raw.count(b"\n", 0, exc.start)
            self.bad(f":{self.line(line)}", "not valid UTF-8")
            return None
        if first_line == 1 and self.piece.start == 0:
            text = text.removeprefix("\ufeff")
        return text.rstrip("\r\n")

    # ------------------------------------------------------------------ .parquet
    def _parquet(self) -> Iterator[str]:
        parquet = _parquet_file(self.piece.path)
        field_name = self.options.text_field
        schema = parquet.schema_arrow
        index = schema.get_field_index(field_name)
        if index < 0:
            columns = ", ".join(schema.names[:8]) or "none"
            self.bad(
                "", f"no column {field_name!r} (columns: {columns}; choose one with --text-field)"
            )
            return
        column_type = str(schema.field(index).type)
        if column_type not in ("string", "large_string", "string_view"):
            self.bad("", f"column {field_name!r} is {column_type}, not a string")
            return
        row = self.piece.first_row
        try:
            batches = parquet.iter_batches(
                batch_size=1024, row_groups=[self.piece.row_group], columns=[field_name]
            )
            for batch in batches:
                for value in batch.column(0).to_pylist():
                    row += 1
                    if value is None:
                        self.bad(f": row {row}", f"field {field_name!r} is null")
                        continue
                    yield value
        except DataError:
            raise
        except Exception as exc:  # pyarrow.ArrowInvalid and friends
            self.bad(f": row {row + 1}", f"cannot read parquet data ({_short(exc)})")


def read_piece(piece: Piece, options: ReadOptions, skips: Skips) -> Iterator[str]:
    """The documents of ``piece``, in order; empty documents included (the caller counts
    them)."""
    return _Reader(piece, options, skips).read()
