"""``speedtronic export`` and ``speedtronic generate``: use a trained model elsewhere.

Both read the run's config (``--config``, with ``--output-dir``/``--set`` overrides as for
``train``) and take the weights from ``--checkpoint latest|best|PATH`` (default ``latest``) or
``--global`` (a multi-node run's current global weights, from the plugin that owns its store).
Errors are :class:`~speedtronic.SpeedtronicError` subclasses: one line, exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from speedtronic.cli.options import add_set_option, load_config

__all__ = ["DTYPE_CHOICES", "FORMAT_CHOICES", "add_model_commands", "cmd_export", "cmd_generate"]

log = logging.getLogger("speedtronic.cli")

# Kept here rather than imported from speedtronic.inference.export: building the parser stays light.
FORMAT_CHOICES = ("hf",)
DTYPE_CHOICES = ("bf16", "fp16", "fp32")


def _checkpoint(args: argparse.Namespace) -> str:
    return args.checkpoint or "latest"


def cmd_export(args: argparse.Namespace) -> int:
    """``speedtronic export``: write the trained model as a folder other tools load."""
    config = load_config(args)
    from speedtronic.inference.export import export_run
    from speedtronic.observe.threads import apply_threads

    apply_threads(config.run.threads)

    result = export_run(
        config,
        args.out,
        format=args.format,
        checkpoint=_checkpoint(args),
        use_global=args.use_global,
        dtype=args.dtype,
        force=args.force,
        tokenizer=args.tokenizer,
    )
    print(
        f"exported {result.description} ({result.dtype}) from {result.source} to {result.directory}"
    )
    print(f"tokenizer: {result.tokenizer}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """``speedtronic generate``: sample text from the trained model, streamed to stdout."""
    config = load_config(args)
    from speedtronic.engine.precision import resolve_device
    from speedtronic.inference import load_trained_model, run_tokenizer
    from speedtronic.inference.generation import SamplingOptions, generate_text
    from speedtronic.observe.threads import apply_threads

    apply_threads(config.run.threads)
    options = SamplingOptions(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    ).validate()
    tokenizer = run_tokenizer(config, args.tokenizer)
    device = resolve_device(config.run.device)
    trained = load_trained_model(
        config, _checkpoint(args), use_global=args.use_global, device=device
    )
    codec = tokenizer.codec(getattr(trained.model, "vocab_size", None))
    at_step = f" (step {trained.step})" if trained.step is not None else ""
    log.info("sampling from %s%s, tokenizer %s", trained.source, at_step, tokenizer.name)
    # A prompt the model cannot read fails, and warnings (stderr) are shown, before any text.
    pieces = generate_text(
        trained.model, codec, args.prompt, options, use_cache=not args.no_kv_cache
    )
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    for piece in pieces:
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    return 0


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", required=True, help="the run's YAML or JSON config")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument(
        "--checkpoint",
        metavar="latest|best|PATH",
        help="which weights: the newest checkpoint (default), the best one (best.json, written "
        "by runs that evaluate), or a checkpoint directory",
    )
    weights.add_argument(
        "--global",
        dest="use_global",
        action="store_true",
        help="the current global weights of a multi-node (DumbDiLoCo) run",
    )
    parser.add_argument("--output-dir", help="override run.output_dir (where the checkpoints are)")
    parser.add_argument(
        "--tokenizer",
        metavar="bytes|PATH",
        help="the tokenizer to use instead of the one the data section implies",
    )
    add_set_option(parser)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_commands(sub: Any) -> None:
    """Add ``export`` and ``generate`` to the ``speedtronic`` sub-parsers."""
    export = sub.add_parser(
        "export", help="write the trained model as a Hugging Face folder (--format hf)"
    )
    _add_common(export)
    export.add_argument("--out", "-o", required=True, help="the folder to write")
    export.add_argument("--format", choices=FORMAT_CHOICES, default="hf", help="export format")
    export.add_argument(
        "--dtype", choices=DTYPE_CHOICES, help="cast the weights (default: as trained)"
    )
    export.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    export.set_defaults(handler=cmd_export)

    generate = sub.add_parser("generate", help="sample text from the trained model")
    _add_common(generate)
    generate.add_argument("--prompt", "-p", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=_positive, default=64, help="default 64")
    generate.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    generate.add_argument("--top-k", type=_positive, help="sample from the k likeliest tokens")
    generate.add_argument(
        "--top-p", type=float, help="sample from the likeliest tokens holding this mass"
    )
    generate.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    generate.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="recompute the whole sequence per token (slow; for checking the cache)",
    )
    generate.set_defaults(handler=cmd_generate)
