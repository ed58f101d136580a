"""The `rollbus` command: `serve` starts everything; the other subcommands run one process each
(what the Procfile and `serve` itself use); `keys` writes the tcp bus's CURVE keys."""

from __future__ import annotations

import argparse
import sys

from engine.argv import normalize_argv
from engine.config import HelpFormatter, add_engine_args, config_from_args, new_parser

ROLES = {
    "serve": "Start the whole engine (coordinator, scheduler, one worker per device, HTTP gateway).",
    "gateway": "Run only the HTTP gateway process.",
    "scheduler": "Run only the scheduler process.",
    "worker": "Run only one worker process (--rank selects the device).",
    "coordinator": "Run only the control-plane coordinator process.",
}
KEYS_HELP = "Write the tcp bus's CURVE key pairs (server and client) into a folder; see --bus-curve-dir."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollbus", description="rollbus: an RL rollout engine on a ZeroMQ bus.",
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="role", required=True, metavar="{" + ",".join([*ROLES, "keys"]) + "}")
    epilog = new_parser().epilog
    for role, help_text in ROLES.items():
        # allow_abbrev=False: vLLM flags are matched whole (`--max-num-seq` is an error, not --max-num-seqs)
        sp = sub.add_parser(role, help=help_text, description=help_text, allow_abbrev=False,
                            usage=f"rollbus {role} [MODEL] [FLAGS]   (vLLM's flag spellings; see below)",
                            formatter_class=HelpFormatter, epilog=epilog)
        if role == "worker":
            sp.add_argument("--rank", type=int, default=0,
                            help="The worker's tensor-parallel rank inside its engine (--data-parallel-rank); "
                                 "bus name worker-<engine x tp + rank>.")
            sp.add_argument("--device-index", type=int, default=None,
                            help="The device, among those this process sees, that the worker uses. Default: its "
                                 "place among this host's workers (engine x tp + rank, counted from "
                                 "--data-parallel-start-rank); a Ray worker actor passes 0 (its bundle's device).")
        add_engine_args(sp)
    sub.add_parser("keys", help=KEYS_HELP, description=KEYS_HELP, add_help=False)  # listed; parsed by keys_main
    return p


def keys_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollbus keys", description=KEYS_HELP, allow_abbrev=False,
                                epilog="Files: server.key, server.key_secret, client.key, client.key_secret "
                                       "(pyzmq certificates, mode 0600, folder 0700). Start the engine with "
                                       "--bus-transport tcp --bus-curve-dir DIR; a trainer on another host needs "
                                       "server.key and client.key_secret (env ROLLBUS_BUS_CURVE_DIR).")
    p.add_argument("dir", help="Folder to write (created 0700).")
    p.add_argument("--force", action="store_true", help="Replace keys already in the folder.")
    return p


def keys_main(argv: list[str]) -> None:
    from bus.auth import BusKeyError, generate

    args = keys_parser().parse_args(argv)
    try:
        for path in generate(args.dir, force=args.force):
            print(path)
    except (BusKeyError, OSError) as e:
        raise SystemExit(f"rollbus keys: {e}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """vLLM's spelling rules (engine.argv), then argparse."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    role = argv[0] if argv and argv[0] in ROLES else None
    sub = parser._subparsers._group_actions[0].choices.get(role) if role else None  # type: ignore[union-attr]
    try:
        argv = normalize_argv(argv, sub, has_role=role is not None)
    except ValueError as e:
        (sub or parser).error(str(e))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["keys"]:
        return keys_main(argv[1:])
    args = parse_args(argv)
    cfg = config_from_args(args)
    for note in cfg.notes:  # vLLM flags without effect here: one line each (children never see them)
        print(f"rollbus: {note}", file=sys.stderr, flush=True)
    if args.role == "serve":
        from engine.launcher import Launcher

        sys.exit(Launcher(cfg).run())
    try:
        if args.role == "gateway":
            from gateway.server import run_gateway_process

            run_gateway_process(cfg)
        elif args.role == "scheduler":
            from engine.scheduler.actor import run_scheduler_process

            run_scheduler_process(cfg)
        elif args.role == "worker":
            from workers.worker_actor import run_worker_process

            run_worker_process(cfg, args.rank, args.device_index)
        elif args.role == "coordinator":
            from engine.coordinator.actor import run_coordinator_process

            run_coordinator_process(cfg)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
