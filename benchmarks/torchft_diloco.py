"""torchft's synchronous DiLoCo on the same model, data, H, optimizers and steps as
``benchmarks/diloco_quality.py``, so the shipped DumbDiLoCo can be compared with it.

N replica processes each build the run of the user's config (``configs/diloco.yaml`` without
its ``distributed`` section; the same prepared shards, batch, eval windows and inner AdamW
as the quality benchmark, through speedtronic's own ``build_runtime``) and train it under
``torchft.local_sgd.DiLoCo``: a local lighthouse, one torchft ``Manager`` and gloo process group
per replica, the outer optimizer ``SGD(lr=outer_lr, momentum=outer_momentum, nesterov=True)``
(the config's values unless overridden) and ``sync_every = H``. Every replica reads its own
order of the training windows, keyed by its name exactly as a DumbDiLoCo node with that id
would (``master``, ``worker-1``, ...), or disjoint slices with ``--node-data ranked``.

Replica 0 scores the global (its weights right after each synchronisation, when every replica
holds the same averaged model) on the first ``--eval-batches`` held-out micro-batches every H
steps and prints the final held-out loss; ``--json`` writes the curve. Needs
``pip install torchft==0.2.0 -c constraints-cpu.txt``.

``--corpus`` takes one or more text files or prepared shard directories (default: both corpora
of ``benchmarks/data/``, as ``diloco_quality.py --matrix``); each gets its ``RESULT`` row
``torchft_diloco.<corpus>.together.final_global``, beside the quality matrix's
``diloco_quality.<corpus>.together.<mode>.final_global`` (every replica starts at once: the
"together" condition).

    python benchmarks/torchft_diloco.py --quick
    python benchmarks/torchft_diloco.py --nodes 3 --inner-steps 25 --steps 600 --json tf.json
    python benchmarks/torchft_diloco.py --nodes 3 --inner-steps 25 --steps 600 --seeds 0,1,2

A run is deterministic for one torch build, thread count and seed (the same curve to the last
digit at any load), but the early plateau of this byte-level model (held-out loss about 3.1
for the first rounds) makes the final loss sensitive to tiny numerical differences: when the
global leaves the plateau decides most of where it ends after 600 steps. ``--seeds`` runs
once per seed and prints (and emits as a ``RESULT`` line for ``run_all.py``) the spread.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import diloco_quality as quality  # the same corpus, config and eval windows
from results import emit

QUICK = {"nodes": 3, "inner_steps": 10, "steps": 100, "eval_batches": 8}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3, help="replicas")
    parser.add_argument("--inner-steps", type=int, default=25, help="H (sync_every)")
    parser.add_argument("--steps", type=int, default=600, help="inner steps per replica")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch per replica")
    parser.add_argument("--eval-batches", type=int, default=32, help="held-out micro-batches")
    parser.add_argument("--seed", type=int, default=0, help="run.seed of every replica")
    parser.add_argument(
        "--seeds",
        type=lambda text: [int(x) for x in text.split(",") if x.strip()],
        default=None,
        metavar="S1,S2,...",
        help="one run per seed (instead of --seed): the spread of the final global over seeds",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--outer-lr", type=float, default=None, help="default: the config's")
    parser.add_argument("--outer-momentum", type=float, default=None, help="default: the config's")
    parser.add_argument("--node-data", choices=("auto", "ranked"), default="auto")
    parser.add_argument(
        "--corpus",
        type=Path,
        nargs="+",
        default=list(quality.CORPORA),
        help="text files or prepared shard directories (default: benchmarks/data/'s corpora)",
    )
    parser.add_argument("--config", type=Path, default=quality.DEMO_CONFIG)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the shards here")
    parser.add_argument("--quick", action="store_true", help=f"small preset: {QUICK}")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    return args


def replica(
    index: int,
    args: argparse.Namespace,
    config: dict[str, Any],
    lighthouse: str,
    out: Any,
) -> None:
    """One torchft replica: speedtronic's model, data and inner optimizer under DiLoCo."""
    import torch
    import torch.distributed as dist
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from speedtronic.config import SpeedtronicConfig
    from speedtronic.data import build_dataloader
    from speedtronic.engine.batch import call_model, loss_of
    from speedtronic.engine.runtime import build_runtime
    from speedtronic_diloco.identity import node_data_seed

    torch.set_num_threads(args.threads)
    runtime = build_runtime(config, console=False)  # seeds like `speedtronic train`
    runtime.metrics.close()
    model, optimizer = runtime.model, runtime.trainer.optimizer
    evaluator = runtime.trainer.evaluator
    loaded = SpeedtronicConfig.load(config)
    name = "master" if index == 0 else f"worker-{index}"
    limits = {
        "seq_len": config["model"]["max_seq_len"],
        "vocab_size": config["model"]["vocab_size"],
    }
    if args.node_data == "ranked":
        data = build_dataloader(loaded, **limits, rank=index, num_ranks=args.nodes)
    else:
        data = build_dataloader(
            loaded, **limits, participant_seed=node_data_seed(loaded.data_seed, name)
        )
    batches = data.iterate(0)
    outer = torch.optim.SGD(
        model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True
    )
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    long = timedelta(seconds=600)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=long),
        min_replica_size=args.nodes,
        use_async_quorum=False,
        load_state_dict=lambda state: model.load_state_dict(state["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        replica_id=name,
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=long,
        quorum_timeout=long,
        connect_timeout=long,
    )
    curve: dict[int, float] = {}
    clip = loaded.optimizer.grad_clip
    started = time.monotonic()
    try:
        with DiLoCo(
            manager,
            [model],
            optimizer,
            outer,
            sync_every=args.inner_steps,
            backup_device=torch.device("cpu"),
            pin_memory=False,
        ):
            for step in range(1, args.steps + 1):
                loss = loss_of(call_model(model, next(batches)))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()  # DiLoCo's hook synchronises every sync_every steps
                if index == 0 and step % args.inner_steps == 0:
                    curve[step] = evaluator.evaluate(model, step).loss
                    print(f"replica 0 step {step}: global held-out loss {curve[step]:.3f}")
    finally:
        manager.shutdown(wait=False)
    own = evaluator.evaluate(model, args.steps).loss
    out.put({"index": index, "curve": curve, "own": own, "wall_s": time.monotonic() - started})


def run_seed(args: argparse.Namespace, corpus: Path, seed: int, root: Path) -> dict[str, Any]:
    """One torchft run of ``args`` on ``corpus`` with ``run.seed`` = ``seed``: replica 0's
    curve and more."""
    from torchft._torchft import LighthouseServer

    shards, vocab = quality.prepare_corpus(corpus, root / "shards")
    # The quality benchmark's config, with the fields it reads set as that script sets them.
    options = argparse.Namespace(
        **{**vars(args), "seed": seed, "rounds": None, "node_data": "auto"}
    )
    config = quality.base_config(options, shards, vocab, root)
    config["run"]["output_dir"] = str(root / "replica")
    config["checkpoint"] = {"save_final": False}
    # The replicas run plain speedtronic (no DumbDiLoCo): torchft synchronises them.
    section = config.pop("distributed")
    if args.outer_lr is None:
        args.outer_lr = section.get("outer_lr", 0.7)
    if args.outer_momentum is None:
        args.outer_momentum = section.get("outer_momentum", 0.9)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.nodes)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    load_before = quality.load_average()
    started = time.monotonic()
    processes = [
        context.Process(
            target=replica,
            args=(i, args, config, lighthouse.address(), results),
        )
        for i in range(args.nodes)
    ]
    for process in processes:
        process.start()
    collected = []
    deadline = time.monotonic() + args.timeout
    try:
        while len(collected) < args.nodes and time.monotonic() < deadline:
            try:
                collected.append(results.get(timeout=5))
            except Exception:  # queue.Empty: check that the replicas still run
                if all(not p.is_alive() for p in processes) and results.empty():
                    break
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        lighthouse.shutdown()
    if len(collected) < args.nodes:
        raise SystemExit(f"only {len(collected)} of {args.nodes} torchft replicas finished")
    first = next(r for r in collected if r["index"] == 0)
    curve = {int(k): v for k, v in first["curve"].items()}
    return {
        "seed": seed,
        "curve": curve,
        "final_global": curve[max(curve)],
        "replicas_own": {r["index"]: r["own"] for r in collected},
        "wall_s": time.monotonic() - started,
        "load_average": {"before": load_before, "end": quality.load_average()},
    }


