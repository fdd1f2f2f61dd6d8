"""Hostile inputs to the newer surfaces, each test named after what broke.

Token shards and ``speedtronic data prepare``, ``speedtronic eval``'s checkpoint pointers,
``generate``/``export`` arguments, a Hugging Face ``config.json``, and the newer config sections
(``data.dataset``, ``eval.*``, the launcher environment of ``parallel``). Each bad input must be
one error naming the field or file (exit status 2, one ``error:`` line, no traceback), must not
hang, and must leave what was saved intact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from core.plugin_fixtures import plugin_env, run_cli, user_error_line
from core.toy_runs import TINY_TRANSFORMER, tiny_transformer_run, train
from torch import nn

from speedtronic import cli
from speedtronic.checkpoint import CheckpointManager, checkpoint_name
from speedtronic.checkpoint import reader as reader_module
from speedtronic.checkpoint.fileio import manifest_entry
from speedtronic.checkpoint.names import HASH_CHUNK_BYTES
from speedtronic.data import check_shards, read_index
from speedtronic.data.preparation import prepare
from speedtronic.errors import CheckpointError, DataError, SpeedtronicError
from speedtronic.inference.generation import SamplingOptions, generate_tokens, sample_next

# ---------------------------------------------------------------- helpers


def cli_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run the CLI in-process; assert a clean user error and return its one ``error:`` line."""
    code = cli.main(list(args))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def without_hanging(call: Callable[[], Any], *fifos: Path, seconds: float = 20) -> Any:
    """``call()`` in a thread; if it is still blocked (on opening one of ``fifos``) after
    ``seconds``, unblock it by opening the FIFOs and fail, rather than hang the suite."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:  # a writer end lets the blocked open() return (and read EOF)
            os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        thread.join(seconds)
        pytest.fail(f"blocked reading a FIFO ({', '.join(map(str, fifos))})")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


# The subprocesses load the reference model's plugin only (not every installed one: slow).
MODELS_ONLY = plugin_env(load="speedtronic-models")


def write_config(directory: Path, config: dict[str, Any]) -> Path:
    path = directory / "run.json"
    path.write_text(json.dumps(config))
    return path


# ---------------------------------------------------------------- a trained run


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run with eval and checkpoint.keep_best (checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("trained")
    train(
        tiny_transformer_run(
            root,
            run={"max_steps": 4},
            eval={"every": 2, "batches": 1},
            checkpoint={"interval": 2, "keep_best": True},
        )
    )
    return root


def run_copy(trained: Path, tmp_path: Path, **sections: Any) -> tuple[Path, Path]:
    """A copy of the trained run in ``tmp_path``: (its config file, its checkpoint dir)."""
    shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
    config = tiny_transformer_run(
        tmp_path,
        run={"max_steps": 4},
        eval={"every": 2, "batches": 1},
        checkpoint={"interval": 2, "keep_best": True},
    )
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return write_config(tmp_path, config), tmp_path / "checkpoints"


# ---------------------------------------------------------------- eval and checkpoints


def test_a_fifo_as_best_json_is_one_cli_error_not_a_hang(trained: Path, tmp_path: Path) -> None:
    config, checkpoints = run_copy(trained, tmp_path)
    (checkpoints / "best.json").unlink()
    os.mkfifo(checkpoints / "best.json")
    done = run_cli(
        "eval", "--config", str(config), "--checkpoint", "best", env=MODELS_ONLY, timeout=120
    )
    line = user_error_line(done)
    assert line.startswith(f"error: no best checkpoint in {checkpoints}: best.json is unusable")
    assert "not a regular file (a FIFO)" in done.stderr  # the warning says why


@pytest.mark.parametrize(
    "pointer",
    [
        {"checkpoint": "../../etc"},
        {"checkpoint": "/etc/passwd"},
        {"checkpoint": 5},
        ["step_00000004"],
        "[" * 30_000 + "]" * 30_000,  # deep nesting: a RecursionError in json
    ],
    ids=["traversal", "absolute", "int", "list", "deep"],
)
def test_an_unusable_best_json_is_not_reported_as_missing(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], pointer: Any
) -> None:
    config, checkpoints = run_copy(trained, tmp_path)
    text = pointer if isinstance(pointer, str) else json.dumps(pointer)
    (checkpoints / "best.json").write_text(text)
    line = cli_error(capsys, "eval", "--config", str(config), "--checkpoint", "best")
    assert line == (
        f"error: no best checkpoint in {checkpoints}: best.json is unusable (the warning above "
        "says why); give --checkpoint latest or a step_NNNNNNNN directory"
    )


def test_a_fifo_as_latest_json_is_ignored_like_a_damaged_pointer(
    trained: Path, tmp_path: Path
) -> None:
    _, checkpoints = run_copy(trained, tmp_path)
    (checkpoints / "latest.json").unlink()
    os.mkfifo(checkpoints / "latest.json")
    loaded = without_hanging(
        lambda: CheckpointManager(checkpoints).load_latest(), checkpoints / "latest.json"
    )
    assert loaded.step == 4  # found by searching the directory


@pytest.mark.parametrize("field", ["step", "size"])
def test_a_manifest_number_of_1e400_is_a_corrupt_checkpoint(
    trained: Path, tmp_path: Path, field: str
) -> None:
    _, checkpoints = run_copy(trained, tmp_path)
    newest = checkpoints / checkpoint_name(4)
    manifest = json.loads((newest / "manifest.json").read_text())
    if field == "step":
        manifest["step"] = "INFINITY"
    else:
        manifest["files"]["state.json"]["size"] = "INFINITY"
    # json.dumps cannot write it: 1e400 is what a hostile editor writes (JSON reads it as inf).
    (newest / "manifest.json").write_text(json.dumps(manifest).replace('"INFINITY"', "1e400"))
    with pytest.raises(CheckpointError, match=r"step_00000004: unreadable manifest \(cannot"):
        CheckpointManager(checkpoints).load(str(newest))


@pytest.mark.parametrize("kind", ["fifo", "directory", "huge"])
def test_a_manifest_that_is_not_a_small_regular_file_is_a_corrupt_checkpoint(
    trained: Path, tmp_path: Path, kind: str
) -> None:
    _, checkpoints = run_copy(trained, tmp_path)
    manifest = checkpoints / checkpoint_name(4) / "manifest.json"
    manifest.unlink()
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "directory":
        manifest.mkdir()
    else:
        with open(manifest, "wb") as handle:  # sparse: no disk space used
            handle.truncate(reader_module.MAX_MANIFEST_BYTES + 1)
    expected = {"fifo": "a FIFO", "directory": "a directory", "huge": "larger than 16 MiB"}[kind]
    with pytest.raises(CheckpointError, match=r"unreadable manifest") as caught:
        without_hanging(lambda: CheckpointManager(checkpoints).load(str(manifest.parent)), manifest)
    assert expected in str(caught.value)


def test_eval_reads_a_directory_holding_checkpoints_as_export_does(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, checkpoints = run_copy(trained, tmp_path)
    code = cli.main(["eval", "--config", str(config), "--checkpoint", str(checkpoints)])
    assert code == 0, capsys.readouterr().err
    line = cli_error(capsys, "eval", "--config", str(config), "--checkpoint", "nowhere/here")
    assert line.startswith("error: --checkpoint nowhere/here: no such checkpoint (give latest")


def test_eval_micro_batch_size_need_not_divide_the_training_batch(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The run's data.target_batch_size is 4; an eval micro-batch of 3 has nothing to do with it.
    config, _ = run_copy(trained, tmp_path, eval={"micro_batch_size": 3})
    code = cli.main(["eval", "--config", str(config), "--format", "json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["tokens"] == 3 * 16


# ---------------------------------------------------------------- token shards


@pytest.fixture(scope="module")
def shard_source_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level shard directory: 7 train shards of at most 2048 tokens."""
    root = tmp_path_factory.mktemp("shards")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 50}) + "\n" for i in range(40)))
    prepare([corpus], root / "out", shard_tokens=2048, workers=1, progress=False)
    return root / "out"


