"""Generation speed of the reference transformer with its KV cache against full recomputation.

Both sample the same greedy tokens from the same model (checked here); the baseline runs the
whole sequence through the model for every new token, the cached path feeds one token and
attends to the stored keys and values. Rounds alternate between the two within one process
(CPU time of this process on a CPU, wall-clock time on CUDA); the ratio of tokens/s per round is
the result, printed as min / median / max over rounds.

    python benchmarks/generate_kv_cache.py --quick    # CPU, seconds
    python benchmarks/generate_kv_cache.py            # the figures in docs/models.md
    python benchmarks/generate_kv_cache.py --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch
from results import emit, spread

from speedtronic.inference.generation import SamplingOptions, generate_tokens
from speedtronic_models import ReferenceTransformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer rounds")
    parser.add_argument("--rounds", type=int, help="timed rounds per path")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quick = args.quick
    shape = dict(
        vocab_size=256,
        max_seq_len=512,
        n_layer=2 if quick else 4,
        n_head=4 if quick else 8,
        n_kv_head=2 if quick else 4,
        d_model=128 if quick else 256,
    )
    prompt_len, new_tokens = (32, 64) if quick else (32, 96)
    rounds = args.rounds or 5
    cuda = args.device.startswith("cuda")
    clock = time.perf_counter if cuda else time.process_time
    torch.manual_seed(0)
    model = ReferenceTransformer(**shape).to(args.device).eval()
    prompt = torch.randint(0, 256, (prompt_len,)).tolist()
    options = SamplingOptions(max_new_tokens=new_tokens, temperature=0)

    def run(use_cache: bool) -> tuple[float, list[int]]:
        if cuda:
            torch.cuda.synchronize()
        started = clock()
        tokens = list(generate_tokens(model, prompt, options, use_cache=use_cache))
        if cuda:
            torch.cuda.synchronize()
        return clock() - started, tokens

    cached_tokens = run(True)[1]  # warm-up, and the equality check
    assert run(False)[1] == cached_tokens, "the cache changed the greedy tokens"
    times: dict[bool, list[float]] = {True: [], False: []}
    for index in range(rounds):
        for use_cache in (True, False) if index % 2 == 0 else (False, True):
            times[use_cache].append(run(use_cache)[0])
    threads = torch.get_num_threads()
    method = (
        f"{'wall-clock' if cuda else 'CPU'} time, {rounds} interleaved rounds, {threads} thread(s)"
    )
    print(f"torch {torch.__version__}, device {args.device}, threads {threads}, fp32")
    print(f"shape: {shape}, prompt {prompt_len}, new tokens {new_tokens}; {method}")
    print(f"{'path':<22}{'tokens/s min / median / max':>30}")
    for use_cache, label in ((True, "KV cache"), (False, "full recomputation")):
        low, middle, high = spread([new_tokens / t for t in times[use_cache]])
        print(f"{label:<22}{f'{low:.1f} / {middle:.1f} / {high:.1f}':>30}")
    ratios = [full / cached for cached, full in zip(times[True], times[False], strict=True)]
    low, middle, high = spread(ratios)
    print(f"ratio KV cache / full recomputation tokens/s: {middle:.2f}x ({low:.2f} - {high:.2f})")
    emit(
        "generate_kv_cache." + ("quick" if quick else "full"),
        ratios,
        unit="x",
        method=method,
        label=f"generation with / without the KV cache, tokens/s ({new_tokens} new tokens)",
    )


if __name__ == "__main__":
    main()
