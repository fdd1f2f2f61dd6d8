"""The reference decoder-only transformer: read top to bottom in the order data flows.

Token embedding -> ``n_layer`` pre-norm blocks (RMSNorm, rotary grouped-query attention,
RMSNorm, SwiGLU) -> final RMSNorm -> logits through the embedding matrix itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from speedtronic import DataError
from speedtronic_models.attention import GroupedQueryAttention, padding_causal_mask
from speedtronic_models.config import TransformerConfig
from speedtronic_models.feedforward import SwiGLU
from speedtronic_models.kv_cache import KVCache, LayerCache
from speedtronic_models.norm import RMSNorm
from speedtronic_models.rotary import RotaryEmbedding
from speedtronic_models.torch_compat import compute_dtype

IGNORE_INDEX = -100
_INIT_STD = 0.02


def _dropout(p: float) -> nn.Module:
    # An Identity keeps the p == 0 default free of a dropout kernel launch per call.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class TransformerBlock(nn.Module):
    """One pre-norm residual block: attention, then the feed-forward layer."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = GroupedQueryAttention(config)
        self.mlp_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.ffn_hidden)
        self.resid_dropout = _dropout(config.dropout)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """Transform the residual stream ``x`` ``[B, T, d_model]``."""
        x = x + self.resid_dropout(self.attn(self.attn_norm(x), cos, sin, mask, cache))
        return x + self.resid_dropout(self.mlp(self.mlp_norm(x)))