@pytest.fixture
def shards(shard_source_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "shards"
    shutil.copytree(shard_source_dir, copy)
    return copy


def first_shard(shards: Path) -> Path:
    return shards / "train" / "shard_00000.bin"


def shard_run(tmp_path: Path, shards: Path, **data: Any) -> Path:
    """A 1-step run of the tiny transformer (vocab 257) on ``shards``."""
    config = tiny_transformer_run(
        tmp_path / "run",
        run={"max_steps": 1},
        model={"vocab_size": 257},
        data={"shards": str(shards), **data},
        checkpoint={"interval": 0},
    )
    return write_config(tmp_path, config)


def test_a_fifo_as_index_json_is_one_error_not_a_hang(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (shards / "index.json").unlink()
    os.mkfifo(shards / "index.json")
    config = shard_run(tmp_path, shards)
    line = without_hanging(
        lambda: cli_error(capsys, "validate", "--config", str(config)), shards / "index.json"
    )
    assert line == (
        f"error: data.shards: cannot read {shards / 'index.json'}: not a regular file (a FIFO)"
    )


@pytest.mark.parametrize("kind", ["directory", "fifo", "device"])
def test_a_shard_that_is_not_a_regular_file_is_named(shards: Path, kind: str) -> None:
    shard = first_shard(shards)
    shard.unlink()
    index = json.loads((shards / "index.json").read_text())
    if kind == "directory":
        shard.mkdir()
        # Make the size check pass, as it did for a directory of exactly that many bytes.
        index["splits"]["train"]["shards"][0]["tokens"] = os.stat(shard).st_size // 2
        (shards / "index.json").write_text(json.dumps(index))
    elif kind == "fifo":
        os.mkfifo(shard)
    else:
        os.symlink("/dev/zero", shard)
    what = {"directory": "a directory", "fifo": "a FIFO", "device": "a character device"}[kind]
    with pytest.raises(DataError, match=f"shard {shard} is not a regular file \\({what}\\)"):
        check_shards(read_index(shards), "train", verify=True)


def overwrite_with(shard: Path, token: int) -> None:
    tokens = np.fromfile(shard, dtype="<u2")
    tokens[:] = token
    tokens.tofile(shard)


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "dataloader-worker"])
def test_token_ids_past_the_vocabulary_are_one_error_without_verify_shards(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], workers: int
) -> None:
    # Every shard: whichever window the shuffle reads first holds the bad id.
    for shard in sorted((shards / "train").iterdir()):
        overwrite_with(shard, 60_000)
    config = shard_run(tmp_path, shards, num_workers=workers)
    line = cli_error(capsys, "train", "--config", str(config))
    assert line.startswith(f"error: data.shards: shard {shards / 'train'}/shard_")
    assert "holds token id 60000 (token " in line
    assert "outside the vocabulary of 257 that index.json declares" in line


