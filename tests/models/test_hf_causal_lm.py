"""The ``hf_causal_lm`` model: real ``transformers`` models (a tiny Llama and a tiny GPT-2)
trained by the real trainer, with the engine's features, checkpoints and exact resume."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from models.hf_fixtures import TINY_GPT2, TINY_LLAMA, hf_model, run_config

import speedtronic
from speedtronic import ConfigError, hookimpl, plugins
from speedtronic.checkpoint import CheckpointManager
from speedtronic.generation import SamplingOptions, generate_tokens
from speedtronic.runtime import build_runtime, train_from_config

transformers = pytest.importorskip("transformers")
from speedtronic_models.hf import is_checkpointing  # noqa: E402  (after the skip)

ARCHITECTURES = {"llama": TINY_LLAMA, "gpt2": TINY_GPT2}


def final_model_state(output_dir: Path) -> dict[str, torch.Tensor]:
    loaded = CheckpointManager(Path(output_dir) / "checkpoints").load_latest()
    assert loaded is not None
    return loaded.state["model"]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_loss_decreases_on_the_synthetic_stream(tmp_path: Path, arch: str) -> None:
    config = run_config(
        tmp_path,
        hf_model(ARCHITECTURES[arch]),
        run={"max_steps": 30},
        checkpoint={"interval": 0},
        logging={"log_every": 10},
    )
    losses: list[float] = []

    def record(event: str, payload: dict) -> None:
        if event == "step":
            losses.append(payload["loss"])

    runtime = build_runtime(config, hooks=[record], console=False)
    assert isinstance(runtime.model, transformers.PreTrainedModel)
    assert (runtime.model.max_seq_len, runtime.model.vocab_size) == (16, 64)
    assert runtime.trainer.label_mode == "inputs"  # a PreTrainedModel shifts labels itself
    result = runtime.trainer.fit()
    assert result.steps == 30 and len(losses) == 3
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_trainer_sees_the_models_own_loss_on_the_same_text(tmp_path: Path, arch: str) -> None:
    """No target skipped or doubled: the first step's loss equals the cross-entropy of each
    token's logits against the token after it, over every position of the text."""
    config = run_config(tmp_path, hf_model(ARCHITECTURES[arch]), run={"max_steps": 1})
    runtime = build_runtime(config, console=False)
    model = runtime.model
    batch = next(runtime.data.iterate(0))
    ids = batch["input_ids"]
    # The stream's labels are the next tokens: the HF model must get the text itself.
    assert torch.equal(batch["labels"][:, :-1], ids[:, 1:])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        by_hand = F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
        own = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(own, by_hand)
    result = runtime.trainer.fit()
    assert result.final_loss == pytest.approx(by_hand.item(), rel=1e-5)

    # Shifted labels given to a model that shifts again skip a target: position t would be
    # scored against token t + 2.
    shifted = run_config(tmp_path / "shifted", hf_model(ARCHITECTURES[arch]), run={"max_steps": 1})
    shifted.data.labels = "shifted"
    skipped = F.cross_entropy(logits[:, :-1].reshape(-1, 64), batch["labels"][:, 1:].reshape(-1))
    wrong = train_from_config(shifted, console=False).final_loss
    assert wrong == pytest.approx(skipped.item(), rel=1e-5) and wrong != pytest.approx(
        by_hand.item(), rel=1e-3
    )


class CrashAtStep3:
    @hookimpl
    def after_optimizer_step(self, step: int) -> None:
        if step == 3:
            raise RuntimeError("power cut")


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    model = hf_model({**TINY_LLAMA, "attention_dropout": 0.1})  # the RNG must resume too
    train_from_config(run_config(tmp_path / "straight", model), console=False)
    interrupted = run_config(tmp_path / "resumed", model)
    name = plugins.register(CrashAtStep3(), name="models-test-crash")
    try:
        with pytest.raises(RuntimeError, match="power cut"):
            train_from_config(interrupted, console=False)  # checkpointed at step 2
    finally:
        plugins.unregister(name)
    again = run_config(tmp_path / "resumed", model, checkpoint={"resume": True})
    result = train_from_config(again, console=False)
    assert result.resumed_from == 2 and result.steps == 4
    expected = final_model_state(tmp_path / "straight")
    resumed = final_model_state(tmp_path / "resumed")
    assert expected.keys() == resumed.keys()
    assert "model.layers.0.self_attn.q_proj.weight" in expected  # Hugging Face names
    for name, tensor in expected.items():
        assert torch.equal(resumed[name], tensor), name


