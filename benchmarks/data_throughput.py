"""Token-shard data throughput: the loader against what the models consume, and
``speedtronic data prepare`` against the ``tokenizers`` library's own batch encoding.

Real text, nothing downloaded: the corpus is the Python standard library's sources (and its
docs or other text files, when installed) on this machine, one document per file, as JSONL.

1. **Loader**: micro-batches/s of ``data.shards`` (memory-mapped, window-shuffled) with
   ``data.num_workers`` 0 and 2, as tokens/s, against the tokens/s that the smoke and
   reference-small models consume when training on this machine (``configs/*.yaml``, fp32,
   synthetic data, no compile). Target: the loader is at least 10x faster than each model.
2. **Prepare**: tokens/s of ``prepare`` (read + parse + tokenize + split + write shards) with a
   BPE ``tokenizer.json`` trained here on the corpus, against ``Tokenizer.encode_batch`` on the
   same texts already in memory. Target: ratio >= 0.8. And the bytes tokenizer's MB/s.

Rounds are interleaved (each round runs every variant once, alternating the order) and the
figures are medians. Wall-clock time and CPU time (this process plus its waited-for children)
are both shown: on a shared machine CPU time is the steadier one, and a ratio on CPU time says
how much work prepare adds per token, a ratio on wall time what a user waits.

    python benchmarks/data_throughput.py --quick   # about a minute on a busy 2-core machine
    python benchmarks/data_throughput.py           # 25 MB, 5 rounds, reference-small: ~5 min
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from results import emit

ROOT = Path(__file__).resolve().parents[1]


def cpu_now() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def measure(run: Callable[[], Any]) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), cpu_now()
    value = run()
    return time.perf_counter() - wall, cpu_now() - cpu, value


# ------------------------------------------------------------------ the corpus
def build_corpus(directory: Path, megabytes: float) -> tuple[Path, list[str]]:
    """The standard library's .py files (then .txt/.rst, e.g. installed docs) as JSONL."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    docs = Path(sys.base_prefix) / "share" / "doc"
    if docs.is_dir():
        roots.append(docs)
    budget = int(megabytes * 1e6)
    texts: list[str] = []
    size = 0
    for root in roots:
        for path in sorted(root.rglob("*")):
            if size >= budget:
                break
            if path.suffix not in (".py", ".txt", ".rst") or "site-packages" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if text.strip():
                texts.append(text)
                size += len(text.encode("utf-8"))
    corpus = directory / "stdlib.jsonl"
    with open(corpus, "w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}) + "\n")
    return corpus, texts


def train_bpe(texts: list[str], path: Path, vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample, size = [], 0
    for text in texts:  # a few MB are plenty for a benchmark tokenizer
        sample.append(text)
        size += len(text)
        if size > 4e6:
            break
    tokenizer.train_from_iterator(sample, trainer=trainer)
    tokenizer.save(str(path))
    return tokenizer


# ------------------------------------------------------------------ prepare vs encode_batch
def prepare_rounds(corpus: Path, texts: list[str], work: Path, rounds: int) -> dict[str, Any]:
    from speedtronic.data import prepare

    tokenizer_path = work / "bpe" / "tokenizer.json"
    tokenizer_path.parent.mkdir()
    tokenizer = train_bpe(texts, tokenizer_path, vocab_size=8192)
    input_mb = corpus.stat().st_size / 1e6
    text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6

    def run_prepare(name: str, tok: str | Path, workers: int) -> Callable[[], int]:
        def run() -> int:
            result = prepare([corpus], work / name, tokenizer=tok, workers=workers, progress=False)
            return sum(result.tokens.values())

        return run

    def run_encode_batch() -> int:
        return sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False))

    variants: dict[str, Callable[[], int]] = {
        "tokenizers encode_batch (in memory)": run_encode_batch,
        "prepare bpe, 1 worker": run_prepare("bpe1", tokenizer_path, 1),
        "prepare bpe, 2 workers": run_prepare("bpe2", tokenizer_path, 2),
        "prepare bytes, 1 worker": run_prepare("bytes1", "bytes", 1),
        "prepare bytes, 2 workers": run_prepare("bytes2", "bytes", 2),
    }
    samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in variants}
    names = list(variants)
    for round_number in range(rounds):
        for name in names if round_number % 2 == 0 else names[::-1]:
            samples[name].append(measure(variants[name]))
    out: dict[str, Any] = {"input_mb": input_mb, "text_mb": text_mb, "documents": len(texts)}
    for name, runs in samples.items():
        tokens = runs[0][2]
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        out[name] = {
            "tokens": tokens,
            "wall_s": wall,
            "cpu_s": cpu,
            "tokens_per_s": tokens / wall,
            "tokens_per_cpu_s": tokens / cpu,
            "rounds": runs,
        }
    return out


