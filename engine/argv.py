"""vLLM's command-line spelling rules, applied to an argv before argparse sees it (pure; no I/O but the
`--config` file).

As vLLM's FlexibleArgumentParser: `--config FILE.yaml` inserts the file's flags right after the role and
model (so the command line, parsed later, wins); underscores in a flag name become dashes
(`--max_num_seqs 8`, `--max-num_batched-tokens=8k`); `--json-flag.key.sub value` parts (and `key+` list
items) are merged into one JSON object for `--json-flag`; `--model X` is the model. Unlike vLLM, a dotted
part must start with `--`, so a negative number such as `-0.5` stays a value.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

_NAME = re.compile(r"(?<=--)[^.]*")  # the flag name: after the leading --, up to the first "."


def _dashes(arg: str) -> str:
    if "=" in arg:
        key, value = arg.split("=", 1)
        return _NAME.sub(lambda m: m.group(0).replace("_", "-"), key, count=1) + "=" + value
    return _NAME.sub(lambda m: m.group(0).replace("_", "-"), arg, count=1)


def load_config_file(path: str, parser: argparse.ArgumentParser | None = None) -> list[str]:
    """A YAML mapping of flag -> value as argv: true -> --flag, false -> --no-flag (when the parser has it;
    else nothing), a list -> --flag item..., a mapping -> --flag JSON, anything else -> --flag str(value)."""
    import yaml

    if Path(path).suffix not in (".yaml", ".yml"):
        raise ValueError(f"--config must be a .yaml or .yml file, got {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path} is not valid YAML: {e}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of flag: value, got {type(data).__name__}")
    known = parser._option_string_actions if parser is not None else {}
    out: list[str] = []
    for key, value in data.items():
        flag = _dashes("--" + str(key))
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif "--no-" + flag[2:] in known:
                out.append("--no-" + flag[2:])
        elif isinstance(value, list):
            if value:
                out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _pull_config(argv: list[str], parser: argparse.ArgumentParser | None, has_role: bool) -> list[str]:
    configs = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not configs:
        return argv
    if len(configs) > 1:
        raise ValueError("--config is given more than once")
    i = configs[0]
    if argv[i] == "--config":
        if i == len(argv) - 1:
            raise ValueError("--config needs a file")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1:]
    from_file = load_config_file(path, parser)
    head = 1 if has_role and rest else 0
    if len(rest) > head and not rest[head].startswith("-"):
        head += 1  # the positional model stays first
    return rest[:head] + from_file + rest[head:]


def human_int(value: str) -> int:
    """vLLM's human-readable integers: 25.6k = 25600 (k m g t: powers of 1000), 2K = 2048 (K M G T:
    powers of 1024, whole numbers only), else a plain int."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", value.strip())
    if not m:
        return int(value)
    number, suffix = m.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"decimals are not allowed with binary suffixes like {suffix}; "
                                         f"did you mean {number}{suffix.lower()}?")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


def human_int_or_auto(value: str) -> int | None:
    """--max-model-len: -1 or auto mean the model's own limit (None here)."""
    return None if value.strip() in ("-1", "auto") else human_int(value)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return human_int(text)
        except (ValueError, argparse.ArgumentTypeError):
            return text


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        elif isinstance(v, list) and isinstance(into.get(k), list):
            into[k] += v
        else:
            into[k] = v


def normalize_argv(argv: list[str], parser: argparse.ArgumentParser | None = None,
                   has_role: bool = False) -> list[str]:
    """vLLM's rules (module docstring). has_role: argv[0] is a subcommand (`serve`, `worker`, ...)."""
    argv = _pull_config(_move_model_option(list(argv), has_role), parser, has_role)
    out: list[str] = []
    dotted: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-O") and not arg.startswith("--"):  # vLLM: -O3, -O=3 and -O 3 are --optimization-level
            level = arg[3:] if arg[2:3] == "=" else arg[2:]
            if level:
                out += ["--optimization-level", level]
                i += 1
                continue
            if i + 1 < len(argv) and argv[i + 1] in ("0", "1", "2", "3"):
                out.append("--optimization-level")
                i += 1
                continue
        if not arg.startswith("--") or arg == "--":
            out.append(arg)
            i += 1
            continue
        if arg.startswith("--help="):  # vLLM's --help=<group or keyword>: here the whole help
            out.append("--help")
            i += 1
            continue
        arg = _dashes(arg)
        name = arg.split("=", 1)[0]
        if "." not in name:
            out.append(arg)
            i += 1
            continue
        if "=" in arg:
            value_text = arg.split("=", 1)[1]
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ValueError(f"{name} needs a value")
            value_text = argv[i + 1]
            i += 2
        value: Any
        if name.endswith("+"):
            name, value = name[:-1], value_text.split(",")
        else:
            value = _parse_value(value_text)
        flag, *keys = name.split(".")
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        _merge(dotted.setdefault(flag, {}), nested)
    for flag, obj in dotted.items():
        out += [flag, json.dumps(obj)]
    return out


def _move_model_option(argv: list[str], has_role: bool) -> list[str]:
    """vLLM: `--model X` on the command line is the positional model (moved to the front). A model in a
    --config file stays an option, and a positional model wins over it."""
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            tag, rest = argv[i + 1], argv[:i] + argv[i + 2:]
        elif a.startswith("--model="):
            tag, rest = a.split("=", 1)[1], argv[:i] + argv[i + 1:]
        else:
            continue
        head = 1 if has_role and rest else 0
        if len(rest) > head and not rest[head].startswith("-"):
            raise ValueError(f"the model is given twice: {rest[head]!r} and --model {tag!r}")
        return rest[:head] + [tag] + rest[head:]
    return argv


class Switch(argparse.Action):
    """vLLM's boolean flags: `--x` / `--no-x`, and for enable/disable pairs `--enable-x` / `--disable-x`
    (the `--no-` forms of both are accepted too, hidden from help)."""

    def __init__(self, option_strings, dest, negatives=(), default=False, help=None, **kw):
        positives = list(option_strings)
        self.negatives = set(negatives) | {"--no-" + o[2:] for o in positives if o.startswith("--")}
        self.negatives |= {"--no-" + o[2:] for o in negatives if o.startswith("--")}
        super().__init__(positives + sorted(self.negatives), dest, nargs=0, default=default, help=help, **kw)
        self.visible = positives + list(negatives)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string not in self.negatives)

    def format_usage(self) -> str:
        return " | ".join(self.visible)


def json_object_flag(flag: str, text: str | None, known: set[str] | dict[str, Any],
                     example: str) -> dict[str, Any] | None:
    """A JSON-object flag's value (--kv-events-config, --weight-transfer-config): None when absent or blank;
    ValueError naming the flag for text that is not a JSON object or has keys outside `known`."""
    if text is None or not text.strip():
        return None
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{flag} must be a JSON object such as {example}")
    unknown = set(raw) - set(known)
    if unknown:
        raise ValueError(f"{flag}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return raw


def json_object_type(flag: str):
    def parse(value: str) -> str:
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag} is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {type(obj).__name__}")
        return value
    return parse


def at_least(flag: str, low: int, what: str):
    """An argparse type: an integer (human_int: 8k works) of at least `low`, else an error naming the flag."""
    def parse(value: str) -> int:
        n = human_int(value)
        if n < low:
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {n}")
        return n
    return parse


def positive(flag: str):
    return at_least(flag, 1, "at least 1")


def non_negative(flag: str):
    return at_least(flag, 0, "non-negative")
