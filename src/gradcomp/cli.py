"""The ``gradcomp`` command line: ``train``, ``bench``, ``sweep``, ``curves``, ``race``, ``list``, ``plan``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys

from gradcomp import errors
from gradcomp.allocator import keep_freed_memory
from gradcomp.errors import CommunicationError, ConfigError, GradcompError
from gradcomp.experiments.run.report import parse_seeds
from gradcomp.experiments.run.config import DEFAULT_TIMEOUT_S, launched_by_torchrun
from gradcomp.experiments.run.options import add_training_options, resolve_training_defaults
from gradcomp.registry import parse_param_strings


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except where there is none to show (flags, None, empty lists)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default, flag = action.default, action.nargs == 0  # a flag's "default" is only its resting state
        if flag or default is None or default == [] or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every subcommand's ``--help`` gets the formatter; an option without help text still shows its default."""
    for action in parser._actions:
        if action.help is None and action.option_strings and action.nargs != 0 and action.default not in (None, []):
            action.help = "default: %(default)s"
    parser.formatter_class = _HelpFormatter


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model with W workers and a compressor; report accuracy and bits")
    p.add_argument("--compressor", default="none", help="registered compressor name (see `gradcomp list`)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="compressor parameter")
    p.add_argument(
        "--error-feedback", action=argparse.BooleanOptionalAction, default=None,
        help="wrap the compressor in error feedback (default: the compressor's own choice, on for sbc/stc)",
    )
    p.add_argument(
        "--feedback", default=None, choices=["none", "residual", "momentum_correction", "momentum_masking"],
        help="feedback policy instead of --error-feedback: residual = error feedback; momentum_correction and "
             "momentum_masking = DGC's worker-side momentum (the optimizer's momentum moves into it)",
    )
    p.add_argument("--granularity", default="layer", choices=["layer", "model"],
                   help="compress every parameter tensor apart, or the whole model as one vector")
    p.add_argument("--topology", default="auto", choices=["auto", "allreduce", "allgather", "ps", "sharded"],
                   help="how messages travel; auto: allreduce for summable messages, else allgather "
                        "(methods with their own rounds choose theirs)")
    p.add_argument("--server-compressor", default=None, help="downstream compressor of the parameter server")
    p.add_argument("--server-param", action="append", default=[], metavar="KEY=VALUE",
                   help="parameter of the server compressor")
    p.add_argument("--no-server-error-feedback", action="store_true", help="no residual on the server")
    p.add_argument("--ddp", action="store_true",
                   help="train a DistributedDataParallel model with gradcomp's communication hook "
                        "(exchanges overlap backward) instead of calling the aggregator after backward")
    p.add_argument("--fsdp", action="store_true", help="train an FSDP2 model (fully_shard) whose gradient "
                   "reduce-scatter gradcomp compresses (docs/fsdp.md)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, metavar="MB",
                   help="with --ddp: DDP's bucket size (default: DDP's 25 MB)")
    p.add_argument("--workers", type=int, default=4, help="number of workers (processes, or simulated)")
    p.add_argument("--local-steps", type=int, default=None, metavar="N",
                   help="exchange the weight update every N local steps (communication delay) instead of "
                        "the gradient every step; N = 1 sends each step's update, momentum included")
    p.add_argument("--outer-optimizer", default="sgd", choices=["sgd", "nesterov"],
                   help="with --local-steps: the step applied to the averaged update. sgd (default: lr 1, momentum "
                        "0) is plain averaging; nesterov is DiLoCo's outer optimizer (default lr 0.7, momentum 0.9)")
    p.add_argument("--outer-lr", type=float, default=None, help="the outer optimizer's learning rate")
    p.add_argument("--outer-momentum", type=float, default=None, help="the outer optimizer's momentum, in [0, 1)")
    p.add_argument("--dense-steps", type=int, default=0, metavar="N",
                   help="the first N steps exchange dense fp32 gradients, then the method (PowerSGD's start_iter)")
    add_training_options(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initialisation and the data order")
    p.add_argument("--seeds", default=None, metavar="S,S,...",
                   help="run once per seed (e.g. 0,1,2) and report mean ± std beside the per-seed values "
                        "(replaces --seed)")
    p.add_argument("--simulate", action="store_true", help="run the workers as a simulated cluster in-process")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: gloo; cuda: NCCL")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="also record test accuracy every N steps (0: never; the final accuracy is always reported)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="how long a worker waits at a collective (or at the start) for the others before the run "
                        "fails, naming the worker that did not answer. The longest normal wait in these jobs is a "
                        "few seconds (rank 0 evaluating the test set, a worker starting on a busy machine); "
                        "raise it for slow starts of many workers or long evaluations")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--allow-untrained-defaults", action="store_true",
                   help="run a method + feedback pair at the defaults measured not to train (docs/methods/feedback.md) "
                        "instead of refusing it")
    p.add_argument("--bandwidth", default=None, metavar="RATE",
                   help="also report what the measured traffic would take on this network, e.g. 1Gbit or 10Gbit")
    p.add_argument("--latency", default="0", metavar="TIME", help="per-message latency for --bandwidth, e.g. 50us")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result as one JSON object")
    p.add_argument("--save", default=None, metavar="PATH",
                   help="save the final model and rank 0's compressor state (an export; not resumable: --checkpoint)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="write resumable checkpoints (every rank's full state) into DIR, atomically: every "
                        "--checkpoint-every steps and after the last step")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N", help="with --checkpoint: every N steps")
    p.add_argument("--checkpoint-keep", type=int, default=None, metavar="K",
                   help="keep the K newest checkpoints in DIR (default 2; 0 keeps all)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a checkpoint: a --checkpoint directory (its latest) or one step-NNNNNN in it; "
                        "the configuration must match (--steps/--epochs may grow)")
    p.add_argument("--resume-if-present", action="store_true",
                   help="resume from the --checkpoint directory when it holds a checkpoint, else start fresh "
                        "(for torchrun --max-restarts)")


def outer_options(args: argparse.Namespace) -> dict:
    """The outer optimizer's TrainConfig options: DiLoCo's lr 0.7 and momentum 0.9 for nesterov unless given."""
    nesterov = args.outer_optimizer == "nesterov"
    return {"outer_optimizer": args.outer_optimizer,
            "outer_lr": args.outer_lr if args.outer_lr is not None else (0.7 if nesterov else 1.0),
            "outer_momentum": args.outer_momentum if args.outer_momentum is not None else (0.9 if nesterov else 0.0)}


def _train(args: argparse.Namespace) -> int:
    from gradcomp.experiments.run.launch import launch
    from gradcomp.experiments.run.report import check_output_file
    from gradcomp.experiments.run.config import TrainConfig

    if args.json:
        check_output_file(args.json, "--json")  # now, not after the whole training
    if args.checkpoint_keep is not None and args.checkpoint is None:
        raise ConfigError("--checkpoint-keep needs --checkpoint DIR: without it no checkpoint is written")
    seeds = None if args.seeds is None else parse_seeds(args.seeds)
    if seeds is not None and (args.checkpoint or args.resume or args.resume_if_present or args.save):
        raise ConfigError("--seeds runs several trainings: it cannot take --checkpoint, --resume or --save "
                          "(run one --seed at a time for those)")
    cfg = TrainConfig(
        compressor=args.compressor, params=parse_param_strings(args.param), error_feedback=args.error_feedback,
        feedback=args.feedback, granularity=args.granularity, topology=args.topology,
        server_compressor=args.server_compressor,
        server_params=parse_param_strings(args.server_param, "--server-param"),
        server_error_feedback=not args.no_server_error_feedback, workers=args.workers, local_steps=args.local_steps,
        **outer_options(args), dense_steps=args.dense_steps,
        **resolve_training_defaults(args), seed=args.seed if seeds is None else seeds[0], simulate=args.simulate,
        device=args.device, eval_every=args.eval_every, save_path=args.save, bandwidth=args.bandwidth,
        latency=args.latency, progress=not args.no_progress, timeout_s=args.timeout, ddp=args.ddp, fsdp=args.fsdp,
        bucket_cap_mb=args.bucket_cap_mb, checkpoint_dir=args.checkpoint, checkpoint_every=args.checkpoint_every,
        checkpoint_keep=2 if args.checkpoint_keep is None else args.checkpoint_keep, resume_dir=args.resume,
        resume_if_present=args.resume_if_present,
    )
    cfg.validate()  # with the options as given, before the optimizer's momentum may be handed to the method
    if not args.allow_untrained_defaults:
        from gradcomp.experiments.run.defaults import refuse_untrained_defaults

        refuse_untrained_defaults(cfg)  # a method + feedback pair measured not to train at these defaults
    note = cfg.hand_momentum_to_method()
    if note:
        print(f"gradcomp: {note}", file=sys.stderr)
    if args.checkpoint or args.resume or args.resume_if_present or args.checkpoint_every is not None:
        from gradcomp.experiments.run.checkpoint import check_before_launch

        check_before_launch(cfg)  # options, and a resumed checkpoint's configuration, before any worker starts
    if seeds is not None and len(seeds) > 1:
        import dataclasses

        from gradcomp.experiments.run.report import aggregate_seeds, format_seeds

        if launched_by_torchrun():
            raise ConfigError("--seeds with several seeds runs one training after another: not under torchrun")
        runs = []
        for seed in seeds:
            print(f"gradcomp: seed {seed} ({len(runs) + 1}/{len(seeds)})", file=sys.stderr, flush=True)
            run_cfg = dataclasses.replace(cfg, seed=seed)
            runs.append(launch(run_cfg))
        result = aggregate_seeds(runs)
        print(format_seeds(result))
    else:
        result = _launch_naming_the_checkpoint(cfg)
        if result is None:  # a non-zero torchrun rank
            return 0
        from gradcomp.experiments.run.report import format_summary

        print(format_summary(result))
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        except OSError as exc:  # checked before the run, but the folder may have gone since
            raise GradcompError(f"--json {args.json}: cannot write the result ({exc.strerror})") from None
    return 0


def _launch_naming_the_checkpoint(cfg):
    """``launch(cfg)``; a failure during training says which intact checkpoint to ``--resume`` from, if any."""
    from gradcomp.experiments.run.checkpoint import CheckpointError, resume_hint
    from gradcomp.experiments.run.launch import launch

    try:
        return launch(cfg)
    except (GradcompError, CommunicationError) as exc:
        if not isinstance(exc, (ConfigError, CheckpointError)) and exc.args:
            exc.args = (f"{exc.args[0]}{resume_hint(cfg)}", *exc.args[1:])
        raise


def _add_list(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("list", help="list the methods (built-in and installed plugins) and what they declare")


def _list(args: argparse.Namespace) -> int:
    """The method table on stdout. A plugin that cannot be used (it fails to import, even with ``sys.exit``, or
    is no method class, or two plugins give its name) gets a "broken" row and its error on stderr as a warning,
    as does a plugin left out because a built-in has its name: one bad package must not hide every other
    method, so the command still succeeds."""
    import warnings

    from gradcomp import registry
    from gradcomp.registry import PluginWarning, available, compressor_class

    registry._warned.clear()  # the list reports every plugin left out, said before or not
    rows, broken = [], []
    with warnings.catch_warnings(record=True) as ignored:  # plugins left out: said after the table, as one line each
        warnings.simplefilter("always", PluginWarning)
        for name in available():
            try:
                cls = compressor_class(name)
            except ConfigError as exc:
                rows.append((name, f"broken {_plugin_origin(name)}", "(see the warning below)"))
                broken.append(str(exc))
                continue
            rows.append((name, *_describe_method(name, cls)))
    for w in ignored:
        if issubclass(w.category, PluginWarning):
            broken.append(str(w.message).removeprefix("gradcomp: "))
        else:  # any other warning as it would have been shown
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    name_width, flags_width = (max(len(row[i]) for row in rows) for i in (0, 1))
    for name, flags, params in rows:
        print(f"{name:{name_width}s}  {flags:{flags_width}s}  {params}".rstrip())
    sys.stdout.flush()  # the table before the warnings, where both go to one terminal
    for message in broken:
        print(f"gradcomp: warning: {message}", file=sys.stderr)
    return 0


def _plugin_origin(name: str) -> str:
    """``origin(name)`` ("plugin PACKAGE VERSION"), or just "plugin" where even that cannot be told."""
    from gradcomp.registry import origin

    try:
        return origin(name)
    except ConfigError:
        return "plugin"


def _describe_method(name: str, cls: type) -> tuple[str, str]:
    """The flags (how its messages travel, what it declares, where it comes from) and the parameters with the
    values a default-built instance uses, of the method ``name`` whose class is ``cls``: one row of ``list``."""
    import inspect

    from gradcomp.registry import origin
    from gradcomp.schemes.base import Scheme

    try:  # the values a default-built instance really uses (density=None means density 0.01 for top-k)
        effective = cls().params()
    except Exception:  # a method that cannot be built without arguments: its signature's defaults
        effective = {}
    params = []
    for p in inspect.signature(cls.__init__).parameters.values():
        if p.name == "self" or p.default is inspect.Parameter.empty:
            continue
        value = effective.get(p.name) if p.default is None else None
        params.append(f"{p.name}={(p.default if value is None else value)!r}")
    if issubclass(cls, Scheme):
        flags = "own rounds"
    else:
        flags = ("summable" if cls.summable else "gathered") + (", unbiased" if cls.unbiased else "")
    if cls.owns_momentum:
        flags += ", momentum"
    if getattr(cls, "default_error_feedback", False):
        flags += ", error feedback on"  # make(name) wraps it in ErrorFeedback unless error_feedback=False
    if origin(name).startswith("plugin"):
        flags += f", {origin(name)}"  # from another installed package (entry-point group gradcomp.methods)
    return flags, " ".join(params)


# The lab's commands: each module has add_arguments(parser) and main(args), imported only when needed.
_LAB = {
    "bench": ("gradcomp.experiments.bench.bench", "throughput and bits per element of every compressor"),
    "sweep": ("gradcomp.experiments.study.sweep", "grid of sparsification schemes; table and plots; resumes"),
    "curves": ("gradcomp.experiments.study.curves", "accuracy curves of finished runs: table and plot"),
    "race": ("gradcomp.experiments.race.command", "time to accuracy of several methods over emulated slow links"),
    "plan": ("gradcomp.experiments.study.plan", "predict each method's step time on a network; recommend one"),
}


# DDP re-raises an exception from a communication hook's future as a bare RuntimeError (no __cause__) whose
# message is "Got the following error when running the callback: <Type>: <message>\n\nAt:\n<traceback>".
_HOOK_ERROR = re.compile(r"Got the following error when running the callback: (\w+): (.*?)(?:\n\nAt:\n.*)?\Z", re.S)


def _gradcomp_error(exc: BaseException) -> str | None:
    """The message of the gradcomp error that ``exc`` carries (itself, its causes, or DDP's wrapping), or None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (GradcompError, CommunicationError)):
            return str(current)
        match = _HOOK_ERROR.match(str(current)) if isinstance(current, RuntimeError) else None
        if match:
            kind = getattr(errors, match.group(1), None)
            if isinstance(kind, type) and issubclass(kind, (GradcompError, CommunicationError)):
                return match.group(2).strip()
        current = current.__cause__ or current.__context__
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradcomp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    for name, (module, text) in _LAB.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=text))
    _add_list(sub)
    for subparser in sub.choices.values():
        _show_defaults(subparser)
    args = parser.parse_args(argv)
    _plugin_warnings_as_lines()
    try:
        if args.command in _LAB:
            return importlib.import_module(_LAB[args.command][0]).main(args)
        return {"train": _train, "list": _list}[args.command](args)
    except (GradcompError, CommunicationError) as exc:
        print(f"gradcomp: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # with --ddp, a gradcomp error raised in the hook reaches here wrapped by DDP
        message = _gradcomp_error(exc)
        if message is None:
            raise
        print(f"gradcomp: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C; or Interrupted: the launcher stopped its workers on a signal
        # a bar of this process is closed (its line ended); a spawned worker's bar is left mid-line: start a new one
        start = "\n" if not _close_progress_bars() and not getattr(args, "no_progress", True) else ""
        print(f"{start}gradcomp: {str(exc) or 'interrupted (Ctrl-C)'}", file=sys.stderr)
        return getattr(exc, "exit_code", 130)


def _plugin_warnings_as_lines() -> None:
    """A plugin left out (registry.PluginWarning) is told as one ``gradcomp: warning: ...`` line on stderr, as the
    command's errors are, not in Python's ``file:line: PluginWarning: ...`` form; other warnings are untouched."""
    import warnings

    from gradcomp.registry import PluginWarning

    shown = warnings.showwarning
    if getattr(shown, "_gradcomp", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, PluginWarning):
            print(f"gradcomp: warning: {str(message).removeprefix('gradcomp: ')}", file=file or sys.stderr)
            return
        shown(message, category, filename, lineno, file, line)

    show._gradcomp = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def _close_progress_bars() -> int:
    """Close the progress bars of this process that an interrupted command left open; how many there were.

    A bar left open is closed when the interpreter exits, which redraws it under the command's last line.
    """
    if "tqdm" not in sys.modules:
        return 0
    from tqdm import tqdm

    bars = list(getattr(tqdm, "_instances", ()))
    for bar in bars:
        bar.close()
    return len(bars)


def run() -> None:
    """The ``gradcomp`` command. Under torchrun it leaves with ``os._exit`` once its output is written.

    After a finished, torn-down gloo group, torch's teardown at interpreter exit sometimes aborts a worker
    ("terminate called without an active exception", about one run in 20 on a loaded 2-core machine), and
    torchrun then reports the whole job as failed although every result was written. Nothing of gradcomp's
    is left to clean up at that point, so the process skips that teardown.
    """
    import os

    from gradcomp.experiments.run.launch import launched_by_torchrun

    # The command's own process keeps freed memory for reuse (allocator.py); the workers it starts apply the
    # same setting themselves, unless GRADCOMP_KEEP_FREED_MEMORY=0. Not in main(): a caller of main() in its
    # own process (a notebook, the tests) keeps its allocator as it was.
    keep_freed_memory()
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader of our output left (``gradcomp list | head``): what it wanted it has; say nothing more.
        # stdout is pointed at /dev/null so that the interpreter's own flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    if launched_by_torchrun():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
