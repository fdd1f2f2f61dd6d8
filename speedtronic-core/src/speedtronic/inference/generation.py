"""Sampling text from a causal language model: ``speedtronic generate`` and its Python API.

Any model whose ``forward(input_ids)`` returns logits ``[B, T, V]`` (a tensor, a mapping or
an output object with ``logits``) can be sampled from. A model that also offers the
incremental-decoding protocol is sampled with a KV cache:

``model.start_decoding() -> step`` where ``step(input_ids [B, T]) -> logits [B, T, V]`` takes
the tokens that follow everything it was given before and keeps its cache between calls.

The reference transformer implements it with its own KV cache and the ``hf_causal_lm`` model
with the ``transformers`` cache; any other model is sampled by running the whole sequence
again for every token (same tokens, slower).

Each token is chosen on the CPU from fp32 logits: greedy when ``temperature`` is 0, else
softmax sampling at that temperature after the ``top_k`` and ``top_p`` (nucleus) filters, with
a ``torch.Generator`` seeded by ``seed``, so the same seed gives the same text.
"""

from __future__ import annotations

import codecs
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speedtronic.errors import ConfigError, DataError, SpeedtronicError

__all__ = [
    "ByteCodec",
    "SamplingOptions",
    "TextCodec",
    "TokenizerCodec",
    "context_window",
    "generate_text",
    "generate_tokens",
    "logits_of",
    "sample_next",
]

log = logging.getLogger("speedtronic.generation")


@dataclass(frozen=True)
class SamplingOptions:
    """How to pick tokens; :meth:`validate` names the offending flag."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def validate(self) -> SamplingOptions:
        """Return ``self``, or raise :class:`ConfigError` for an option out of range."""
        if self.max_new_tokens < 1:
            raise ConfigError(f"must be >= 1, got {self.max_new_tokens}", "--max-new-tokens")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(
                f"must be a finite number >= 0 (0 = greedy), got {self.temperature}",
                "--temperature",
            )
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"must be >= 1, got {self.top_k}", "--top-k")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"must be in (0, 1], got {self.top_p}", "--top-p")
        if not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise ConfigError(f"must fit in 64 bits, got {self.seed}", "--seed")
        return self


def sample_next(logits: torch.Tensor, options: SamplingOptions, generator: torch.Generator) -> int:
    """The next token from one position's logits ``[V]``."""
    logits = logits.detach().float().cpu()
    if torch.isnan(logits).any() or torch.isposinf(logits).any() or torch.isneginf(logits).all():
        raise SpeedtronicError(
            "the model's logits are not finite (NaN or inf): its weights are damaged or the run "
            "diverged; sample from an earlier checkpoint (--checkpoint PATH)"
        )
    if options.temperature == 0:
        return int(torch.argmax(logits))
    # The largest logit becomes 0 first, so a tiny temperature sends the others to -inf rather
    # than every logit to +-inf (whose softmax is NaN); below float32's smallest normal number
    # the temperature would round to 0 in the division.
    temperature = max(options.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.max()) / temperature
    if options.top_k is not None and options.top_k < logits.numel():
        kth = torch.topk(logits, options.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if options.top_p is not None and options.top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the most likely token always).
        drop = torch.cumsum(probs, dim=-1) - probs >= options.top_p
        drop[0] = False  # a top_p below float32's smallest number would drop them all
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def logits_of(output: Any) -> torch.Tensor:
    """The ``[B, T, V]`` logits in a model's output (tensor, mapping, object, or tuple)."""
    if isinstance(output, torch.Tensor) and output.dim() == 3:
        return output
    if isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    first = output[0] if isinstance(output, (tuple, list)) and output else None
    if isinstance(first, torch.Tensor) and first.dim() == 3:
        return first
    raise SpeedtronicError(
        f"the model returned {type(output).__name__} without logits; generation needs "
        "forward(input_ids) to return logits [batch, seq, vocab] (a tensor or {'logits': ...})"
    )