def test_accumulation_equals_one_big_batch(tmp_path: Path) -> None:
    big = run_config(tmp_path / "big", hf_model(TINY_LLAMA), run={"max_steps": 1})
    big.data.micro_batch_size = 8
    accumulated = run_config(tmp_path / "acc", hf_model(TINY_LLAMA), run={"max_steps": 1})
    accumulated.data.target_batch_size = 8
    accumulated.validate()
    train_from_config(big, console=False)
    train_from_config(accumulated, console=False)
    one, two = final_model_state(tmp_path / "big"), final_model_state(tmp_path / "acc")
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_gradient_checkpointing_goes_through_gradient_checkpointing_enable(
    tmp_path: Path,
) -> None:
    config = run_config(tmp_path, hf_model(TINY_LLAMA), gradient_checkpointing=True)
    runtime = build_runtime(config, console=False)
    model = runtime.model
    assert is_checkpointing(model)
    ids = next(runtime.data.iterate(0))["input_ids"]
    model.train()

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    recomputed = gradients()
    model.set_gradient_checkpointing(False)
    assert not is_checkpointing(model)
    plain = gradients()
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    runtime.metrics.close()


def test_compile_and_bf16_autocast_train(tmp_path: Path) -> None:
    config = run_config(
        tmp_path,
        hf_model(TINY_LLAMA),
        run={"max_steps": 2},
        compile={"enabled": True, "backend": "eager"},
        precision={"mode": "bf16"},
        checkpoint={"interval": 0},
    )
    runtime = build_runtime(config, console=False)
    result = runtime.trainer.fit()
    assert result.steps == 2 and result.final_loss is not None
    assert result.final_loss == result.final_loss  # finite, not NaN
    assert runtime.trainer.compiled.active  # no fallback to eager


def test_pretrained_loads_a_local_folder(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**TINY_LLAMA)
    saved = transformers.AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(tmp_path / "tiny")
    model = speedtronic.build_model(
        "hf_causal_lm", pretrained=str(tmp_path / "tiny"), config={"attention_dropout": 0.25}
    )
    assert model.config.attention_dropout == 0.25 and model.max_seq_len == 16
    for name, tensor in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    ("params", "path", "message"),
    [
        ({"pretrained": "meta-llama/Llama-3.2-1B"}, "model.pretrained", "Hub id, not a local"),
        ({"pretrained": "/no/such/folder"}, "model.pretrained", "never downloads"),
        ({}, "model", "needs `config:"),
        ({"pretrained": "."}, "model.pretrained", "not a transformers model folder"),
        ({"config": {"hidden_size": 8}}, "model.config.model_type", "required"),
        ({"config": {"model_type": "lama"}}, "model.config.model_type", "did you mean 'llama'"),
        (
            {"config": {**TINY_LLAMA, "hidden_sise": 8}},
            "model.config.hidden_sise",
            "did you mean 'hidden_size'",
        ),
        ({"confg": {}}, "model.confg", "did you mean 'config'"),
    ],
)
def test_bad_params_are_one_config_error(params: dict, path: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        speedtronic.build_model("hf_causal_lm", **params)
    assert caught.value.path == path and message in str(caught.value)


def test_a_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(ConfigError, match=r"pip install 'speedtronic-models\[transformers\]'"):
        speedtronic.build_model("hf_causal_lm", config=TINY_LLAMA)


def test_export_uses_save_pretrained(tmp_path: Path) -> None:
    from speedtronic.inference.export import export_run

    config = run_config(tmp_path / "run", hf_model(TINY_GPT2), run={"max_steps": 2})
    train_from_config(config, console=False)
    result = export_run(config, tmp_path / "out")
    assert result.description == "GPT2LMHeadModel"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.config.use_cache  # training ran without a cache; the export has it back
    expected = final_model_state(tmp_path / "run")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_generation_with_the_transformers_cache_equals_recomputation(arch: str) -> None:
    torch.manual_seed(1)
    model = speedtronic.build_model("hf_causal_lm", config=ARCHITECTURES[arch])
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.3)
    options = SamplingOptions(max_new_tokens=10, temperature=0)
    cached = list(generate_tokens(model, [5, 9, 2], options))
    assert cached == list(generate_tokens(model, [5, 9, 2], options, use_cache=False))
    assert len(set(cached)) > 2