def run_corpus_seed(
    args: argparse.Namespace, corpus: Path, seed: int, root: Path
) -> dict[str, Any]:
    """:func:`run_seed` in ``root`` (one per corpus: its shards), and its lines printed."""
    root.mkdir(parents=True, exist_ok=True)
    run = run_seed(args, corpus, seed, root)
    print(
        f"\ntorchft DiLoCo on {quality.corpus_name(corpus)}, {args.nodes} replicas, H "
        f"{args.inner_steps}, {args.steps} steps x batch {args.batch}, outer lr "
        f"{args.outer_lr}, Nesterov momentum {args.outer_momentum}, seed {seed}"
    )
    print(" ".join(f"{s}:{v:.3f}" for s, v in sorted(run["curve"].items())))
    print(
        f"final global held-out loss {run['final_global']:.3f}; wall {run['wall_s']:.0f} s; "
        f"load {run['load_average']['before']}",
        flush=True,
    )
    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torchft._torchft  # noqa: F401 - the lighthouse
    except ImportError as exc:
        raise SystemExit(
            f"torchft is not importable ({exc}); pip install torchft==0.2.0 -c constraints-cpu.txt"
        ) from None
    root = Path(args.workdir or tempfile.mkdtemp(prefix="torchft_diloco_")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    seeds = args.seeds or [args.seed]
    report: dict[str, Any] = {}
    for corpus in args.corpus:
        name = quality.corpus_name(corpus)
        runs = [run_corpus_seed(args, corpus, seed, root / name) for seed in seeds]
        finals = [run["final_global"] for run in runs]
        if len(runs) > 1:
            print(
                f"\n{name}: final global over seeds {seeds}: min {min(finals):.3f}, median "
                f"{statistics.median(finals):.3f}, max {max(finals):.3f}"
            )
        emit(
            f"torchft_diloco.{name}.together.final_global",
            finals,
            unit="nats",
            label=f"torchft 0.2.0 DiLoCo on {name}, {args.nodes} replicas, H "
            f"{args.inner_steps}, {args.steps} steps x batch {args.batch}: final global "
            "held-out loss",
            method=f"one run per seed ({', '.join(map(str, seeds))}), {args.threads} thread(s) "
            f"per replica, outer SGD lr {args.outer_lr} Nesterov {args.outer_momentum}",
        )
        report[name] = runs[0] if len(runs) == 1 else {"runs": runs}
    if args.json is not None:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        settings["corpus"] = [str(c) for c in args.corpus]
        args.json.write_text(json.dumps({"settings": settings, "corpora": report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
