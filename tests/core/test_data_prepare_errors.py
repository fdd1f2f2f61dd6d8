"""Every bad input to ``speedtronic data prepare`` is one clear DataError naming the file and
line (or a counted skip with ``skip_bad``), and never leaves output behind."""

from __future__ import annotations

import gzip
import json
import logging
import sys
from pathlib import Path

import pytest

from speedtronic import DataError
from speedtronic.data import documents as documents_module
from speedtronic.data import prepare, read_index


def jsonl(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def good(text: str = "fine") -> str:
    return json.dumps({"text": text})


def fails(tmp_path: Path, inputs, match: str, **kwargs) -> DataError:
    out = tmp_path / "new" / "out"  # neither exists: both must be gone after the failure
    with pytest.raises(DataError, match=match) as info:
        prepare(inputs, out, workers=kwargs.pop("workers", 1), **kwargs)
    assert "\n" not in str(info.value)
    # Nothing at all: not even an empty --out with the lock file in it (issue 34).
    assert not out.parent.exists(), list(out.parent.rglob("*"))
    return info.value


# ------------------------------------------------------------------ bad records, file:line
RECORDS = {
    "invalid JSON": ("{not json", "c.jsonl:2: invalid JSON: Expecting property name"),
    "not an object": ("[1, 2]", "c.jsonl:2: expected a JSON object, got list"),
    "missing field": (
        json.dumps({"body": "x", "id": 1}),
        r"c.jsonl:2: missing field 'text' \(fields: body, id; choose one with --text-field\)",
    ),
    "not a string": (json.dumps({"text": 5}), "c.jsonl:2: field 'text' is int, not a string"),
    "surrogate": ('{"text": "a\\ud800b"}', "c.jsonl:2: field 'text' is not valid Unicode"),
    "nesting bomb": ("[" * 100_000 + "]" * 100_000, "c.jsonl:2: invalid JSON"),
    "huge number": ('{"text": ' + "9" * 5000 + "}", "c.jsonl:2: invalid JSON"),
}


@pytest.mark.parametrize("case", RECORDS)
def test_a_bad_jsonl_record_names_file_and_line(tmp_path, case):
    line, message = RECORDS[case]
    path = jsonl(tmp_path / "c.jsonl", good(), line, good())
    error = fails(tmp_path, [path], message)
    assert str(path) in str(error)


def test_invalid_utf8_and_overlong_lines_name_file_and_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(good().encode() + b"\n" + b'{"text": "\xff"}\n')
    fails(tmp_path, [path], "c.jsonl:2: not valid UTF-8")
    path.write_text((good() + "\n") * 2 + good("x" * 500) + "\n")
    fails(tmp_path, [path], "c.jsonl:3: line longer than --max-doc-bytes 100", max_doc_bytes=100)

    text = tmp_path / "t.txt"
    text.write_bytes(b"line one\nline \xc3\x28 two\n")
    fails(tmp_path, [text], r"t.txt:2: not valid UTF-8")
    fails(tmp_path, [text], r"t.txt:2: not valid UTF-8", split_blank_lines=True)
    text.write_bytes(b"x" * 200)
    fails(tmp_path, [text], "t.txt: document larger than --max-doc-bytes 100", max_doc_bytes=100)
    text.write_bytes(b"short\n\n" + b"long line\n" * 30)
    fails(tmp_path, [text], "t.txt:3: document larger than --max-doc-bytes 100",
          max_doc_bytes=100, split_blank_lines=True)  # fmt: skip


def test_corrupt_or_truncated_gzip_names_the_file(tmp_path):
    path = tmp_path / "c.jsonl.gz"
    body = gzip.compress(("\n".join(good(f"doc {i}") for i in range(2000)) + "\n").encode())
    path.write_bytes(body[: len(body) // 2])
    fails(tmp_path, [path], r"c.jsonl.gz:\d+: corrupt gzip data")
    path.write_bytes(b"plain text, not gzip\n")
    fails(tmp_path, [path], "c.jsonl.gz:1: corrupt gzip data")


def test_line_numbers_stay_right_when_a_big_file_is_cut_into_pieces(tmp_path):
    lines = [good(f"document number {i}") for i in range(3000)]
    lines[2500] = "{oops"
    path = jsonl(tmp_path / "c.jsonl", *lines)
    fails(tmp_path, [path], "c.jsonl:2501: invalid JSON", task_bytes=4096)
    # ... and when the error comes from a worker process.
    error = fails(tmp_path, [path], "c.jsonl:2501: invalid JSON", task_bytes=4096, workers=2)
    assert type(error) is DataError


# ------------------------------------------------------------------ files and arguments
def test_missing_unsupported_and_empty_inputs(tmp_path):
    fails(tmp_path, [tmp_path / "nope.jsonl"], "nope.jsonl: input not found")
    (tmp_path / "notes.md").write_text("x")
    fails(tmp_path, [tmp_path / "notes.md"], r"notes.md: unsupported input type \(expected")
    (tmp_path / "empty").mkdir()
    fails(tmp_path, [tmp_path / "empty"], "empty: no input files in this directory")
    fails(tmp_path, [], "no inputs")
    blank = jsonl(tmp_path / "blank.jsonl", json.dumps({"text": ""}), "")
    fails(tmp_path, [blank], r"no documents to train on .*1 empty documents")


def test_an_unreadable_file_names_the_file(tmp_path, monkeypatch):
    path = jsonl(tmp_path / "secret.jsonl", good())

    def refuse(file, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(file))

    monkeypatch.setattr(documents_module, "open", refuse, raising=False)  # root ignores chmod
    fails(tmp_path, [path], "secret.jsonl: cannot read: Permission denied")


def test_bad_arguments_are_clear(tmp_path):
    path = jsonl(tmp_path / "c.jsonl", good())
    fails(tmp_path, [path], "--shard-tokens must be at least 1", shard_tokens=0)
    fails(tmp_path, [path], r"--eval-fraction must be in \[0, 1\)", eval_fraction=1.0)
    fails(tmp_path, [path], "--workers must be at least 1", workers=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="exists and is not a directory"):
        prepare([path], tmp_path / "file")


def test_only_one_prepare_writes_a_directory_at_a_time(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    path = jsonl(tmp_path / "c.jsonl", good())
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".prepare.lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        with pytest.raises(DataError, match="another `speedtronic data prepare` is writing"):
            prepare([path], out, workers=1)


# ------------------------------------------------------------------ tokenizers and parquet
def test_tokenizer_problems_are_clear(tmp_path, monkeypatch):
    path = jsonl(tmp_path / "c.jsonl", good())
    fails(tmp_path, [path], "tokenizer not found: .*nothing is downloaded",
          tokenizer=tmp_path / "missing.json")  # fmt: skip
    broken = tmp_path / "broken" / "tokenizer.json"
    broken.parent.mkdir()
    broken.write_text('{"model": 3}')
    pytest.importorskip("tokenizers")
    fails(tmp_path, [path], "cannot load tokenizer .*broken/tokenizer.json", tokenizer=broken)
    fails(tmp_path, [path], "--eos-token applies to a tokenizer.json", eos_token="</s>")

    from tokenizers import Tokenizer, models, pre_tokenizers

    plain = Tokenizer(models.WordLevel({"fine": 0, "[UNK]": 1}, unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    plain.save(str(tmp_path / "plain.json"))
    fails(tmp_path, [path], "none of the usual end-of-text tokens .*--eos-token",
          tokenizer=tmp_path / "plain.json")  # fmt: skip
    fails(tmp_path, [path], "--eos-token '<end>' is not in the vocabulary",
          tokenizer=tmp_path / "plain.json", eos_token="<end>")  # fmt: skip
    prepare([path], tmp_path / "ok", tokenizer=tmp_path / "plain.json", eos_token="[UNK]",
            workers=1)  # fmt: skip
    assert read_index(tmp_path / "ok").eos_id == 1

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # "not installed"
    fails(tmp_path, [path], r"needs the Hugging Face tokenizers library: pip install "
          r"'speedtronic-core\[tokenizers\]'", tokenizer=tmp_path / "plain.json")  # fmt: skip


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "c.parquet").write_bytes(b"PAR1 whatever")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    fails(
        tmp_path,
        [tmp_path / "c.parquet"],
        r"c.parquet: reading .parquet needs pyarrow: pip install 'speedtronic-core\[parquet\]'",
        skip_bad=True,
    )  # fmt: skip  (a missing library is never a skippable record)


def test_bad_parquet_files_are_clear(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    fails(tmp_path, [tmp_path / "junk.parquet"], "junk.parquet: not a readable parquet file")
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "other.parquet")
    fails(
        tmp_path, [tmp_path / "other.parquet"], r"other.parquet: no column 'text' \(columns: body"
    )
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    fails(
        tmp_path, [tmp_path / "ints.parquet"], "ints.parquet: column 'text' is int64, not a string"
    )
    pq.write_table(pa.table({"text": ["a", None, "b"]}), tmp_path / "nulls.parquet")
    fails(tmp_path, [tmp_path / "nulls.parquet"], "nulls.parquet: row 2: field 'text' is null")


# ------------------------------------------------------------------ --skip-bad
def test_skip_bad_counts_and_reports_and_keeps_the_good_records(tmp_path, monkeypatch, caplog):
    path = jsonl(tmp_path / "c.jsonl", good("one"), "{bad", json.dumps({"x": 1}), good("two"))
    gz = tmp_path / "z.jsonl.gz"
    gz.write_bytes(b"not gzip")
    text = tmp_path / "t.txt"
    text.write_bytes(b"\xff\xfe")
    with caplog.at_level(logging.WARNING, logger="speedtronic.data"):
        result = prepare([path, gz, text], tmp_path / "out", skip_bad=True, workers=1)
    assert result.skipped == 4 and result.documents["train"] == 2
    assert result.skip_examples[0].endswith("c.jsonl:2: invalid JSON: Expecting property name "
                                            "enclosed in double quotes (column 2)")  # fmt: skip
    assert "skipped 4 bad records (first: " in result.summary()
    assert sum("skipped:" in r.getMessage() for r in caplog.records) == 4
    assert read_index(tmp_path / "out").raw["counts"]["skipped_records"] == 4

    def refuse(file, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(file))

    monkeypatch.setattr(documents_module, "open", refuse, raising=False)
    with pytest.raises(DataError, match=r"no documents to train on .*1 bad records skipped"):
        prepare([path], tmp_path / "none", skip_bad=True, workers=1)