# ------------------------------------------------------------------ loader vs model
def model_config(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())


def loader_tokens_per_s(shards: Path, micro: int, seq: int, workers: int, batches: int) -> float:
    from speedtronic import SpeedtronicConfig
    from speedtronic.data import build_dataloader

    config = SpeedtronicConfig.from_dict(
        {
            "run": {"device": "cpu"},
            "data": {"shards": str(shards), "micro_batch_size": micro, "num_workers": workers},
        }
    )
    iterator = build_dataloader(config, seq_len=seq, vocab_size=1 << 16).iterate(0)
    for _ in range(4 * max(workers, 1)):  # workers started, prefetch queue full
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    elapsed = time.perf_counter() - start
    del iterator
    return batches * micro * seq / elapsed


def model_tokens_per_s(name: str, steps: int, micro: int | None, work: Path) -> dict[str, Any]:
    """Training tokens/s of a configs/ model on this CPU, after two warmup steps."""
    from speedtronic.engine.runtime import build_runtime

    config = model_config(name)
    config["run"].update(device="cpu", max_steps=steps + 2, output_dir=str(work / name))
    config["data"] = {
        "micro_batch_size": micro or config["data"]["micro_batch_size"],
        "num_workers": 0,
    }
    config["precision"] = {"mode": "fp32"}
    config["compile"] = {"enabled": False}
    config["checkpoint"] = {"interval": 0, "save_final": False}
    config["logging"] = {"log_every": 1, "progress": False}
    stamps: list[float] = []

    def hook(event: str, payload: dict[str, Any]) -> None:
        if event == "step":
            stamps.append(time.perf_counter())

    runtime = build_runtime(config, hooks=[hook], console=False)
    runtime.trainer.fit()
    seq = config["model"]["max_seq_len"]
    per_step = config["data"]["micro_batch_size"] * seq
    elapsed = stamps[-1] - stamps[1]
    return {
        "micro_batch_size": config["data"]["micro_batch_size"],
        "seq_len": seq,
        "tokens_per_s": per_step * (len(stamps) - 2) / elapsed,
    }


