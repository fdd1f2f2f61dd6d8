"""The ``speedtronic`` command: ``train``, ``validate``, ``plugins`` and plugin subcommands.

User errors (a bad config, a missing file, a bad override, an unusable environment) print one
``error: ...`` line and exit 2; ``--debug`` shows the traceback instead. Anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from speedtronic import __version__
from speedtronic.cli.options import add_config_flag, add_set_option, load_config
from speedtronic.config import SpeedtronicConfig
from speedtronic.errors import PluginError, SpeedtronicError
from speedtronic.observe.threads import AUTO, auto_threads

__all__ = [
    "EXIT_USER_ERROR",
    "GLOBAL_FLAGS",
    "add_config_flag",
    "add_set_option",
    "build_parser",
    "cmd_plugins",
    "cmd_train",
    "cmd_validate",
    "load_config",
    "load_plugin_modules",
    "main",
    "step_window",
]

log = logging.getLogger("speedtronic.cli")

EXIT_USER_ERROR = 2
# How long `--nproc-per-node`'s launcher waits for signalled ranks to save and exit before it
# kills them (torchrun's own default is 30 s, short for a large checkpoint).
LAUNCHER_SHUTDOWN_S = 300
_LAUNCHER = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def cmd_train(args: argparse.Namespace) -> int:
    """``speedtronic train``: validate, build and run; print a one-line summary."""
    from speedtronic.cli.launcher import die_with_launcher

    die_with_launcher()  # a rank of `--nproc-per-node`: never outlive the launcher
    config = load_config(args)  # before importing torch: a config error should be instant
    from speedtronic.engine.preflight import check_before_building

    check_before_building(config)  # so are errors the config and its files decide alone
    if getattr(args, "nproc_per_node", None) and "WORLD_SIZE" not in os.environ:
        return _launch_ranks(args.nproc_per_node, config, args.argv)
    from speedtronic.engine.runtime import train_from_config

    try:
        result = train_from_config(config)
        # Stopped cleanly by a signal, with a checkpoint at the last step: "did not finish"
        # (128 + N), so a scheduler may requeue the run.
        interrupted = None if result.stop_signal is None else 128 + result.stop_signal
    except KeyboardInterrupt:  # a second Ctrl-C, or SIGINT left out of run.stop_signals
        interrupted = 130
    if interrupted is not None:
        if os.environ.get("RANK", "0") == "0":
            print(f"interrupted; {_resume_advice(config)}", file=sys.stderr)
        return interrupted
    loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
    resumed = f" (resumed from step {result.resumed_from})" if result.resumed_from else ""
    steps = f"{result.steps} step{'' if result.steps == 1 else 's'}"
    if os.environ.get("RANK", "0") == "0":  # under DDP, rank 0 reports for the run
        print(f"done: {steps}{resumed}, final loss {loss}, {result.elapsed_s:.1f}s")
    return 0


def _resume_advice(config: SpeedtronicConfig) -> str:
    """Where an interrupted run can continue from, as the line after ``interrupted``."""
    from speedtronic.checkpoint.names import existing_checkpoints

    saved = existing_checkpoints(config.checkpoint_dir)
    if not saved:
        return f"no checkpoint was saved in {config.checkpoint_dir}: a new run starts from step 0"
    return (
        f"the newest checkpoint is {saved[0]}: continue from it with the same command and --resume"
    )


def _launch_ranks(nproc: int, config: SpeedtronicConfig, argv: Sequence[str]) -> int:
    """Start ``nproc`` ranks of this same command through torch's elastic launcher (what
    ``torchrun --standalone --nproc-per-node N -m speedtronic train ...`` does)."""
    if nproc < 1:
        raise SpeedtronicError(f"--nproc-per-node must be >= 1, got {nproc}")
    if config.parallel.strategy == "none":
        raise SpeedtronicError("--nproc-per-node needs parallel.strategy auto or ddp, not none")
    if config.run.threads == AUTO and "OMP_NUM_THREADS" not in os.environ:
        # torchrun would give every rank one thread; auto shares the cores between the ranks.
        ranks = {**os.environ, "LOCAL_WORLD_SIZE": str(nproc)}
        os.environ["OMP_NUM_THREADS"] = str(auto_threads(ranks))
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    passed: list[str] = []
    skip = False
    for arg in argv:  # the same command line, less --nproc-per-node
        if skip:
            skip = False
            continue
        if arg == "--nproc-per-node":
            skip = True
            continue
        if arg.startswith("--nproc-per-node="):
            continue
        passed.append(arg)
    from speedtronic.cli.launcher import LAUNCHER_PID_ENV

    # The ranks die with this process (speedtronic.cli.launcher), even when it is SIGKILLed.
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    # The launcher forwards these to the ranks (its own list lacks SIGUSR1) and then gives
    # them time to write their checkpoint before it kills them.
    stop = config.run.stop_signals
    handled = [*_LAUNCHER, *(name for name in stop if name not in _LAUNCHER)]
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(handled)
    launch = ["--standalone", "--nproc-per-node", str(nproc)]
    launch += ["--shutdown-timeout", str(LAUNCHER_SHUTDOWN_S)]
    try:
        torchrun([*launch, "-m", "speedtronic", *passed])
    except SignalException as exc:
        # The ranks got the signal from the launcher, saved and exited; so does the launcher.
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        codes = {f.exitcode for f in exc.failures.values()}
        stopped = {128 + int(getattr(signal, name)) for name in stop}
        if len(codes) == 1 and codes <= stopped:  # every rank was signalled and stopped
            return codes.pop()
        failures = ", ".join(f"rank {rank}: exit {f.exitcode}" for rank, f in exc.failures.items())
        raise SpeedtronicError(f"a rank failed ({failures}); see its error above") from None
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """``speedtronic validate``: check that the run would build (model on the meta device, its
    data against it) and print the resolved config with secrets redacted."""
    config = load_config(args)
    if not args.config_only:
        from speedtronic.engine.runtime import check_runtime
        from speedtronic.observe.threads import apply_threads
        from speedtronic.parallel.context import launched_world_size

        apply_threads(config.run.threads)
        world = args.nproc_per_node or launched_world_size()
        if world < 1:
            raise SpeedtronicError(f"--nproc-per-node must be >= 1, got {world}")
        log.info("checked: %s", check_runtime(config, world))
    if args.format == "json":
        print(config.to_json(redact=True))
    else:
        print(config.to_yaml(redact=True), end="")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    """``speedtronic plugins``: what the plugin manager discovered."""
    from speedtronic.plugins import list_plugins

    rows = list_plugins()
    if args.format == "json":
        print(json.dumps([row.__dict__ for row in rows], indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="speedtronic plugins")
    for column in ("plugin", "distribution", "version", "provides", "hooks"):
        table.add_column(column, overflow="fold")
    for row in rows:
        hooks = escape(", ".join(row.hooks))
        if row.error:
            hooks = f"[red]failed to load: {escape(row.error)}[/red]"
        table.add_row(
            escape(row.name),
            escape(row.distribution),
            escape(row.version),
            escape(", ".join(row.provides)),
            hooks,
        )
    # Wide enough that a pipe or a narrow terminal does not truncate names mid-word.
    Console(width=max(120, Console().width)).print(table)
    return 0


def _add_plugin_commands(sub: argparse._SubParsersAction) -> None:
    from speedtronic.plugins import call_each, get_plugin_manager

    def lose_commands(plugin_name: str, exc: Exception) -> None:
        # A plugin that breaks here loses its commands, not the CLI.
        log.warning(
            "plugin %r could not add its commands (%s: %s)", plugin_name, type(exc).__name__, exc
        )

    call_each(get_plugin_manager().hook.register_commands, {"subparsers": sub}, lose_commands)


def step_window(text: str) -> tuple[int, int]:
    """``START:END`` (or one step ``N``) as a pair of optimizer steps, for ``--profile``."""
    start_text, sep, end_text = text.partition(":")
    try:
        start = int(start_text)
        end = int(end_text) if sep else start
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END steps, got {text!r}") from None
    if start < 1 or end < start:
        raise argparse.ArgumentTypeError(f"expected 1 <= START <= END, got {text!r}")
    return start, end


def build_parser() -> argparse.ArgumentParser:
    """The full parser, including the subcommands plugins add."""
    parser = argparse.ArgumentParser(prog="speedtronic", description="Be fast, be efficient.")
    parser.add_argument("--version", action="version", version=f"speedtronic {__version__}")
    for flag, options in GLOBAL_FLAGS.items():
        parser.add_argument(flag, **options)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser("train", help="train from a config file")
    train.add_argument("--config", "-c", required=True, help="YAML or JSON config file")
    train.add_argument("--max-steps", type=int, help="override run.max_steps")
    train.add_argument("--output-dir", help="override run.output_dir")
    train.add_argument("--resume", action="store_true", help="resume from the newest checkpoint")
    train.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="data parallel on this machine: start N ranks (DDP) through torch's elastic "
        "launcher, as torchrun does",
    )
    train.add_argument(
        "--profile",
        type=step_window,
        metavar="START:END",
        help="profile optimizer steps START to END (inclusive) with torch.profiler: a Chrome "
        "trace in <output_dir>/profile/ and the top operators logged (profile.start/end)",
    )
    add_set_option(train)
    train.set_defaults(handler=cmd_train)

    validate = sub.add_parser("validate", help="check a config and print it resolved")
    validate.add_argument("--config", "-c", required=True, help="YAML or JSON config file")
    validate.add_argument(
        "--format", choices=("yaml", "json"), default="yaml", help="output format (default yaml)"
    )
    validate.add_argument(
        "--config-only",
        action="store_true",
        help="check the config file alone, without building the model (meta device) and data",
    )
    validate.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="the ranks to estimate per-rank memory for (ddp vs fsdp); default WORLD_SIZE or 1",
    )
    add_set_option(validate)
    validate.set_defaults(handler=cmd_validate)

    plugins = sub.add_parser("plugins", help="list discovered plugins and their hooks")
    plugins.add_argument(
        "--format", choices=("table", "json"), default="table", help="output format (default table)"
    )
    plugins.set_defaults(handler=cmd_plugins)

    from speedtronic.data.prepare_cli import add_data_commands

    add_data_commands(sub)  # `speedtronic data prepare`
    from speedtronic.cli.eval import add_eval_command

    add_eval_command(sub)  # `speedtronic eval`
    from speedtronic.cli.export import add_model_commands

    add_model_commands(sub)  # `speedtronic export`, `speedtronic generate`
    from speedtronic.cli.plot import add_plot_command

    add_plot_command(sub)  # `speedtronic plot`
    _add_plugin_commands(sub)
    # `--debug` and `--plugin` are also accepted after the command name, plugin commands and
    # nested ones (`speedtronic diloco status --debug`) included: main() reads --plugin before
    # the parser exists, so plugin modules can add commands.
    for command in _all_commands(sub):
        for flag, options in GLOBAL_FLAGS.items():
            try:
                command.add_argument(flag, default=argparse.SUPPRESS, **options)
            except argparse.ArgumentError:
                pass  # the plugin defined its own flag of that name
    return parser


def _all_commands(sub: argparse._SubParsersAction) -> Iterator[argparse.ArgumentParser]:
    """Every parser below ``sub``: its commands and, recursively, their own sub-commands."""
    for command in dict.fromkeys(sub.choices.values()):  # aliases share one parser
        yield command
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                yield from _all_commands(action)


GLOBAL_FLAGS: dict[str, dict[str, Any]] = {
    "--debug": {"action": "store_true", "help": "show tracebacks and debug logs"},
    "--plugin": {
        "action": "append",
        "metavar": "MODULE",
        "help": "import MODULE first (repeatable): its @register_model models and hook "
        "implementations are used as if it were an installed plugin",
    },
}


def load_plugin_modules(argv: Sequence[str]) -> None:
    """Import every ``--plugin MODULE`` of ``argv`` and register those that implement hooks.

    Runs before the parser is built, so a module's commands and config sections exist."""
    import importlib

    from speedtronic import plugins

    names = [
        value
        for flag, value in zip(argv, [*argv[1:], ""])
        if flag == "--plugin" and value and not value.startswith("-")
    ] + [arg.split("=", 1)[1] for arg in argv if arg.startswith("--plugin=")]
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise PluginError(f"--plugin {name}: cannot import it ({exc})") from None
        except Exception as exc:
            raise PluginError(
                f"--plugin {name}: importing it failed ({type(exc).__name__}: {exc})"
            ) from None
        marked = any(hasattr(getattr(module, attr), "speedtronic_impl") for attr in dir(module))
        if marked and not plugins.pm.is_registered(module):
            plugins.register(module, name=name, distribution=f"--plugin {name}")