class ReferenceTransformer(nn.Module):
    """A GPT-style decoder-only language model: RoPE, grouped-query attention, SwiGLU,
    RMSNorm pre-norm, and an output head tied to the token embedding.

    The head *is* the embedding matrix (``tok_emb.weight``), not a second module sharing it,
    so the state dict holds the tensor once and ``safetensors.torch.save_file`` accepts it as is.
    Invalid parameters raise :class:`speedtronic.ConfigError` naming ``model.<param>``.
    """

    # The Hugging Face attribute for "never split these modules": Speedtronic's FSDP
    # (``parallel.fsdp.units: auto``) makes each of them a unit of its own.
    _no_split_modules = ("TransformerBlock",)

    def __init__(
        self,
        *,
        vocab_size: int,
        max_seq_len: int,
        n_layer: int,
        n_head: int,
        d_model: int,
        n_kv_head: int | None = None,
        ffn_hidden: int | None = None,
        dropout: float = 0.0,
        rope_theta: float = 10_000.0,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        config = TransformerConfig.from_params(
            {
                "vocab_size": vocab_size,
                "max_seq_len": max_seq_len,
                "n_layer": n_layer,
                "n_head": n_head,
                "n_kv_head": n_kv_head,
                "d_model": d_model,
                "ffn_hidden": ffn_hidden,
                "dropout": dropout,
                "rope_theta": rope_theta,
                "norm_eps": norm_eps,
            }
        )
        self.config = config
        # The trainer and data loader read these to size the token stream.
        self.vocab_size = config.vocab_size
        self.max_seq_len = config.max_seq_len
        self.gradient_checkpointing = False

        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.emb_dropout = _dropout(config.dropout)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.reset_parameters()

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> ReferenceTransformer:
        """Build from a config file's ``model`` section (without ``name``).

        Unknown or missing parameters raise :class:`speedtronic.ConfigError` at ``model.<key>``
        rather than a ``TypeError`` about keyword arguments. ``init_from: DIR`` then loads the
        weights of a local Llama-format folder (see :func:`speedtronic_models.export.load_llama`).
        """
        if not isinstance(params, Mapping):
            return cls(**dataclasses.asdict(TransformerConfig.from_params(params)))
        params = dict(params)
        init_from = params.pop("init_from", None)
        model = cls(**dataclasses.asdict(TransformerConfig.from_params(params)))
        if init_from is not None:
            from speedtronic_models.export import load_llama

            load_llama(model, init_from)
        return model

    @property
    def output_weight(self) -> Tensor:
        """The output head's weight: the token embedding matrix itself."""
        return self.tok_emb.weight

    def reset_parameters(self) -> None:
        """Re-initialise every weight (GPT-2 style).

        Matrices draw from N(0, 0.02). The two projections that write into the residual stream
        per block are scaled by ``1 / sqrt(2 * n_layer)`` so its variance stays put with depth.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        residual_std = _INIT_STD / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.out.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.down.weight, mean=0.0, std=residual_std)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute each block's activations during backward instead of storing them.

        Trades roughly one extra forward pass for activation memory that no longer grows
        with ``n_layer``. Uses non-reentrant checkpointing, which preserves dropout's RNG.
        """
        self.gradient_checkpointing = bool(enabled)

    def new_kv_cache(self) -> KVCache:
        """An empty cache for :meth:`forward` ``(kv_cache=...)``, holding ``max_seq_len``
        positions (allocated by each layer on first use)."""
        return KVCache(self.config.n_layer, self.max_seq_len)

    def start_decoding(self) -> Callable[[Tensor], Tensor]:
        """Speedtronic's incremental-decoding protocol (``speedtronic.generation``): a
        function that takes the next token ids ``[B, T]`` and returns their logits
        ``[B, T, vocab_size]``, keeping a fresh KV cache between calls."""
        cache = self.new_kv_cache()

        def step(input_ids: Tensor) -> Tensor:
            return self(input_ids, kv_cache=cache)["logits"]

        return step

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> dict[str, Any]:
        """Run the model on token ids ``[B, T]`` (``T <= max_seq_len``).

        ``labels`` ``[B, T]`` are the already-shifted next tokens (position ``t`` holds the
        target for input ``t``); ``-100`` marks positions left out of the loss.
        ``attention_mask`` ``[B, T]`` (1/True = real token, 0/False = padding) hides padded
        keys. Returns ``{"logits": [B, T, vocab_size]}`` plus ``"loss"`` (mean cross-entropy)
        when labels are given.

        Incremental decoding (generation): with ``kv_cache`` (from :meth:`new_kv_cache`) the
        positions of ``input_ids`` follow those already cached, their keys and values are
        added to it, and only ``{"logits"}`` for the new positions is returned. Training never
        takes this path: without ``kv_cache`` the forward pass is the plain causal one.
        """
        if kv_cache is not None:
            return self._decode(input_ids, kv_cache, attention_mask, labels)
        if input_ids.dim() != 2:
            raise DataError(
                f"input_ids must be [batch, seq_len], got shape {list(input_ids.shape)}"
            )
        seq_len = input_ids.shape[1]
        if seq_len > self.max_seq_len:
            raise DataError(
                f"sequence length {seq_len} exceeds model max_seq_len {self.max_seq_len}"
            )
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise DataError(
                    f"attention_mask shape {list(attention_mask.shape)} does not match "
                    f"input_ids shape {list(input_ids.shape)}"
                )
            mask = padding_causal_mask(attention_mask)

        x = self.emb_dropout(self.tok_emb(input_ids))
        cos, sin = self.rotary(seq_len, dtype=compute_dtype(x))
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if recompute:
                x = checkpoint(block, x, cos, sin, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask)
        logits = F.linear(self.norm(x), self.tok_emb.weight)

        outputs: dict[str, Any] = {"logits": logits}
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise DataError(
                    f"labels shape {list(labels.shape)} does not match "
                    f"input_ids shape {list(input_ids.shape)}"
                )
            # float(): a model cast to bf16 should still reduce its loss in fp32.
            outputs["loss"] = F.cross_entropy(
                logits.float().view(-1, self.vocab_size),
                labels.reshape(-1),
                ignore_index=IGNORE_INDEX,
            )
        return outputs

    def _decode(
        self,
        input_ids: Tensor,
        cache: KVCache,
        attention_mask: Tensor | None,
        labels: Tensor | None,
    ) -> dict[str, Any]:
        """The incremental-decoding forward of :meth:`forward` ``(kv_cache=...)``."""
        if input_ids.dim() != 2:
            raise DataError(
                f"input_ids must be [batch, seq_len], got shape {list(input_ids.shape)}"
            )
        if attention_mask is not None or labels is not None:
            raise DataError("a kv_cache forward takes neither attention_mask nor labels")
        seq_len = input_ids.shape[1]
        start = cache.reserve(seq_len)
        x = self.emb_dropout(self.tok_emb(input_ids))
        cos, sin = self.rotary(seq_len, start, dtype=compute_dtype(x))
        for block, layer in zip(self.blocks, cache.layers):
            x = block(x, cos, sin, None, layer)
        cache.advance(seq_len)
        logits = F.linear(self.norm(x), self.tok_emb.weight)
        return {"logits": logits}