def loader_rounds(corpus: Path, work: Path, rounds: int, reference: bool) -> dict[str, Any]:
    from speedtronic.data import prepare

    shards = work / "loader-shards"
    prepare([corpus], shards, workers=1, progress=False, shard_tokens=4_000_000)
    # Both shapes in every mode: reading is cheap, only training reference-small is slow.
    shapes = {"smoke": (8, 64), "reference-small": (16, 1024)}
    out: dict[str, Any] = {}
    for name, (micro, seq) in shapes.items():
        batches = 2000 if seq <= 64 else 300
        samples: dict[int, list[float]] = {0: [], 2: []}
        for round_number in range(rounds):
            for workers in (0, 2) if round_number % 2 == 0 else (2, 0):
                samples[workers].append(loader_tokens_per_s(shards, micro, seq, workers, batches))
        out[name] = {f"loader_{w}_workers": statistics.median(v) for w, v in samples.items()}
        out[name]["rounds"] = samples
    out["smoke"]["model"] = model_tokens_per_s("smoke", steps=6, micro=None, work=work)
    if reference:  # one sample of 1024 tokens per step: a CPU step is seconds already
        out["reference-small"]["model"] = model_tokens_per_s("reference-small", 2, 1, work)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small corpus, 3 rounds, smoke only")
    parser.add_argument("--mb", type=float, help="corpus size in MB (default 8 quick, 24 full)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3 quick, 5 full)")
    args = parser.parse_args()
    logging.getLogger("speedtronic").setLevel(logging.WARNING)
    megabytes = args.mb or (8 if args.quick else 24)
    rounds = args.rounds or (3 if args.quick else 5)

    with tempfile.TemporaryDirectory(prefix="speedtronic-data-bench-") as tmp:
        work = Path(tmp)
        corpus, texts = build_corpus(work, megabytes)
        print(
            f"corpus: {len(texts)} documents, {corpus.stat().st_size / 1e6:.1f} MB of JSONL "
            f"from the standard library; {os.cpu_count()} CPUs; {rounds} rounds"
        )

        prep = prepare_rounds(corpus, texts, work, rounds)
        base = prep["tokenizers encode_batch (in memory)"]
        print("\nprepare vs tokenizers (median of rounds)")
        print(
            f"{'':38} {'tokens':>10} {'wall s':>8} {'tok/s':>12} {'tok/cpu-s':>12}"
            f" {'ratio wall':>11} {'ratio cpu':>10}"
        )
        for name in [n for n in prep if isinstance(prep[n], dict)]:
            row = prep[name]
            ratio = row["tokens_per_s"] / base["tokens_per_s"]
            ratio_cpu = row["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
            shown = "bpe" in name or "encode_batch" in name
            print(
                f"{name:38} {row['tokens']:>10,} {row['wall_s']:>8.2f} "
                f"{row['tokens_per_s']:>12,.0f} {row['tokens_per_cpu_s']:>12,.0f} "
                f"{(f'{ratio:.2f}x' if shown else '-'):>11} "
                f"{(f'{ratio_cpu:.2f}x' if shown else '-'):>10}"
            )
        for workers in (1, 2):
            row = prep[f"prepare bytes, {workers} worker{'s' if workers > 1 else ''}"]
            print(
                f"bytes tokenizer, {workers} worker(s): {prep['input_mb'] / row['wall_s']:.1f} "
                f"MB/s of JSONL in, {prep['text_mb'] / row['wall_s']:.1f} MB/s of text "
                f"({prep['text_mb'] / row['cpu_s']:.1f} MB per CPU-second)"
            )
        best = max(
            prep["prepare bpe, 1 worker"]["tokens_per_s"],
            prep["prepare bpe, 2 workers"]["tokens_per_s"],
        )
        print(
            f"target: prepare (bpe, best worker count) / encode_batch >= 0.8: "
            f"{best / base['tokens_per_s']:.2f}x"
        )

        loader = loader_rounds(corpus, work, rounds, reference=not args.quick)
        print("\nloader vs model consumption (tokens/s, this machine's CPU, fp32)")
        for name, row in loader.items():
            for workers in (0, 2):
                rate = row[f"loader_{workers}_workers"]
                if "model" not in row:  # --quick does not train reference-small
                    print(f"{name:16} loader, {workers} workers: {rate:>14,.0f} tok/s")
                    continue
                model = row["model"]["tokens_per_s"]
                shape = f"micro {row['model']['micro_batch_size']}, seq {row['model']['seq_len']}"
                print(
                    f"{name:16} loader, {workers} workers: {rate:>14,.0f} tok/s = "
                    f"{rate / model:>9,.0f}x the model's {model:,.0f} tok/s ({shape})"
                )
        print("target: loader >= 10x the model")
        emit_rows(prep, loader, rounds, megabytes)


def emit_rows(prep: dict[str, Any], loader: dict[str, Any], rounds: int, megabytes: float) -> None:
    """The RESULT lines: loader rates per round, and prepare against encode_batch per round."""
    for name, row in loader.items():
        shape = "8 x 64" if name == "smoke" else "16 x 1024"
        for workers in (0, 2):
            emit(
                f"data_throughput.loader.{name}.{workers}_workers",
                [rate / 1e6 for rate in row["rounds"][workers]],
                unit="M tokens/s",
                method=f"wall-clock time, {rounds} interleaved rounds",
                label=f"data.shards loader, {shape} micro-batches, num_workers {workers}",
            )
        if "model" in row:
            emit(
                f"data_throughput.model.{name}",
                [row["model"]["tokens_per_s"] / 1e3],
                unit="k tokens/s",
                method="wall-clock time of the training steps after two warm-up steps, 1 run",
                label=f"{name} model training on this CPU, fp32, synthetic data",
            )
    base = prep["tokenizers encode_batch (in memory)"]["rounds"]
    for workers in (1, 2):
        runs = prep[f"prepare bpe, {workers} worker{'s' if workers > 1 else ''}"]["rounds"]
        emit(
            f"data_throughput.prepare_bpe.{workers}_workers",
            [(r[2] / r[0]) / (b[2] / b[0]) for r, b in zip(runs, base, strict=True)],
            unit="x",
            method=f"wall-clock time, {rounds} interleaved rounds, {megabytes:g} MB of JSONL",
            label=f"prepare (BPE, {workers} worker(s)) / tokenizers encode_batch, tokens/s",
        )


if __name__ == "__main__":
    main()