# ---------------------------------------------------------------- speedtronic data prepare


def test_a_fifo_input_is_refused_not_read(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("a real document\n")
    os.mkfifo(folder / "b.txt")
    for given in (folder / "b.txt", folder):
        with pytest.raises(DataError) as caught:
            without_hanging(
                lambda given=given: prepare([given], tmp_path / "out", workers=1, progress=False),
                folder / "b.txt",
            )
        assert str(caught.value) == (
            f"{folder / 'b.txt'}: cannot read: not a regular file (a FIFO); prepare reads "
            "regular files only"
        )


def test_a_device_given_as_input_is_refused(tmp_path: Path) -> None:
    os.symlink("/dev/zero", tmp_path / "zeros.txt")
    with pytest.raises(DataError, match=r"zeros\.txt: cannot read: not a regular file \(a char"):
        prepare([tmp_path / "zeros.txt"], tmp_path / "out", workers=1, progress=False)


def test_prepare_does_not_replace_someone_elses_index_json(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello world\n")
    out = tmp_path / "site"
    out.mkdir()
    theirs = '{"pages": ["index.html"]}\n'
    (out / "index.json").write_text(theirs)
    with pytest.raises(DataError, match=r"holds an index\.json that is not a token-shard index"):
        prepare([tmp_path / "a.txt"], out, workers=1, progress=False)
    assert (out / "index.json").read_text() == theirs
    assert sorted(p.name for p in out.iterdir()) == ["index.json"]
    # A damaged index (not JSON at all) is a prepare's own: it is replaced, as documented.
    (out / "index.json").write_text('{"format": "speedtronic-tok')
    prepare([tmp_path / "a.txt"], out, workers=1, progress=False)
    assert read_index(out).tokens("train") > 0


def test_a_file_where_a_split_folder_goes_keeps_the_previous_output(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(50)))
    out = tmp_path / "out"
    prepare([corpus], out, workers=1, progress=False)
    before = (out / "index.json").read_bytes()
    (out / "eval").write_text("not a folder")
    # The commit used to delete index.json, then fail creating eval/: the output was lost.
    with pytest.raises(DataError, match=r"eval exists and is not a directory"):
        prepare([corpus], out, workers=1, progress=False, eval_fraction=0.5)
    assert (out / "index.json").read_bytes() == before
    assert read_index(out).tokens("train") > 0


def test_prepare_into_a_path_under_a_file_names_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a.txt").write_text("hello\n")
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "shards"
    line = cli_error(capsys, "data", "prepare", str(tmp_path / "a.txt"), "--out", str(out))
    assert line == f"error: --out {out}: cannot create it: Not a directory"


# ---------------------------------------------------------------- generate and export


LOGITS = torch.tensor([0.5, 3.0, -1.0, 2.0])


@pytest.mark.parametrize(
    "options",
    [
        SamplingOptions(temperature=1e-300),
        SamplingOptions(temperature=1e-45),
        SamplingOptions(top_p=1e-300),
        SamplingOptions(top_k=1, top_p=1e-60, temperature=1e-200),
    ],
    ids=["temperature-1e-300", "temperature-1e-45", "top-p-1e-300", "all-three"],
)
def test_extreme_sampling_values_pick_the_likeliest_token(options: SamplingOptions) -> None:
    generator = torch.Generator().manual_seed(0)
    assert sample_next(LOGITS, options.validate(), generator) == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_logits_are_one_error(bad: float, temperature: float) -> None:
    logits = LOGITS.clone()
    logits[2] = bad
    with pytest.raises(SpeedtronicError, match=r"the model's logits are not finite"):
        sample_next(logits, SamplingOptions(temperature=temperature), torch.Generator())


class TinyLM(nn.Module):
    vocab_size = 16
    max_seq_len = 8

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(self.vocab_size, self.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table(input_ids)


@pytest.mark.parametrize("prompt", [[3, 16], [-1]])
def test_prompt_ids_outside_the_vocabulary_are_one_error(prompt: list[int]) -> None:
    with pytest.raises(DataError, match=rf"token id {prompt[-1]}, outside .* vocabulary of 16"):
        list(generate_tokens(TinyLM(), prompt, SamplingOptions(max_new_tokens=2)))


def test_a_seed_past_64_bits_names_the_flag(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = run_copy(trained, tmp_path)
    line = cli_error(capsys, "generate", "-c", str(config), "-p", "hi", "--seed", str(2**70))
    assert line == f"error: --seed: must fit in 64 bits, got {2**70}"


def test_a_prompt_of_undecodable_bytes_is_one_error(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = run_copy(trained, tmp_path)
    # What Python makes of the byte 0xff in argv under a UTF-8 locale.
    line = cli_error(capsys, "generate", "-c", str(config), "-p", "caf\udcff")
    assert line.startswith("error: the prompt is not valid UTF-8 text (character 3 is")


def test_generate_at_a_tiny_temperature_runs(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = run_copy(trained, tmp_path)
    args = ["generate", "-c", str(config), "-p", "hi", "--max-new-tokens", "3"]
    assert cli.main([*args, "--temperature", "1e-300"]) == 0, capsys.readouterr().err
    tiny = capsys.readouterr().out
    assert cli.main([*args, "--temperature", "0"]) == 0
    assert capsys.readouterr().out == tiny  # the same as greedy


def test_generate_cli_writes_past_the_context(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A context-16 model, a 2-character prompt: 40 new tokens only fit if the window slides.
    config, _ = run_copy(trained, tmp_path)
    args = ["generate", "-c", str(config), "-p", "hi", "--max-new-tokens", "40"]
    assert cli.main([*args, "--temperature", "0"]) == 0, capsys.readouterr().err
    cached = capsys.readouterr()
    assert cli.main([*args, "--temperature", "0", "--no-kv-cache"]) == 0
    recomputed = capsys.readouterr()
    assert cached.out == recomputed.out  # the rolled cache agrees with recomputing the window
    generated = cached.out[len("hi") : -1]  # byte-level: at most one character per token
    assert len(generated) > TINY_TRANSFORMER["max_seq_len"], generated
    assert "warning" not in cached.out.lower()  # warnings go to stderr, never into the text


def test_export_under_a_file_is_refused_before_loading(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = run_copy(trained, tmp_path)
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "export"
    line = cli_error(capsys, "export", "-c", str(config), "--out", str(out))
    assert line == f"error: --out {out}: {tmp_path / 'file'} is not a folder"


# ---------------------------------------------------------------- a Hugging Face config.json

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "vocab_size": 256,
    "max_position_embeddings": 16,
}


@pytest.fixture
def quiet_transformers() -> Any:
    """transformers' own warnings off: its log handler keeps the stderr of the test that first
    imported it (a closed capture in a later test, hence a "Logging error" traceback)."""
    transformers = pytest.importorskip("transformers")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


def hf_run(tmp_path: Path, hf_config: dict[str, Any], *, pretrained: bool) -> Path:
    pytest.importorskip("transformers")
    if pretrained:
        folder = tmp_path / "hf"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(hf_config))
        model: dict[str, Any] = {"name": "hf_causal_lm", "pretrained": str(folder)}
    else:
        model = {"name": "hf_causal_lm", "config": hf_config}
    config = {
        "run": {"device": "cpu", "max_steps": 1, "output_dir": str(tmp_path / "run")},
        "model": model,
        "data": {"micro_batch_size": 1},
    }
    return write_config(tmp_path, config)


@pytest.mark.usefixtures("quiet_transformers")
@pytest.mark.parametrize("pretrained", [True, False], ids=["pretrained", "config"])
def test_a_config_too_big_for_memory_is_refused_before_allocating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pretrained: bool
) -> None:
    config = hf_run(tmp_path, {**TINY_LLAMA, "vocab_size": 10**13}, pretrained=pretrained)
    line = cli_error(capsys, "train", "--config", str(config))
    where = "model.pretrained" if pretrained else "model.config"
    assert line.startswith(f"error: {where}: ")
    assert re.search(
        r"describes a model of [\d,]+ parameters \([\d,.]+ GiB of fp32 weights\), more than "
        r"this machine's memory \([\d,.]+ GiB\)$",
        line,
    ), line


@pytest.mark.usefixtures("quiet_transformers")
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("vocab_size", -5, "cannot build a model from .*negative dimension -5"),
        ("hidden_size", "lots", "Validation error for field 'hidden_size'"),
    ],
)
@pytest.mark.parametrize("pretrained", [True, False], ids=["pretrained", "config"])
def test_hostile_hf_config_values_are_one_config_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    field: str,
    value: Any,
    message: str,
    pretrained: bool,
) -> None:
    config = hf_run(tmp_path, {**TINY_LLAMA, field: value}, pretrained=pretrained)
    line = cli_error(capsys, "validate", "--config", str(config))
    assert line.startswith("error: model.pretrained: " if pretrained else "error: model.config: ")
    assert re.search(message, line), line


@pytest.mark.usefixtures("quiet_transformers")
def test_validate_checks_a_pretrained_folder_without_loading_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It used to call from_pretrained on the meta device, which transformers refuses.
    config = hf_run(tmp_path, TINY_LLAMA, pretrained=True)
    assert cli.main(["validate", "--config", str(config), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == "hf_causal_lm"


@pytest.mark.usefixtures("quiet_transformers")
def test_a_fifo_as_hf_config_json_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = hf_run(tmp_path, TINY_LLAMA, pretrained=True)
    (tmp_path / "hf" / "config.json").unlink()
    os.mkfifo(tmp_path / "hf" / "config.json")
    line = without_hanging(
        lambda: cli_error(capsys, "validate", "--config", str(config)),
        tmp_path / "hf" / "config.json",
    )
    assert line == (
        f"error: model.pretrained: cannot read {tmp_path / 'hf' / 'config.json'}: not a regular "
        "file (a FIFO)"
    )


# ---------------------------------------------------------------- config sections


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
        ("def broken(:\n", "SyntaxError: "),
    ],
    ids=["raises", "syntax-error"],
)
def test_a_dataset_module_that_fails_on_import_is_one_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    source: str,
    problem: str,
) -> None:
    name = f"hostile_dataset_{abs(hash(source))}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(
        tmp_path, tiny_transformer_run(tmp_path / "run", data={"dataset": f"{name}:build"})
    )
    line = cli_error(capsys, "validate", "--config", str(config))
    assert line.startswith(
        f"error: data.dataset: importing '{name}' for '{name}:build' failed ({problem}"
    )


