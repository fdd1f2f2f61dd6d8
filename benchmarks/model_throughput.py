"""Training throughput of the reference transformer against a plain GPT-2 of the same size.

The baseline is written here in the most direct PyTorch: learned positions, LayerNorm, biases,
attention as ``softmax(q @ k.T + mask) @ v`` with a dense causal mask, a 4x GELU MLP and a tied
head. Both models get the same width, depth, heads, vocabulary and batch, and the reference's
SwiGLU width is the multiple of 8 nearest 8/3 ``d_model``, so their matmul parameters agree
within 1% (``--ffn default`` keeps the model's default width, rounded up to a multiple of 64:
6% more parameters at ``d_model`` 128). Each step is a forward and backward pass (no optimizer).

Three shapes, per token the figure that matters (depth scales both models alike, so the large
shape keeps few layers on a CPU):

* ``d128``: d_model 128, seq 64, 4 layers, 4 heads, batch 12, vocab 256 (nanoGPT's CPU recipe
  for shakespeare_char, with byte-level tokens);
* ``d256``: d_model 256, seq 256, 4 layers, 8 heads, batch 8, vocab 8192;
* ``d768``: d_model 768, seq 1024, 12 heads (GPT-2 small's width and context), 2 layers (1 with
  ``--quick``), batch 1, vocab 8192.

Rounds alternate the two models (and which goes first) within one process; each round times
``steps`` steps of each in CPU time of this process (``time.process_time``: other tenants of a
shared machine do not count, unlike wall-clock time) on ``--threads`` threads (default 1). Per
round the result is the reference's tokens per CPU-second over the baseline's; the script prints
their min / median / max over rounds, and one ``RESULT`` line per shape for run_all.py.

    python benchmarks/model_throughput.py --quick      # CPU, a few minutes on a busy 2-core box
    python benchmarks/model_throughput.py              # the figures in docs/models.md
    python benchmarks/model_throughput.py --device cuda --peak-tflops 989
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from results import emit, spread
from torch import Tensor, nn

from speedtronic_models import ReferenceTransformer

# Dense bf16 peak TFLOP/s by device-name fragment, for MFU when --peak-tflops is not given.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0}

# name -> shape; (steps per round, rounds) come from STEPS below.
SHAPES: dict[str, dict[str, int]] = {
    "d128": dict(vocab_size=256, d_model=128, n_layer=4, n_head=4, seq_len=64, batch_size=12),
    "d256": dict(vocab_size=8192, d_model=256, n_layer=4, n_head=8, seq_len=256, batch_size=8),
    "d768": dict(vocab_size=8192, d_model=768, n_layer=2, n_head=12, seq_len=1024, batch_size=1),
}
# (steps per round, rounds) per shape, full and --quick.
STEPS = {
    False: {"d128": (4, 15), "d256": (1, 11), "d768": (1, 7)},
    True: {"d128": (2, 9), "d256": (1, 7), "d768": (1, 5)},
}


class PlainAttention(nn.Module):
    """GPT-2 attention, spelled out: one QKV projection, explicit scores and softmax."""

    def __init__(self, d_model: int, n_head: int, max_seq_len: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        causal = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool).tril()
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq_len, width = x.shape
        head_dim = width // self.n_head
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq_len, self.n_head, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~self.causal[:seq_len, :seq_len], float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(batch, seq_len, width))


class PlainBlock(nn.Module):
    """GPT-2 block: LayerNorm pre-norm, attention, LayerNorm, 4x GELU MLP."""

    def __init__(self, d_model: int, n_head: int, max_seq_len: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = PlainAttention(d_model, n_head, max_seq_len)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * d_model, d_model),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    """GPT-2 with learned positions and a head tied to the token embedding."""

    def __init__(self, vocab_size: int, max_seq_len: int, n_layer: int, n_head: int,
                 d_model: int) -> None:  # fmt: skip
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(
            PlainBlock(d_model, n_head, max_seq_len) for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(d_model)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: Tensor, labels: Tensor) -> dict[str, Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return {"logits": logits, "loss": loss}


def matched_ffn(d_model: int) -> int:
    """The SwiGLU width whose three matrices hold as many parameters as a 4x GELU MLP's two."""
    return 8 * round(8 * d_model / 3 / 8)


def matmul_params(model: nn.Module) -> int:
    """Parameters that take part in a matmul per token: every matrix except position tables.

    The tied embedding counts once, as the output head (the lookup itself is free).
    """
    return sum(
        p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "wpe" not in name
    )


