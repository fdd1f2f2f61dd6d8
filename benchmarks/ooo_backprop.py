"""Step time of ``Trainer.fit`` with and without out-of-order backprop (``ooo_backprop``).

Both sides train the same reference transformer (built from the same config and seed, so the
same initial weights) on the same synthetic stream with the same optimizer; the only difference
is ``ooo_backprop.enabled``. Both run eagerly: out-of-order backprop excludes ``torch.compile``,
so a config that enables compile (``configs/reference-small.yaml`` does) is run without it on
both sides. Runs are interleaved in rounds, alternating which side goes first; results are
medians over rounds, of wall-clock time and of this process's CPU time. Both sides must end on
the same loss (on CPU exactly: the same products, only in another order of launch).

On CPU the deferred products run in order on the same device (the option's fallback), so the
expected ratio is about 1.0: the figure shows what the swap itself costs. A second measurement
gives that cost per layer call directly: forward + backward + drain of a stack of tiny linears,
whose own compute is next to nothing, with and without the swap. On CUDA (``stream:
side``) the script also reports the peak memory of each side and a short ``torch.profiler``
trace of the ooo side: the kernels per CUDA stream and how much of the side stream's kernel
time overlapped kernels on the main stream.

    python benchmarks/ooo_backprop.py --quick                      # CPU, under a minute
    python benchmarks/ooo_backprop.py                              # the CPU figure in engine.md
    python benchmarks/ooo_backprop.py --config configs/reference-small.yaml --device cuda \\
        --precision bf16                                           # the CUDA measurement
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from results import emit

from speedtronic import SpeedtronicConfig
from speedtronic.engine.runtime import build_runtime

# A CPU-sized reference transformer (about 0.1 s per optimizer step on one thread), with two
# micro-batches per step so that the per-micro-batch flush and the final drain both run.
CPU_CONFIG: dict[str, Any] = {
    "run": {"name": "ooo-bench", "seed": 0},
    "model": {
        "name": "reference_transformer",
        "vocab_size": 2048,
        "max_seq_len": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_kv_head": 2,
        "d_model": 128,
    },
    "data": {"micro_batch_size": 8, "target_batch_size": 16},
    "optimizer": {"lr": 1e-3, "weight_decay": 0.1, "grad_clip": 1.0},
    "scheduler": {"name": "cosine", "warmup_steps": 5, "min_lr_ratio": 0.1},
}
PRESETS = {True: (10, 3), False: (20, 9)}  # --quick: (steps per run, rounds)
PROFILE_STEPS = 3


def make_config(
    args: argparse.Namespace, enabled: bool, steps: int, out: Path
) -> SpeedtronicConfig:
    """The run of one side: the base config with the benchmark's fixed overrides."""
    base = SpeedtronicConfig.from_file(args.config).to_dict() if args.config else CPU_CONFIG
    overrides = {
        "run.device": args.device,
        "run.max_steps": steps,
        "run.output_dir": str(out),
        "compile.enabled": False,  # excluded by ooo_backprop: both sides eager
        "ooo_backprop.enabled": enabled,
        "ooo_backprop.stream": args.stream,
        "checkpoint.interval": 0,
        "checkpoint.save_final": False,
        "logging.log_every": steps,  # one loss read per run: no host sync per step
        "logging.level": "WARNING",
        "logging.progress": False,
        # Worker processes would start inside every timed run; the built-in synthetic stream
        # is iterated directly without them.
        "data.num_workers": 0,
        "data.pin_memory": False,
    }
    if args.precision:
        overrides["precision.mode"] = args.precision
    return SpeedtronicConfig.from_dict(base).with_overrides(overrides)


