"""The `rollbus` command: `serve` starts everything; the other subcommands run one process each
(what the Procfile and `serve` itself use)."""

from __future__ import annotations

import argparse
import sys

from engine.config import add_engine_args, config_from_args

ROLES = {
    "serve": "Start the whole engine (coordinator, scheduler, one worker per device, HTTP gateway).",
    "gateway": "Run only the HTTP gateway process.",
    "scheduler": "Run only the scheduler process.",
    "worker": "Run only one worker process (--rank selects the device).",
    "coordinator": "Run only the control-plane coordinator process.",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollbus", description="rollbus: an RL rollout engine on a ZeroMQ bus.")
    sub = p.add_subparsers(dest="role", required=True, metavar="{" + ",".join(ROLES) + "}")
    for role, help_text in ROLES.items():
        sp = sub.add_parser(role, help=help_text, description=help_text,
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        if role == "worker":
            sp.add_argument("--rank", type=int, default=0, help="Worker rank = device index.")
        add_engine_args(sp)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
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

            run_worker_process(cfg, args.rank)
        elif args.role == "coordinator":
            from engine.coordinator.actor import run_coordinator_process

            run_coordinator_process(cfg)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
