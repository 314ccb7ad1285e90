"""`gradcomp race`'s command line: its options, and which races they ask for (one, one per seed, several links).

The race itself is race.py; seeds.py runs it once per seed or per link.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from gradcomp.experiments.race import netns
from gradcomp.experiments.race.links import parse_links
from gradcomp.experiments.race.method import DEFAULT_METHODS, parse_method
from gradcomp.experiments.race.race import Interrupted, Options, race, remove_workdirs
from gradcomp.experiments.race.seeds import race_links_seeds, race_seeds


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", action="append", default=None, metavar="NAME[:KEY=VALUE,...]",
                   help="a method to race (repeat); gradcomp compressor or torch-fp32 / torch-fp16 / "
                        "torch-powersgd; e.g. topk:density=0.01,feedback=residual (default: ten, docs/race.md)")
    p.add_argument("--hosts", "--workers", dest="hosts", type=int, default=4, help="emulated hosts, one worker each")
    p.add_argument("--link", default="100mbit",
                   help="each host's link rate up and down, e.g. 100mbit or 1gbit (tbf); none: unshaped. Several, "
                        "e.g. 10mbit,100mbit: one full training at the first, a timed window of steps at the others "
                        "(docs/race.md)")
    p.add_argument("--link-window", type=int, default=50, metavar="STEPS",
                   help="with several links: steady steps timed at the links after the first, after each method's "
                        "warm-up, in whole rounds (default 50)")
    p.add_argument("--no-netns", action="store_true",
                   help="with --link none: plain local processes on 127.0.0.1 instead of namespaces")
    p.add_argument("--steps", type=int, default=500, help="training steps of every method")
    from gradcomp.experiments.run.options import add_training_options

    add_training_options(p, epochs=None)
    p.set_defaults(model="convnet")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default=None, metavar="S,S,...",
                   help="race once per seed (e.g. 0,1,2; each into OUT/seed-S) and report every method's time to "
                        "target as mean ± std beside the per-seed values (OUT/race-seeds.md and .json)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--target", type=float, default=0.98, help="test accuracy to reach (fraction)")
    p.add_argument("--target-loss", type=float, default=None, metavar="BITS",
                   help="a language model (--model transformer): the validation loss to reach, in bits per byte")
    p.add_argument("--eval-every", type=int, default=50, help="evaluate every N steps (off the training clock)")
    p.add_argument("--compute-steps", type=int, default=20,
                   help="compute-only steps (no communication) measured before each method's training")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a stuck collective fails")
    p.add_argument("--out", default="race", metavar="DIR", help="writes race.md, race.json and race.png here")
    p.add_argument("--quiet", action="store_true", help="no per-evaluation progress lines")
    p.add_argument("--cleanup", default=None, metavar="TAG",
                   help="only remove the namespaces left by run TAG (printed at its start), or 'all'")


def options_from_args(args: argparse.Namespace) -> tuple[Options, list[str], list[int] | None]:
    """The race's Options (link: the first of ``--link``), the links and the seeds, from parsed arguments."""
    from gradcomp.experiments.run.report import parse_seeds
    from gradcomp.experiments.run.options import resolve_training_defaults

    train = resolve_training_defaults(args)
    seeds = parse_seeds(args.seeds) if args.seeds is not None else None
    links = parse_links(args.link)
    opts = Options(
        methods=[parse_method(s) for s in (args.method or DEFAULT_METHODS)],
        hosts=args.hosts, link=links[0], netns_mode="off" if args.no_netns else "auto", steps=args.steps,
        batch_size=train.pop("batch_size"), lr=train.pop("lr"), momentum=train.pop("momentum"),
        weight_decay=train.pop("weight_decay"), dataset=train.pop("dataset"), data_root=train.pop("data_root"),
        model=train.pop("model"), seed=args.seed if seeds is None else seeds[0], device=args.device,
        target=args.target, target_loss=args.target_loss, train_extra=train, eval_every=args.eval_every,
        compute_steps=args.compute_steps, timeout_s=args.timeout, out=args.out, verbose=not args.quiet,
        window=args.link_window,
    )
    return opts, links, seeds


def main(args: argparse.Namespace) -> int:
    if args.cleanup:
        removed = netns.cleanup(args.cleanup)
        dirs = remove_workdirs(args.cleanup)
        print(f"removed {len(removed)} namespaces" + (f": {', '.join(removed)}" if removed else "")
              + (f"; work directories: {', '.join(dirs)}" if dirs else ""))
        return 0
    opts, links, seeds = options_from_args(args)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if len(links) > 1:
        return race_links_seeds(opts, links, seeds or [opts.seed], log)
    if seeds is not None and len(seeds) > 1:
        return race_seeds(opts, seeds, log)
    state: dict[str, Any] = {}
    try:
        result = race(opts, log, show=print, state=state)
    except (KeyboardInterrupt, Interrupted):
        with netns.signals_held():  # say truthfully what is left before anything else happens
            report_interruption(state, opts.out, log)
        return 130
    if opts.out:
        log(f"gradcomp race: wrote {os.path.join(opts.out, 'race.md')}, race.json"
            + (", race.png" if result.get("plot") else ""))
    failed = [r["label"] for r in result["methods"] if r.get("error")]
    if failed:
        log(f"gradcomp race: {len(failed)} of {len(result['methods'])} methods failed: {', '.join(failed)}")
        return 1
    return 0


def report_interruption(state: dict[str, Any], out: str | None, log) -> None:
    """What an interrupted race left: the network (removed, or the --cleanup to run) and the finished rows."""
    network = state.get("network")
    if isinstance(network, netns.NamespaceNetwork) and network.exists():
        log(f"gradcomp race: interrupted; the emulated network was not removed completely: remove it with "
            f"`gradcomp race --cleanup {network.tag}`")
    elif isinstance(network, netns.NamespaceNetwork):
        log("gradcomp race: interrupted; workers stopped and the emulated network removed")
    else:
        log("gradcomp race: interrupted; workers stopped")
    if state.get("saved") and out:
        log(f"gradcomp race: the methods that finished ({state['saved']}) are in {os.path.join(out, 'race.json')} "
            "and race.md")
