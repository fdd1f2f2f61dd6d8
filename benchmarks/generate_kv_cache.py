"""Generation speed of the reference transformer with its KV cache against full recomputation.

Both sample the same greedy tokens from the same model (checked here); the baseline runs the
whole sequence through the model for every new token, the cached path feeds one token and
attends to the stored keys and values. Rounds alternate between the two within one process;
each path's best round is reported, and the ratio of tokens/s is the result.

    python benchmarks/generate_kv_cache.py --quick    # CPU, seconds
    python benchmarks/generate_kv_cache.py            # the figures in docs/models.md
    python benchmarks/generate_kv_cache.py --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch

from speedtronic.generation import SamplingOptions, generate_tokens
from speedtronic_models import ReferenceTransformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer rounds")
    parser.add_argument("--rounds", type=int, help="timed rounds per path")
    args = parser.parse_args()
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
    rounds = args.rounds or 3
    torch.manual_seed(0)
    model = ReferenceTransformer(**shape).to(args.device).eval()
    prompt = torch.randint(0, 256, (prompt_len,)).tolist()
    options = SamplingOptions(max_new_tokens=new_tokens, temperature=0)

    def run(use_cache: bool) -> tuple[float, list[int]]:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        tokens = list(generate_tokens(model, prompt, options, use_cache=use_cache))
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - started, tokens

    cached_tokens = run(True)[1]  # warm-up, and the equality check
    assert run(False)[1] == cached_tokens, "the cache changed the greedy tokens"
    best = {True: float("inf"), False: float("inf")}
    for _ in range(rounds):
        for use_cache in (True, False):
            best[use_cache] = min(best[use_cache], run(use_cache)[0])
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, device {args.device}, threads {threads}, fp32")
    print(f"shape: {shape}, prompt {prompt_len}, new tokens {new_tokens}; best of {rounds} rounds")
    print(f"{'path':<22}{'tokens/s':>10}{'ms/token':>10}")
    for use_cache, label in ((True, "KV cache"), (False, "full recomputation")):
        seconds = best[use_cache]
        print(f"{label:<22}{new_tokens / seconds:>10.1f}{1000 * seconds / new_tokens:>10.2f}")
    print(f"ratio KV cache / full recomputation tokens/s: {best[False] / best[True]:.2f}x")


if __name__ == "__main__":
    main()
