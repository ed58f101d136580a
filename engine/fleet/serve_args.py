"""vLLM's serve Namespace (what RL frameworks build for `vllm serve`, e.g. SkyRL's cli_args) as a
`rollbus serve` command line. Pure, no Ray.

Every attribute becomes its flag, through rollbus's own parser, so the result is checked exactly as the
command line is: a flag rollbus refuses is refused with the same message (config_from_args). Attributes the
Namespace lacks take rollbus's defaults; attributes equal to rollbus's default are left out, and so are
vLLM-only attributes that hold nothing (None, False, empty): a Namespace built with only what one sets
carries no vLLM default that rollbus would refuse. `host` and `port` belong to whoever launches the
engine and are left out too. An attribute that is no flag of `vllm serve` at all is refused by name.

    python -m engine.fleet.serve_args '{"model": "/m", "enable_sleep_mode": true}'   # prints the argv (JSON)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# attributes of a parsed vLLM Namespace that are not flags (subcommand plumbing), and the launcher's own
NOT_FLAGS = frozenset({"subparser", "dispatch_function", "model_tag", "func", "host", "port"})
UNSET = (None, False, "", [], {}, ())


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """vLLM attribute name -> the action that parses its flag (rollbus's own, or the vLLM-only recorder)."""
    out: dict[str, argparse.Action] = {}
    for a in parser._actions:
        if not a.option_strings:
            continue
        name = a.dest[len("vllm__"):] if a.dest.startswith("vllm__") else a.dest
        out.setdefault(name, a)
    out["model"] = next(a for a in parser._actions if a.dest == "model")
    return out


def _flag(action: argparse.Action, value: Any) -> list[str]:
    visible = list(getattr(action, "visible", None) or action.option_strings)
    if action.nargs == 0:  # a switch: its positive form, or its negative one for False
        if value:
            return [visible[0]]
        negatives = sorted(o for o in action.option_strings if o.startswith(("--no-", "--disable-")))
        return [negatives[0]] if negatives else []
    opt = visible[0]
    if isinstance(value, dict):
        return [f"{opt}={json.dumps(value)}"]
    if isinstance(value, (list, tuple)):
        return [opt, *map(str, value)] if action.nargs in ("+", "*") else [opt, " ".join(map(str, value))]
    text = str(value)
    return [f"{opt}={text}"] if text.startswith("-") else [opt, text]


def namespace_argv(ns: argparse.Namespace | dict[str, Any]) -> list[str]:
    """The `rollbus serve` arguments for a vLLM serve Namespace (SystemExit naming any refusal)."""
    from engine.argv import normalize_argv
    from engine.config import config_from_args, new_parser

    values = dict(vars(ns)) if isinstance(ns, argparse.Namespace) else dict(ns)
    parser = new_parser()
    actions = _actions(parser)
    unknown = sorted(k for k in values if k not in actions and k not in NOT_FLAGS)
    if unknown:
        raise SystemExit(f"rollbus: {', '.join(unknown)}: not a flag of `vllm serve` (nor of `rollbus serve`)")
    argv: list[str] = []
    model = values.pop("model", None)
    if model:
        argv.append(str(model))
    for name, value in values.items():
        if name in NOT_FLAGS:
            continue
        action = actions[name]
        vllm_only = action.dest.startswith("vllm__")
        if (vllm_only and value in UNSET) or (not vllm_only and value == action.default):
            continue
        argv += _flag(action, value)
    config_from_args(parser.parse_args(normalize_argv(argv, parser)))  # refusals, as on the command line
    return argv


def main() -> None:
    try:
        print(json.dumps(namespace_argv(json.loads(sys.argv[1]))))
    except SystemExit as e:
        print(e, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
