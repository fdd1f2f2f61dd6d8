"""Forward+backward throughput of the reference transformer against a plain GPT-2 baseline.

The baseline is written here in the most direct PyTorch: learned positions, LayerNorm, biases,
attention as ``softmax(q @ k.T + mask) @ v`` with a dense causal mask, a 4x GELU MLP and a tied
head. Both models get the same width, depth, heads, vocabulary and batch, and their timings are
interleaved in rounds within one process so that machine noise hits both alike. Each model's
best round is reported (noise only ever adds time), and their ratio is the result. On CUDA
the table adds model FLOPs utilisation (MFU) and peak memory.

    python benchmarks/model_throughput.py --quick      # CPU: well under a minute
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
from torch import Tensor, nn

from speedtronic_models import ReferenceTransformer

# Dense bf16 peak TFLOP/s by device-name fragment, for MFU when --peak-tflops is not given.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0}

# Shapes per (device kind, quick): CPU sizes finish in seconds on two idle cores; GPU sizes are
# those of configs/reference-small.yaml. Many short rounds give best-of a chance to find quiet
# moments on a shared machine.
PRESETS: dict[tuple[str, bool], dict[str, int]] = {
    ("cpu", True): dict(vocab_size=4096, d_model=128, n_layer=2, n_head=4, seq_len=256,
                        batch_size=8, steps=2, rounds=6, warmup=2),
    ("cpu", False): dict(vocab_size=8192, d_model=256, n_layer=4, n_head=8, seq_len=256,
                         batch_size=8, steps=2, rounds=10, warmup=2),
    ("cuda", True): dict(vocab_size=32768, d_model=512, n_layer=8, n_head=8, seq_len=1024,
                         batch_size=16, steps=10, rounds=3, warmup=3),
    ("cuda", False): dict(vocab_size=32768, d_model=512, n_layer=8, n_head=8, seq_len=1024,
                          batch_size=16, steps=30, rounds=5, warmup=5),
}  # fmt: skip


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
    """Seconds for ``steps`` calls of ``step``, device work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def make_step(model: nn.Module, input_ids: Tensor, labels: Tensor, autocast) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        with autocast():
            loss = model(input_ids, labels=labels)["loss"]
        loss.backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer rounds")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    for name in ("vocab-size", "d-model", "n-layer", "n-head", "seq-len", "batch-size",
                 "steps", "rounds", "warmup"):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, help="override the preset")
    parser.add_argument("--n-kv-head", type=int, help="reference KV heads (default: n_head)")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument("--peak-tflops", type=float, help="device peak, for MFU")
    args = parser.parse_args()

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    shape = dict(PRESETS[(device.type, args.quick)])
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    n_kv_head = args.n_kv_head or shape["n_head"]
    use_bf16 = device.type == "cuda"

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else nullcontext()

    torch.manual_seed(0)
    models: dict[str, nn.Module] = {
        "reference": ReferenceTransformer(
            vocab_size=shape["vocab_size"], max_seq_len=shape["seq_len"],
            n_layer=shape["n_layer"], n_head=shape["n_head"], n_kv_head=n_kv_head,
            d_model=shape["d_model"],
        ),
        "plain GPT-2": PlainGPT(
            shape["vocab_size"], shape["seq_len"], shape["n_layer"], shape["n_head"],
            shape["d_model"],
        ),
    }  # fmt: skip
    input_ids = torch.randint(0, shape["vocab_size"], (shape["batch_size"], shape["seq_len"]))
    labels = torch.roll(input_ids, -1, dims=1)
    input_ids, labels = input_ids.to(device), labels.to(device)

    steps = {}
    for name, model in models.items():
        model.to(device).train()
        runnable = torch.compile(model) if args.compile else model
        steps[name] = make_step(runnable, input_ids, labels, autocast)
        time_steps(steps[name], shape["warmup"], device)

    tokens_per_step = shape["batch_size"] * shape["seq_len"]
    rates: dict[str, list[float]] = {name: [] for name in models}
    peak_mem: dict[str, float] = {}
    for _ in range(shape["rounds"]):
        for name in models:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds = time_steps(steps[name], shape["steps"], device)
            rates[name].append(shape["steps"] * tokens_per_step / seconds)
            if device.type == "cuda":
                peak_mem[name] = torch.cuda.max_memory_allocated(device) / 2**20

    peak = peak_tflops(device, args.peak_tflops)
    print(
        f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f", threads {torch.get_num_threads()}, {'bf16 autocast' if use_bf16 else 'fp32'}"
        + (", compiled" if args.compile else "")
    )
    print(
        f"shape: vocab {shape['vocab_size']}, d_model {shape['d_model']}, "
        f"n_layer {shape['n_layer']}, n_head {shape['n_head']}, n_kv_head {n_kv_head}, "
        f"seq {shape['seq_len']}, batch {shape['batch_size']}; "
        f"best of {shape['rounds']} rounds x {shape['steps']} steps"
    )
    header = f"{'model':<14}{'params':>12}{'tokens/s':>12}{'ms/step':>10}"
    if peak is not None:
        header += f"{'MFU':>8}"
    if peak_mem:
        header += f"{'peak MiB':>10}"
    print(header)
    best = {}
    for name, model in models.items():
        best[name] = max(rates[name])
        params = sum(p.numel() for p in model.parameters())
        row = (
            f"{name:<14}{params:>12,}{best[name]:>12,.0f}"
            f"{1e3 * tokens_per_step / best[name]:>10.1f}"
        )
        if peak is not None:
            flops = flops_per_token(model, shape["n_layer"], shape["d_model"], shape["seq_len"])
            row += f"{flops * best[name] / (peak * 1e12):>8.1%}"
        if peak_mem:
            row += f"{peak_mem[name]:>10,.0f}"
        print(row)
    ratio = best["reference"] / best["plain GPT-2"]
    print(f"ratio reference / plain GPT-2 tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