def test_a_dataset_factory_refusing_its_args_is_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "picky_dataset.py").write_text(
        "def build(size=1):\n    raise ValueError(f'size must be even, got {size}')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tiny_transformer_run(
        tmp_path / "run",
        run={"max_steps": 1},
        data={"dataset": "picky_dataset:build", "dataset_args": {"size": 3}},
    )
    line = cli_error(capsys, "train", "--config", str(write_config(tmp_path, config)))
    assert line == (
        "error: data.dataset_args: calling picky_dataset:build failed (ValueError: size must "
        "be even, got 3)"
    )


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ({"RANK": "5"}, "RANK is 5, outside 0 .. WORLD_SIZE - 1 = 1: launch with torchrun"),
        ({"RANK": "0"}, "WORLD_SIZE is set but MASTER_ADDR and MASTER_PORT are not: launch"),
    ],
    ids=["rank-past-world-size", "no-master-address"],
)
def test_a_half_set_launcher_environment_is_one_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    environment: dict[str, str],
    message: str,
) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    config = tiny_transformer_run(tmp_path, run={"max_steps": 1}, parallel={"strategy": "ddp"})
    line = cli_error(capsys, "train", "--config", str(write_config(tmp_path, config)))
    assert line.startswith(f"error: {message}")


# ---------------------------------------------------------------- model.init_from folders

