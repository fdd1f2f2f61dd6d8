"""The ``speedtronic data`` command group and its ``prepare`` subcommand."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_data_commands", "cmd_prepare"]


def _positive_int(text: str) -> int:
    value = int(text.replace("_", ""))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def cmd_prepare(args: argparse.Namespace) -> int:
    """``speedtronic data prepare``: tokenize a corpus into shards; print a one-line summary."""
    from speedtronic.data.preparation import DEFAULT_SHARD_TOKENS, prepare

    result = prepare(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
        eval_fraction=args.eval_fraction,
        eval_split=args.eval_split,
        workers=args.workers,
        append_eos=args.append_eos,
        eos_token=args.eos_token,
        split_blank_lines=args.blank_line_documents,
        skip_bad=args.skip_bad,
        max_doc_bytes=args.max_doc_bytes,
        progress=False if args.no_progress else None,
    )
    print(result.summary())
    return 0


def add_data_commands(subparsers: Any) -> None:
    """Register ``speedtronic data`` (with ``prepare``) on the CLI's subparsers."""
    data = subparsers.add_parser("data", help="prepare training data (token shards)")
    commands = data.add_subparsers(dest="data_command", metavar="COMMAND")
    data.set_defaults(handler=lambda args: _no_command(data))

    prepare = commands.add_parser(
        "prepare",
        help="tokenize text/JSONL/parquet into memory-mappable token shards",
        description="Tokenize a corpus once into DIR/train/shard_*.bin, DIR/eval/shard_*.bin "
        "and DIR/index.json, for `data.shards: DIR`.",
    )
    prepare.add_argument(
        "inputs", nargs="+", metavar="INPUT", help=".txt, .jsonl, .jsonl.gz, .parquet or folders"
    )
    prepare.add_argument("--out", "-o", required=True, metavar="DIR", help="output directory")
    prepare.add_argument(
        "--tokenizer",
        default="bytes",
        metavar="bytes|PATH",
        help="`bytes` (UTF-8 bytes, vocab 256 + EOS) or a tokenizer.json (default: bytes)",
    )
    prepare.add_argument(
        "--text-field", default="text", metavar="NAME", help="JSONL/parquet text field (text)"
    )
    prepare.add_argument(
        "--shard-tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help="tokens per shard (default 100_000_000)",
    )
    prepare.add_argument(
        "--eval-fraction",
        type=_fraction,
        default=0.0,
        metavar="F",
        help="fraction held out in DIR/eval (default 0)",
    )
    prepare.add_argument(
        "--eval-split",
        choices=("auto", "documents", "tail"),
        default="auto",
        help="how --eval-fraction is held out: `documents` (whole documents, drawn by a hash "
        "of their text), `tail` (the last fraction of the token stream), or `auto` (default: "
        "tail for fewer than 100 documents, else documents)",
    )
    prepare.add_argument(
        "--workers",
        type=_positive_int,
        default=None,
        metavar="K",
        help="tokenizer processes (default: the usable CPU cores, at most 16)",
    )
    prepare.add_argument(
        "--append-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="put the EOS id after every document (default: yes)",
    )
    prepare.add_argument(
        "--eos-token", metavar="TOKEN", help="the EOS token of a tokenizer.json (default: found)"
    )
    prepare.add_argument(
        "--blank-line-documents",
        action="store_true",
        help=".txt files hold one document per blank-line-separated block (default: per file)",
    )
    prepare.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip bad records (and unreadable files), count and report them, instead of failing",
    )
    prepare.add_argument(
        "--max-doc-bytes",
        type=_positive_int,
        default=64 << 20,
        metavar="N",
        help="largest document or JSONL line accepted (default 64 MiB)",
    )
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar")
    prepare.set_defaults(handler=cmd_prepare)
    # `--debug` after the subcommand name too (the CLI adds it to `data` itself).
    prepare.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )


def _no_command(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2