def _device_of(model: Any) -> torch.device:
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


def context_window(max_len: int) -> int:
    """How many of the latest tokens a full context keeps when the text outgrows a model's
    ``max_seq_len``: three quarters of it, so the KV cache is rebuilt once every quarter
    context rather than for every token."""
    return max(1, max_len - max(1, max_len // 4))


def generate_tokens(
    model: Any,
    prompt_ids: Sequence[int],
    options: SamplingOptions = SamplingOptions(),
    *,
    eos_id: int | None = None,
    use_cache: bool = True,
) -> Iterator[int]:
    """Yield up to ``options.max_new_tokens`` new token ids after ``prompt_ids``, one at a time,
    stopping after ``eos_id``. Puts ``model`` in eval mode.

    With ``use_cache`` (and a model offering ``start_decoding``) each step feeds only the new
    token; otherwise the whole context is run again. A model with ``max_seq_len`` sees a
    sliding window once the text outgrows it: the context is cropped to its latest
    :func:`context_window` tokens and the KV cache rebuilt from them (the same windows with and
    without the cache, so both give the same tokens). The prompt is checked and any warning
    about the window logged when this is called, before the first token.
    """
    options.validate()
    prompt = [int(token) for token in prompt_ids]
    if not prompt:
        raise DataError("the prompt is empty: give at least one token")
    vocab = getattr(model, "vocab_size", None)
    if isinstance(vocab, int) and not 0 <= min(prompt) <= max(prompt) < vocab:
        outside = next(token for token in prompt if not 0 <= token < vocab)
        raise DataError(
            f"the prompt holds token id {outside}, outside the model's vocabulary of {vocab} "
            "ids: encode it with the run's tokenizer (--tokenizer)"
        )
    max_len = getattr(model, "max_seq_len", None)
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        max_len = None
    if max_len is not None and len(prompt) > max_len:
        log.warning(
            "the prompt has %d tokens, more than the model's context of %d (max_seq_len): "
            "the model sees its last %d",
            len(prompt),
            max_len,
            max_len,
        )
    elif max_len is not None and len(prompt) + options.max_new_tokens > max_len:
        log.warning(
            "the prompt (%d tokens) and %d new tokens outgrow the model's context of %d "
            "(max_seq_len): past it the model sees a sliding window of its latest %d-%d tokens",
            len(prompt),
            options.max_new_tokens,
            max_len,
            context_window(max_len),
            max_len,
        )
    model.eval()
    start = getattr(model, "start_decoding", None)
    incremental = use_cache and callable(start)

    def recompute() -> Callable[[torch.Tensor], torch.Tensor]:
        def step(ids: torch.Tensor) -> torch.Tensor:
            try:
                output = model(ids)
            except TypeError as exc:
                raise SpeedtronicError(
                    f"cannot call {type(model).__name__}(input_ids) to generate: {exc}"
                ) from None
            return logits_of(output)

        return step

    return _sample(
        start if incremental else recompute,
        prompt,
        options,
        eos_id,
        _device_of(model),
        incremental,
        max_len,
    )


def _sample(
    new_step: Callable[[], Callable[[torch.Tensor], torch.Tensor]],
    prompt: list[int],
    options: SamplingOptions,
    eos_id: int | None,
    device: torch.device,
    incremental: bool,
    max_len: int | None,
) -> Iterator[int]:
    """The sampling loop; ``ids[first:]`` is the context the model sees."""
    generator = torch.Generator().manual_seed(options.seed)

    def run(step: Callable[[torch.Tensor], torch.Tensor], tokens: list[int]) -> torch.Tensor:
        return step(torch.tensor([tokens], dtype=torch.long, device=device))[0, -1]

    with torch.no_grad():
        ids = list(prompt)
        first = 0 if max_len is None else max(0, len(ids) - max_len)
        step = new_step()
        logits = run(step, ids[first:])
        for produced in range(1, options.max_new_tokens + 1):
            token = sample_next(logits, options, generator)
            yield token
            if token == eos_id or produced == options.max_new_tokens:
                return
            ids.append(token)
            if max_len is not None and len(ids) - first > max_len:
                first = len(ids) - context_window(max_len)
                if incremental:
                    step = new_step()  # a fresh cache, filled from the cropped context
                logits = run(step, ids[first:])
            elif incremental:
                logits = run(step, [token])
            else:
                logits = run(step, ids[first:])


# ---------------------------------------------------------------- text


class TextCodec:
    """Prompt text to ids, and sampled ids back to text piece by piece (for streaming)."""

    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``."""
        raise NotImplementedError

    def decoder(self) -> Callable[[int | None], str]:
        """A fresh streaming decoder: call it with each new id for the text that id completes
        (``""`` while a character is incomplete), and with ``None`` at the end for the rest."""
        raise NotImplementedError


def _utf8(text: str) -> bytes:
    """``text`` as UTF-8; a :class:`DataError` for a lone surrogate (what Python makes of bytes
    on the command line that are not UTF-8)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"the prompt is not valid UTF-8 text (character {exc.start} is "
            f"{text[exc.start]!r}, from bytes that are not UTF-8?)"
        ) from None


class ByteCodec(TextCodec):
    """UTF-8 bytes as ids 0-255 (core's byte-level text tokenizer). Ids above 255 (an EOS, or a
    synthetic vocabulary's extra ids) decode to nothing."""

    def __init__(self, vocab_size: int | None = None, eos_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        ids = list(_utf8(text))
        if self.vocab_size is not None and ids and max(ids) >= self.vocab_size:
            raise DataError(
                f"the prompt holds byte {max(ids)}, outside the model's vocabulary of "
                f"{self.vocab_size} ids; this model cannot read it as UTF-8 bytes"
            )
        return ids

    def decoder(self) -> Callable[[int | None], str]:
        incremental = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def decode(token: int | None) -> str:
            if token is None:
                return incremental.decode(b"", final=True)
            if 0 <= token < 256:
                return incremental.decode(bytes([token]))
            return ""

        return decode


class TokenizerCodec(TextCodec):
    """A ``tokenizer.json`` read with the Hugging Face ``tokenizers`` library."""

    def __init__(self, path: str | Path, eos_id: int | None = None) -> None:
        from speedtronic.data.encoders import import_tokenizers

        try:
            self.tokenizer = import_tokenizers().Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exceptions
            raise DataError(f"cannot load tokenizer {path}: {' '.join(str(exc).split())}") from None
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        _utf8(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decoder(self) -> Callable[[int | None], str]:
        ids: list[int] = []
        shown = [0]

        def decode(token: int | None) -> str:
            if token is not None:
                ids.append(token)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if token is not None and text.endswith("\ufffd"):
                return ""  # a character split over tokens: wait for the rest
            piece, shown[0] = text[shown[0] :], len(text)
            return piece

        return decode


def generate_text(
    model: Any,
    codec: TextCodec,
    prompt: str,
    options: SamplingOptions = SamplingOptions(),
    *,
    use_cache: bool = True,
) -> Iterator[str]:
    """Yield the text that follows ``prompt``, piece by piece as tokens are sampled. The prompt
    is checked (and warnings logged) when this is called, before the first piece."""
    tokens = generate_tokens(
        model, codec.encode(prompt), options, eos_id=codec.eos_id, use_cache=use_cache
    )
    return _pieces(tokens, codec)


def _pieces(tokens: Iterator[int], codec: TextCodec) -> Iterator[str]:
    decode = codec.decoder()
    for token in tokens:
        if token == codec.eos_id:
            break
        piece = decode(token)
        if piece:
            yield piece
    rest = decode(None)
    if rest:
        yield rest
