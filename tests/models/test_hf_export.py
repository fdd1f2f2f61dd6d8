"""``speedtronic export --format hf`` and ``init_from``: a trained reference model goes to the
Hugging Face Llama format and back, checked against real ``transformers``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from core.plugin_fixtures import plugin_env, run_cli, user_error_line
from models.hf_fixtures import TINY_REFERENCE, run_config, run_dict
from safetensors import safe_open

import speedtronic
from speedtronic import ConfigError, cli
from speedtronic.generation import SamplingOptions, generate_tokens
from speedtronic.inference import load_trained_model
from speedtronic.inference.export import ExportError, byte_level_tokenizer_json, export_run
from speedtronic.runtime import train_from_config
from speedtronic_models.export import write_llama

transformers = pytest.importorskip("transformers")

GREEDY = SamplingOptions(max_new_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """A reference model trained 4 steps (checkpoints at 2 and 4), exported to ``hf/``."""
    root = tmp_path_factory.mktemp("export")
    config = run_config(root / "run", TINY_REFERENCE)
    train_from_config(config, console=False)
    export_run(config, root / "hf")
    (root / "run.json").write_text(json.dumps(run_dict(root / "run", TINY_REFERENCE)))
    return config, root


def hf_load(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def sharpened(seed: int = 0, **overrides):
    """An untrained reference model with large weights, so greedy choices vary."""
    torch.manual_seed(seed)
    model = speedtronic.build_model(**{**TINY_REFERENCE, **overrides})
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.3)
    return model.eval()


def test_the_folder_is_a_plain_llama(trained) -> None:
    _, root = trained
    folder = root / "hf"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert {
        key: config[key]
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "num_hidden_layers",
            "rms_norm_eps",
            "rope_theta",
            "max_position_embeddings",
            "vocab_size",
            "tie_word_embeddings",
            "torch_dtype",
        )
    } == {
        "hidden_size": 32,
        "intermediate_size": 128,  # 8/3 * 32 rounded up to a multiple of 64
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500_000.0,
        "max_position_embeddings": 32,
        "vocab_size": 260,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert handle.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [16, 32]
    assert "lm_head.weight" not in names  # tied: the head is the embedding
    assert "model.layers.1.mlp.gate_proj.weight" in names and len(names) == 2 + 2 * 9
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] is None
    assert "step 4" in (folder / "README.md").read_text()
    assert oct(folder.stat().st_mode & 0o777) == "0o755"


@pytest.mark.parametrize("n_kv_head", [2, 4, 1])
def test_transformers_computes_our_logits(tmp_path: Path, trained, n_kv_head: int) -> None:
    """GQA (2 and 1 KV heads), plain multi-head attention, tied embeddings, rope_theta."""
    if n_kv_head == 2:  # the trained, exported model itself
        config, root = trained
        ours, folder = load_trained_model(config).model, root / "hf"
    else:
        ours, folder = sharpened(n_kv_head=n_kv_head), tmp_path
        write_llama(ours, folder)
    theirs = hf_load(folder)
    ids = torch.randint(0, 260, (3, 32), generator=torch.Generator().manual_seed(n_kv_head))
    with torch.no_grad():
        difference = (ours(ids)["logits"] - theirs(ids).logits).abs().max().item()
    assert difference <= 1e-4
    assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()


def test_init_from_loads_the_export_back_exactly(trained) -> None:
    config, root = trained
    expected = load_trained_model(config).model.state_dict()
    model = speedtronic.build_model(**TINY_REFERENCE, init_from=str(root / "hf"))
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_init_from_lists_everything_that_does_not_fit(tmp_path: Path, trained) -> None:
    _, root = trained
    folder = tmp_path / "other"
    folder.mkdir()
    config = json.loads((root / "hf" / "config.json").read_text())
    config.update(num_attention_heads=8, num_key_value_heads=8, vocab_size=300)
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as caught:
        speedtronic.build_model(**TINY_REFERENCE, init_from=str(folder))
    message = str(caught.value)
    assert caught.value.path == "model.init_from"
    for part in (
        "num_attention_heads 8 != model.n_head 4",
        "num_key_value_heads 8 != model.n_kv_head 2",
        "vocab_size 300 != model.vocab_size 260",
        "tie_word_embeddings is not true (an untied lm_head",
    ):
        assert part in message, message
    with pytest.raises(ConfigError, match="never downloads"):
        speedtronic.build_model(**TINY_REFERENCE, init_from="meta-llama/Llama-3.2-1B")
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        speedtronic.build_model(**TINY_REFERENCE, init_from=str(tmp_path))


def test_init_from_checks_the_tensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    write_llama(sharpened(), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = torch.ones(33)
    tensors["lm_head.weight"] = torch.zeros(260, 32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError) as caught:
        speedtronic.build_model(**TINY_REFERENCE, init_from=str(tmp_path))
    assert "missing tensors model.layers.1.mlp.up_proj.weight" in str(caught.value)
    assert "model.norm.weight has shape [33], expected [32]" in str(caught.value)
    tensors["model.norm.weight"] = torch.ones(32)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"lm_head\.weight differs from the embedding"):
        speedtronic.build_model(**TINY_REFERENCE, init_from=str(tmp_path))


def test_transformers_generate_equals_ours(tmp_path: Path) -> None:
    ours = sharpened(seed=5)
    write_llama(ours, tmp_path)
    theirs = hf_load(tmp_path)
    prompt = [72, 101, 108, 108, 111]
    mine = list(generate_tokens(ours, prompt, GREEDY))
    generated = theirs.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    assert generated[0, len(prompt) :].tolist() == mine
    assert len(set(mine)) > 3


def test_bf16_export(tmp_path: Path, trained) -> None:
    config, _ = trained
    result = export_run(config, tmp_path / "bf16", dtype="bf16")
    assert result.dtype == "bfloat16"
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    theirs = hf_load(tmp_path / "bf16")
    assert theirs.model.embed_tokens.weight.dtype == torch.bfloat16


def test_the_byte_level_tokenizer_reads_text_as_bytes(trained) -> None:
    _, root = trained
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "hf")
    text = "héllo wörld\n\t€ 🙂"
    assert tokenizer.encode(text) == list(text.encode("utf-8"))
    assert tokenizer.decode(list(text.encode("utf-8"))) == text
    with_eos = byte_level_tokenizer_json(eos_id=256)
    assert with_eos["added_tokens"][0]["id"] == 256


def test_export_refuses_a_non_empty_folder_and_is_atomic(tmp_path: Path, trained) -> None:
    config, _ = trained
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(ExportError, match="is not empty; pass --force"):
        export_run(config, out)
    assert (out / "mine.txt").read_text() == "keep me"
    # A failing export (the checkpoint does not fit) leaves the folder and no staging behind.
    wrong = config.with_overrides(["model.d_model=64"])
    with pytest.raises(speedtronic.CheckpointError, match="does not fit"):
        export_run(wrong, out, force=True)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    export_run(config, out, force=True)
    assert not (out / "mine.txt").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_cli_errors_are_one_line(trained, tmp_path: Path, capsys) -> None:
    _, root = trained
    base = ["--config", str(root / "run.json")]
    cases = [
        (["export", *base, "--checkpoint", "best", "--out", str(tmp_path / "x")], "best"),
        (["export", *base, "--global", "--out", str(tmp_path / "x")], "--global: no plugin"),
        (["generate", *base, "--prompt", "hi", "--temperature", "-1"], "--temperature"),
        (["generate", *base, "--prompt", "hi", "--checkpoint", "/no/such"], "no such checkpoint"),
    ]
    for argv, expected in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and expected in err[-1], err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_export_and_generate_as_real_commands(trained, tmp_path: Path) -> None:
    config, root = trained
    config_file = root / "run.json"
    env = plugin_env(load="speedtronic-models")
    out = tmp_path / "exported"
    done = run_cli("export", "-c", str(config_file), "--out", str(out), env=env)
    assert done.returncode == 0, done.stderr
    assert f"to {out}" in done.stdout and (out / "model.safetensors").exists()
    again = run_cli("export", "-c", str(config_file), "--out", str(out), env=env)
    assert "is not empty; pass --force" in user_error_line(again)

    args = ["generate", "-c", str(config_file), "--prompt", "Hi", "--max-new-tokens", "8"]
    first = run_cli(*args, "--seed", "3", "--top-k", "50", env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("Hi") and first.stdout.endswith("\n")
    assert run_cli(*args, "--seed", "3", "--top-k", "50", env=env).stdout == first.stdout

    # The text is what the model samples, decoded as bytes.
    ours = load_trained_model(config).model
    options = SamplingOptions(max_new_tokens=8, top_k=50, seed=3)
    ids = list(generate_tokens(ours, list(b"Hi"), options))
    expected = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    assert first.stdout == "Hi" + expected + "\n"


def test_the_runs_tokenizer_json_goes_with_the_export(tmp_path: Path, caplog) -> None:
    """Token shards prepared with a tokenizer.json: the export carries it (found next to the
    shards' index.json), or says it is missing; generate decodes with it."""
    from speedtronic.data import prepare
    from speedtronic.inference import run_tokenizer

    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer_file.write_text(json.dumps(byte_level_tokenizer_json(eos_id=256)))
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(f"line {i}: the quick brown fox" for i in range(100)))
    shards = tmp_path / "shards"
    prepare([docs], shards, tokenizer=tokenizer_file, workers=1, progress=False)
    config = run_config(
        tmp_path / "run", TINY_REFERENCE, run={"max_steps": 2}, data={"shards": str(shards)}
    )
    train_from_config(config, console=False)

    with caplog.at_level("WARNING", logger="speedtronic"):
        result = export_run(config, tmp_path / "without")
    assert "is not in" in result.tokenizer and "is not in" in caplog.text
    assert not (tmp_path / "without" / "tokenizer.json").exists()
    assert "tokenizer.json" in (tmp_path / "without" / "README.md").read_text()
    with pytest.raises(speedtronic.DataError, match="give it with --tokenizer PATH"):
        run_tokenizer(config).codec()
    explicit = run_tokenizer(config, str(tokenizer_file))
    assert explicit.eos_id == 256 and explicit.codec().encode("fox") == list(b"fox")

    (shards / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    export_run(config, tmp_path / "with")
    folder = tmp_path / "with"
    assert (folder / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 256
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 256
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token_id == 256 and tokenizer.encode("fox") == list(b"fox")


def test_init_from_on_the_meta_device_checks_shapes_only(tmp_path: Path, trained) -> None:
    _, root = trained
    with torch.device("meta"):
        model = speedtronic.build_model(**TINY_REFERENCE, init_from=str(root / "hf"))
        assert model.tok_emb.weight.is_meta
        with pytest.raises(ConfigError, match="n_layer"):
            speedtronic.build_model(**{**TINY_REFERENCE, "n_layer": 3}, init_from=str(root / "hf"))