LLAMA_FOR_TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
    "vocab_size": 256,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
DEEP_JSON = "[" * 30_000 + "]" * 30_000


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"config.json": None}, r"config\.json: not a regular file \(a FIFO\)$"),
        ({"config.json": DEEP_JSON}, r"config\.json: maximum recursion depth exceeded"),
        (
            {"config.json": json.dumps(LLAMA_FOR_TINY), "model.safetensors.index.json": DEEP_JSON},
            r"index\.json: maximum recursion depth exceeded",
        ),
        (
            {
                "config.json": json.dumps(LLAMA_FOR_TINY),
                "model.safetensors.index.json": json.dumps({"weight_map": {"x": "part.bin"}}),
                "part.bin": None,
            },
            r"part\.bin is not a regular file \(a FIFO\)$",
        ),
    ],
    ids=["config-fifo", "config-deep", "index-deep", "weights-fifo"],
)
def test_a_hostile_init_from_folder_is_one_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], files: dict[str, str | None], message: str
) -> None:
    folder = tmp_path / "llama"
    folder.mkdir()
    fifos = []
    for name, text in files.items():
        if text is None:
            os.mkfifo(folder / name)
            fifos.append(folder / name)
        else:
            (folder / name).write_text(text)
    config = tiny_transformer_run(tmp_path / "run", model={"init_from": str(folder)})
    path = write_config(tmp_path, config)
    line = without_hanging(lambda: cli_error(capsys, "validate", "--config", str(path)), *fifos)
    assert line.startswith(f"error: model.init_from: cannot read {folder}/") or (
        line.startswith(f"error: model.init_from: {folder}/")
    ), line
    assert re.search(message, line), line