@contextmanager
def _cli_logging(debug: bool) -> Iterator[None]:
    """Send ``speedtronic.*`` logs to stderr for the duration of one command, then restore."""
    root = logging.getLogger("speedtronic")
    saved = (root.level, root.propagate)
    handler: logging.Handler
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        # Console(stderr=True) looks sys.stderr up at every write, so while a progress bar is
        # live (it redirects sys.stderr) log records are printed above the bar, not into it.
        handler = RichHandler(console=Console(stderr=True), show_path=False, rich_tracebacks=debug)
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    root.propagate = False
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        root.propagate = saved[1]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``speedtronic`` console script and ``python -m speedtronic``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    with _cli_logging(debug):
        try:
            load_plugin_modules(argv)
            parser = build_parser()
            args = parser.parse_args(argv)
            args.argv = argv  # the command line as given (--nproc-per-node relaunches it)
            if not getattr(args, "handler", None):
                parser.print_help()
                return EXIT_USER_ERROR
            return int(args.handler(args) or 0)
        except (SpeedtronicError, OSError) as exc:
            if isinstance(exc, BrokenPipeError):
                return _broken_pipe()
            if debug:
                raise
            print(f"error: {_one_line(exc)}", file=sys.stderr)
            # A SpeedtronicError may name its own documented status (else 2).
            status = getattr(exc, "exit_code", EXIT_USER_ERROR)
            return status if isinstance(status, int) and 0 < status < 126 else EXIT_USER_ERROR
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, SpeedtronicError) else f"{type(exc).__name__}: {text}"


def _broken_pipe() -> int:
    # The reader went away (`speedtronic validate ... | head`): stop quietly, and keep Python
    # from failing again while flushing stdout at exit.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141