@contextmanager
def no_gc() -> Iterator[None]:
    """Collect first and pause the cyclic collector while timing (as ``timeit`` does)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_run(config: SpeedtronicConfig) -> dict[str, Any]:
    """One ``fit``: wall and CPU seconds, the final loss, peak CUDA memory."""
    runtime = build_runtime(config, console=False)
    trainer = runtime.trainer
    device = trainer.device
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with no_gc():
        wall, cpu = time.perf_counter(), time.process_time()
        result = trainer.fit()
        synchronize(device)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {
        "wall": wall,
        "cpu": cpu,
        "loss": float(result.final_loss),
        "peak_mb": peak,
        "device": device,
        "precision": trainer.precision.mode,
        "mode": trainer.ooo_backprop.mode if trainer.ooo_backprop is not None else None,
        "linears": len(trainer.ooo_backprop.modules) if trainer.ooo_backprop is not None else 0,
    }


def fixed_cost(device: torch.device, layers: int = 16, reps: int = 300) -> dict[str, float]:
    """Microseconds per ``nn.Linear`` call (forward + backward + drain) that the swap adds,
    on a stack of 8x8 linears: medians over interleaved repetitions."""
    import copy

    from torch import nn

    from speedtronic.engine.ooo_backprop import OOOBackprop

    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)]).to(device)
    swapped = copy.deepcopy(plain)
    queue = OOOBackprop(device, "side" if device.type == "cuda" else "same")
    queue.install(swapped)
    x = torch.randn(4, 8, device=device, requires_grad=True)

    # CPU time of this process on a CPU (what the docs quote); wall-clock time on CUDA.
    clock = time.perf_counter if device.type == "cuda" else time.process_time

    def once(model: nn.Module) -> float:
        model.zero_grad(set_to_none=True)
        synchronize(device)
        start = clock()
        model(x).sum().backward()
        queue.drain()
        synchronize(device)
        return clock() - start

    for _ in range(20):
        once(plain), once(swapped)
    times: dict[bool, list[float]] = {False: [], True: []}
    with no_gc():
        for index in range(reps):
            for swap in (False, True) if index % 2 == 0 else (True, False):
                times[swap].append(once(swapped if swap else plain))
    base, ooo = statistics.median(times[False]), statistics.median(times[True])
    # The spread: the same figure over 5 consecutive blocks of the repetitions.
    block = reps // 5
    per_block = [
        (
            statistics.median(times[True][i : i + block])
            - statistics.median(times[False][i : i + block])
        )
        / layers
        * 1e6
        for i in range(0, block * 5, block)
    ]
    return {
        "plain_us": base * 1e6,
        "ooo_us": ooo * 1e6,
        "per_call_us": (ooo - base) / layers * 1e6,
        "per_call_blocks_us": per_block,
        "clock": "wall-clock" if device.type == "cuda" else "CPU",
    }


# ---------------------------------------------------------------------------- profiler
def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_streams(trace_file: Path) -> dict[int, dict[str, Any]]:
    """Per CUDA stream of a chrome trace: kernel count, busy intervals and top kernel names."""
    events = json.loads(trace_file.read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    streams: dict[int, dict[str, Any]] = {}
    for event in events:
        if event.get("ph") != "X" or event.get("cat") != "kernel":
            continue
        stream = int(event.get("args", {}).get("stream", -1))
        entry = streams.setdefault(stream, {"kernels": 0, "intervals": [], "names": {}})
        entry["kernels"] += 1
        start = float(event["ts"])
        entry["intervals"].append((start, start + float(event.get("dur", 0.0))))
        name = str(event.get("name", "?"))[:60]
        entry["names"][name] = entry["names"].get(name, 0) + 1
    for entry in streams.values():
        entry["intervals"] = _merged(entry["intervals"])
        entry["busy_us"] = sum(end - start for start, end in entry["intervals"])
    return streams


def profile_overlap(config: SpeedtronicConfig) -> dict[str, Any]:
    """A short profiled ooo run: which streams ran kernels, and how much side-stream kernel
    time overlapped main-stream kernels."""
    from torch.profiler import ProfilerActivity, profile

    runtime = build_runtime(config, console=False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runtime.trainer.fit()
        synchronize(runtime.trainer.device)
    trace = Path(tempfile.mkdtemp(prefix="ooo-trace-")) / "trace.json"
    prof.export_chrome_trace(str(trace))
    streams = kernel_streams(trace)
    if not streams:
        return {"trace": str(trace), "streams": {}, "overlap_fraction": None}
    # The main stream runs the forward, dX and the optimizer: the one with most kernels.
    main = max(streams, key=lambda s: streams[s]["kernels"])
    side_busy = sum(e["busy_us"] for s, e in streams.items() if s != main)
    overlapped = sum(
        _overlap(e["intervals"], streams[main]["intervals"])
        for s, e in streams.items()
        if s != main
    )
    return {
        "trace": str(trace),
        "main_stream": main,
        "streams": {
            s: {
                "kernels": e["kernels"],
                "busy_ms": e["busy_us"] / 1e3,
                "top": sorted(e["names"].items(), key=lambda kv: -kv[1])[:3],
            }
            for s, e in streams.items()
        },
        "side_busy_ms": side_busy / 1e3,
        "overlapped_ms": overlapped / 1e3,
        "overlap_fraction": overlapped / side_busy if side_busy else None,
    }


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a run config (default: a CPU-sized reference model)")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda", "mps"])
    parser.add_argument(
        "--precision", choices=["auto", "bf16", "fp16", "fp32"], help="default: the config's"
    )
    parser.add_argument("--stream", default="side", choices=["side", "same"])
    parser.add_argument("--steps", type=int, help="optimizer steps per timed run")
    parser.add_argument("--rounds", type=int, help="interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--no-profile", action="store_true", help="skip the CUDA trace")
    args = parser.parse_args(argv)
    steps, rounds = PRESETS[args.quick]
    steps, rounds = args.steps or steps, args.rounds or rounds
    torch.set_num_threads(args.threads)
    logging.getLogger("speedtronic").setLevel(logging.ERROR)
    out = Path(tempfile.mkdtemp(prefix="ooo-bench-"))

    def config(enabled: bool, n: int = steps) -> SpeedtronicConfig:
        return make_config(args, enabled, n, out / ("ooo" if enabled else "plain"))

    # Warm both sides up (allocator, lazy imports, cuBLAS handles) outside the timings.
    warm = {enabled: timed_run(config(enabled, 2)) for enabled in (False, True)}
    info = warm[True]
    print(
        f"torch {torch.__version__}, device {info['device']}, precision {info['precision']}, "
        f"{args.threads} thread(s); ooo_backprop: {info['linears']} nn.Linear layers, "
        f"{info['mode']} stream (stream: {args.stream} asked)"
    )
    print(
        f"config: {args.config or 'built-in CPU reference'}; {steps} steps per run, {rounds} rounds"
    )
    print(
        f"{'round':>5} {'plain wall':>10} {'ooo wall':>9} {'ratio':>6}   "
        f"{'plain cpu':>9} {'ooo cpu':>8} {'ratio':>6}"
    )
    rows = []
    for index in range(rounds):
        order = (False, True) if index % 2 == 0 else (True, False)
        got = {enabled: timed_run(config(enabled)) for enabled in order}
        plain, ooo = got[False], got[True]
        rows.append((plain, ooo))
        print(
            f"{index:>5} {plain['wall'] / steps * 1e3:>10.2f} {ooo['wall'] / steps * 1e3:>9.2f} "
            f"{ooo['wall'] / plain['wall']:>6.3f}   {plain['cpu'] / steps * 1e3:>9.2f} "
            f"{ooo['cpu'] / steps * 1e3:>8.2f} {ooo['cpu'] / plain['cpu']:>6.3f}"
        )
    losses = (rows[-1][0]["loss"], rows[-1][1]["loss"])
    cpu_ratios = [o["cpu"] / p["cpu"] for p, o in rows]
    quartiles = statistics.quantiles(cpu_ratios, n=4) if len(rows) > 1 else [cpu_ratios[0]] * 3
    result: dict[str, Any] = {
        "device": str(info["device"]),
        "precision": info["precision"],
        "mode": info["mode"],
        "plain_wall_ms": statistics.median(p["wall"] for p, _ in rows) / steps * 1e3,
        "ooo_wall_ms": statistics.median(o["wall"] for _, o in rows) / steps * 1e3,
        "wall_ratio": statistics.median(o["wall"] / p["wall"] for p, o in rows),
        "cpu_ratio": statistics.median(cpu_ratios),
        "cpu_ratio_q1": quartiles[0],
        "cpu_ratio_q3": quartiles[2],
        "plain_cpu_ms": statistics.median(p["cpu"] for p, _ in rows) / steps * 1e3,
        "final_loss": losses,
    }
    print("\nsummary")
    print(
        f"  ooo/plain median ratio: wall {result['wall_ratio']:.3f} "
        f"({result['plain_wall_ms']:.1f} -> {result['ooo_wall_ms']:.1f} ms/step), "
        f"CPU {result['cpu_ratio']:.3f} (rounds' interquartile range "
        f"{result['cpu_ratio_q1']:.3f}..{result['cpu_ratio_q3']:.3f})"
    )
    same = "identical" if losses[0] == losses[1] else f"differ by {abs(losses[0] - losses[1]):.2e}"
    print(f"  final loss: plain {losses[0]:.6f}, ooo {losses[1]:.6f} ({same})")
    cost = fixed_cost(info["device"])
    result["fixed_cost"] = cost
    blocks = cost["per_call_blocks_us"]
    print(
        f"  fixed cost: {cost['per_call_us']:+.1f} us of {cost['clock']} time per nn.Linear call "
        f"(forward + backward + drain; 16 tiny linears: {cost['plain_us']:.0f} -> "
        f"{cost['ooo_us']:.0f} us; blocks of repetitions {min(blocks):+.1f} .. {max(blocks):+.1f})"
    )
    threads = f"{args.threads} thread(s)"
    emit(
        "ooo_backprop.cpu_ratio",
        cpu_ratios,
        unit="x",
        method=f"CPU time, {rounds} interleaved rounds of {steps} steps, {threads}",
        label="Trainer.fit step CPU time, ooo_backprop on / off",
    )
    emit(
        "ooo_backprop.per_call",
        blocks,
        unit="us",
        method=f"{cost['clock']} time, median of 300 interleaved repetitions per block, 5 blocks, "
        + threads,
        label="added cost per nn.Linear call (forward + backward + drain)",
    )
    if info["device"].type == "cuda":
        result["plain_peak_mb"] = max(p["peak_mb"] for p, _ in rows)
        result["ooo_peak_mb"] = max(o["peak_mb"] for _, o in rows)
        print(
            f"  peak CUDA memory: plain {result['plain_peak_mb']:.0f} MiB, "
            f"ooo {result['ooo_peak_mb']:.0f} MiB"
        )
        if not args.no_profile:
            trace = profile_overlap(config(True, PROFILE_STEPS))
            result["profile"] = trace
            print(f"  profiler ({PROFILE_STEPS} ooo steps, trace {trace['trace']}):")
            for stream, entry in trace["streams"].items():
                role = "main" if stream == trace.get("main_stream") else "side"
                print(
                    f"    stream {stream} ({role}): {entry['kernels']} kernels, "
                    f"{entry['busy_ms']:.1f} ms busy; top {entry['top']}"
                )
            if trace["overlap_fraction"] is None:
                print("    no kernel ran off the main stream: nothing overlapped")
            else:
                print(
                    f"    side-stream kernels overlapped main-stream kernels for "
                    f"{trace['overlapped_ms']:.1f} of {trace['side_busy_ms']:.1f} ms "
                    f"({trace['overlap_fraction']:.0%})"
                )
    return result


if __name__ == "__main__":
    main()