def test_a_model_too_big_to_allocate_is_one_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 10**14 x 32 fp32 weights: beyond any address space, so the allocation fails at once.
    config = tiny_transformer_run(tmp_path, run={"max_steps": 1}, model={"vocab_size": 10**14})
    line = cli_error(capsys, "train", "--config", str(write_config(tmp_path, config)))
    assert line.startswith(
        "error: model: building model 'reference_transformer' needs more memory than there is"
    )


def poison_weights(checkpoint: Path) -> None:
    """Make every float weight of ``checkpoint`` NaN, with a manifest that still verifies (a
    diverged run saves exactly that)."""
    from safetensors.torch import load_file, save_file

    tensors_file = checkpoint / "tensors.safetensors"
    tensors = {
        name: torch.full_like(t, float("nan")) if t.is_floating_point() else t
        for name, t in load_file(str(tensors_file)).items()
    }
    save_file(tensors, str(tensors_file), metadata={"format": "1"})
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["tensors.safetensors"] = manifest_entry(tensors_file, HASH_CHUNK_BYTES)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_eval_json_of_a_diverged_checkpoint_writes_null_not_a_traceback(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, checkpoints = run_copy(trained, tmp_path)
    poison_weights(checkpoints / checkpoint_name(4))
    code = cli.main(["eval", "--config", str(config), "--format", "json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    record = json.loads(captured.out)
    assert record["loss"] is None and record["ppl"] is None and record["tokens"] == 32


def test_generate_from_a_diverged_checkpoint_is_one_error(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, checkpoints = run_copy(trained, tmp_path)
    poison_weights(checkpoints / checkpoint_name(4))
    line = cli_error(capsys, "generate", "-c", str(config), "-p", "hi")
    assert line.startswith(f"error: checkpoint {checkpoints / checkpoint_name(4)} holds NaN")
    assert "use an earlier checkpoint (--checkpoint PATH)" in line


def test_a_bad_eval_text_path_is_named_as_eval_not_data(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tiny.txt").write_text("abc")
    config, _ = run_copy(trained, tmp_path, eval={"text_path": str(tmp_path / "tiny.txt")})
    line = cli_error(capsys, "eval", "--config", str(config))
    assert line == (
        f"error: eval.text_path: {tmp_path / 'tiny.txt'} has 3 bytes, fewer than one block of "
        "seq_len + 1 = 17"
    )


def test_bad_eval_shards_are_named_as_eval_shards(
    trained: Path, shard_source_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The byte-level shards have 257 ids; the trained model's vocabulary is 256.
    config, _ = run_copy(trained, tmp_path, eval={"shards": str(shard_source_dir)})
    line = cli_error(capsys, "eval", "--config", str(config))
    # These shards also lack an eval split, which is found first (before the model is built).
    assert line.startswith(f"error: eval.shards: {shard_source_dir} has no eval split")