def flops_per_token(model: nn.Module, n_layer: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token, PaLM-style: 6 per matmul parameter, plus attention scores and
    weighted values (12 * layers * width * seq_len), counting the full, not causal, square."""
    return 6 * matmul_params(model) + 12 * n_layer * d_model * seq_len


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, tflops in PEAK_BF16_TFLOPS.items():
        if fragment in name:
            return tflops
    return None


def time_steps(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Seconds for ``steps`` calls of ``step``: CPU time of this process on a CPU, wall-clock
    time with the device synchronised on CUDA (where the work is not this process's CPU's)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
        return time.perf_counter() - start
    start = time.process_time()
    for _ in range(steps):
        step()
    return time.process_time() - start


def make_step(model: nn.Module, input_ids: Tensor, labels: Tensor, autocast) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        with autocast():
            loss = model(input_ids, labels=labels)["loss"]
        loss.backward()

    return step


def measure(name: str, shape: dict[str, int], args: argparse.Namespace) -> None:
    """Time both models at one shape and print the table and the RESULT line."""
    device = torch.device(args.device)
    steps, rounds = STEPS[args.quick][name]
    if args.quick and name == "d768":
        shape = {**shape, "n_layer": 1}
    steps, rounds = args.steps or steps, args.rounds or rounds
    use_bf16 = device.type == "cuda"

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else nullcontext()

    ffn = matched_ffn(shape["d_model"]) if args.ffn == "matched" else None
    torch.manual_seed(0)
    models: dict[str, nn.Module] = {
        "reference": ReferenceTransformer(
            vocab_size=shape["vocab_size"], max_seq_len=shape["seq_len"],
            n_layer=shape["n_layer"], n_head=shape["n_head"],
            n_kv_head=args.n_kv_head or shape["n_head"], d_model=shape["d_model"],
            ffn_hidden=ffn,
        ),
        "plain GPT-2": PlainGPT(
            shape["vocab_size"], shape["seq_len"], shape["n_layer"], shape["n_head"],
            shape["d_model"],
        ),
    }  # fmt: skip
    input_ids = torch.randint(0, shape["vocab_size"], (shape["batch_size"], shape["seq_len"]))
    labels = torch.roll(input_ids, -1, dims=1)
    input_ids, labels = input_ids.to(device), labels.to(device)
    run = {}
    for label, model in models.items():
        model.to(device).train()
        runnable = torch.compile(model) if args.compile else model
        run[label] = make_step(runnable, input_ids, labels, autocast)
        time_steps(run[label], 2, device)  # warm-up

    tokens = steps * shape["batch_size"] * shape["seq_len"]
    rates: dict[str, list[float]] = {label: [] for label in models}
    peak_mem: dict[str, float] = {}
    for index in range(rounds):
        order = list(models) if index % 2 == 0 else list(reversed(models))
        for label in order:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            rates[label].append(tokens / time_steps(run[label], steps, device))
            if device.type == "cuda":
                peak_mem[label] = torch.cuda.max_memory_allocated(device) / 2**20
    ratios = [r / b for r, b in zip(rates["reference"], rates["plain GPT-2"], strict=True)]

    clock = "wall-clock time" if device.type == "cuda" else "CPU time"
    print(
        f"\n{name}: vocab {shape['vocab_size']}, d_model {shape['d_model']}, "
        f"n_layer {shape['n_layer']}, n_head {shape['n_head']}, seq {shape['seq_len']}, "
        f"batch {shape['batch_size']}, SwiGLU width {models['reference'].config.ffn_hidden}; "
        f"{rounds} interleaved rounds x {steps} steps, {clock}"
    )
    header = f"  {'model':<13}{'params':>12}{'tokens/s min / median / max':>32}"
    peak = peak_tflops(device, args.peak_tflops)
    if peak is not None:
        header += f"{'MFU':>8}"
    if peak_mem:
        header += f"{'peak MiB':>10}"
    print(header)
    for label, model in models.items():
        low, middle, high = spread(rates[label])
        params = sum(p.numel() for p in model.parameters())
        row = f"  {label:<13}{params:>12,}{f'{low:,.0f} / {middle:,.0f} / {high:,.0f}':>32}"
        if peak is not None:
            flops = flops_per_token(model, shape["n_layer"], shape["d_model"], shape["seq_len"])
            row += f"{flops * middle / (peak * 1e12):>8.1%}"
        if peak_mem:
            row += f"{peak_mem[label]:>10,.0f}"
        print(row)
    low, middle, high = spread(ratios)
    print(f"  ratio reference / plain GPT-2: {middle:.2f}x (rounds {low:.2f} - {high:.2f})")
    method = f"{clock}, {rounds} interleaved rounds of {steps} steps, {torch.get_num_threads()}"
    method += f" thread(s), {device.type}" + (", bf16" if use_bf16 else ", fp32")
    emit(
        f"model_throughput.{name}",
        ratios,
        unit="x",
        method=method,
        label=f"reference / plain GPT-2 tokens per {'second' if use_bf16 else 'CPU-second'}, "
        f"{name} (seq {shape['seq_len']})",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, a shallower d768")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--shapes", default="d128,d256,d768", help="comma-separated subset")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (CPU)")
    parser.add_argument("--steps", type=int, help="steps per round (default per shape)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default per shape)")
    parser.add_argument("--ffn", choices=("matched", "default"), default="matched",
                        help="the reference's SwiGLU width")  # fmt: skip
    parser.add_argument("--n-kv-head", type=int, help="reference KV heads (default: n_head)")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument("--peak-tflops", type=float, help="device peak, for MFU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f", threads {torch.get_num_threads()}"
        + (", compiled" if args.compile else "")
        + f", SwiGLU width {args.ffn}"
    )
    for name in args.shapes.split(","):
        measure(name, SHAPES[name], args)


if __name__ == "__main__":
    main()
