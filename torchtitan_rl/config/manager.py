"""Build a JobConfig from defaults < TOML file < CLI flags, and write it back as TOML.

    .venv/bin/python -m torchtitan_rl.train --job.config_file run_configs/debug_cpu.toml \
        --job.dry_run --training.steps 7

TOML values are type-checked here against the dataclass fields (unknown keys list the valid
ones); the CLI goes through tyro with the TOML values as its defaults, so `--help` after
`--job.config_file` shows the file's values. Every error is a one-line `ConfigError`.
"""

import contextlib
import dataclasses
import difflib
import io
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import tomli_w
import tyro

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.job_config import JobConfig

# Fields that describe one invocation, not the run: left out of the written TOML so that the
# file, fed back with --job.config_file, reproduces the same config.
INVOCATION_FIELDS = {"job.config_file", "job.dry_run"}

_BOOL_WORDS = {"true": "True", "false": "False"}

DESCRIPTIONS = {
    "train": "torchtitan_rl: GRPO-style RL for torchtitan models.",
    "sft": "torchtitan_rl.sft: supervised fine-tuning (the SFT warm start of an RL run).",
}


def import_spec(spec: str, field: str, kind: str) -> Any:
    """The object named by 'package.module:name' (a `kind`: "function" or "class") that the
    config `field` names; one ConfigError line if it does not import or is no such thing."""
    import importlib

    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail in any way while importing
        raise ConfigError(f"{field} = {spec!r}: cannot import {module_name!r} ({e})") from None
    found = getattr(module, name, None)
    if not (isinstance(found, type) if kind == "class" else callable(found)):
        raise ConfigError(f"{field} = {spec!r}: {module_name} has no {kind} {name!r}")
    return found


def load_toml(path: str) -> dict[str, Any]:
    """The parsed TOML file at `path`; a missing or malformed file is a ConfigError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"job.config_file = {path!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"job.config_file = {path!r}: cannot read it ({e})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None


def apply_toml(config: Any, table: dict[str, Any], prefix: str = "") -> None:
    """Set the fields of dataclass `config` from TOML `table`, checking names and types."""
    hints = typing.get_type_hints(type(config))
    names = [f.name for f in dataclasses.fields(config)]
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(_unknown_key_message(dotted, key, names, prefix))
        field_type = hints[key]
        if dataclasses.is_dataclass(field_type):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{dotted} is a section: write it as [{dotted}] with key = value lines"
                )
            apply_toml(getattr(config, key), value, f"{dotted}.")
        else:
            setattr(config, key, _check_type(value, field_type, dotted))


def _unknown_key_message(dotted: str, key: str, names: list[str], prefix: str) -> str:
    where = f"section [{prefix[:-1]}]" if prefix else "the top level"
    close = difflib.get_close_matches(key, names, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return f"unknown key {dotted!r} in {where}: {hint}valid keys: {', '.join(names)}"


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return f"a table of {_type_name(typing.get_args(tp)[1])}"
    return getattr(tp, "__name__", str(tp))


def _check_type(value: Any, tp: Any, dotted: str) -> Any:
    """`value` as type `tp` (an int is accepted for a float); otherwise a ConfigError."""
    origin = typing.get_origin(tp)
    ok = False
    if origin is Literal:
        ok = value in typing.get_args(tp)
    elif origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            if option is type(None):
                continue
            try:
                return _check_type(value, option, dotted)
            except ConfigError:
                pass
    elif origin is list:
        if isinstance(value, list):
            (item_type,) = typing.get_args(tp)
            return [_check_type(v, item_type, f"{dotted}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            _, item_type = typing.get_args(tp)
            return {k: _check_type(v, item_type, f"{dotted}.{k}") for k, v in value.items()}
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):  # a table of sections, e.g. [task.sources.NAME]
            section = tp()
            apply_toml(section, value, f"{dotted}.")
            return section
    elif tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, tp)
    if not ok:
        raise ConfigError(
            f"{dotted}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})"
        )
    return value


def _bool_flags(cls: type, prefix: str = "--") -> set[str]:
    """The CLI flags of every bool field in the dataclass tree `cls`."""
    flags = set()
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            flags |= _bool_flags(tp, f"{prefix}{name}.")
        elif tp is bool or set(typing.get_args(tp)) == {bool, type(None)}:
            flags.add(f"{prefix}{name}")
    return flags


def normalize_bool_args(argv: list[str]) -> list[str]:
    """Accept `--flag true|false` in any case, and a bare `--flag` as `--flag true`."""
    flags = _bool_flags(JobConfig)
    out: list[str] = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name not in flags:
            out.append(arg)
        elif eq:
            out.append(f"{name}={_BOOL_WORDS.get(value.lower(), value)}")
        else:
            out.append(arg)
            following = argv[i + 1] if i + 1 < len(argv) else None
            if following is None or following.startswith("--"):
                out.append("True")
    return [
        _BOOL_WORDS.get(a.lower(), a) if i and out[i - 1] in flags else a for i, a in enumerate(out)
    ]


def _config_file_arg(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--job.config_file="):
            return arg.split("=", 1)[1]
        if arg == "--job.config_file" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _one_line(tyro_message: str) -> str:
    """tyro's boxed error text reduced to its first paragraph on one line."""
    lines = []
    for line in tyro_message.splitlines():
        text = line.strip("│╭╮╰╯─ \t")
        if re.fullmatch(r"[─\s]*", line.strip("│ ")) and lines:
            break  # the rule under the message: the rest is help text
        if text and not line.lstrip().startswith(("╭", "╰")):
            lines.append(text)
    return " ".join(" ".join(lines).split()) or "invalid command line"


def _tyro_cli(default: JobConfig, argv: list[str], prog: str, description: str) -> JobConfig:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return tyro.cli(
                JobConfig,
                default=default,
                args=argv,
                prog=prog,
                description=description,
                config=(tyro.conf.FlagConversionOff,),
                use_underscores=True,
            )
    except SystemExit as e:
        if e.code in (0, None):
            raise
        raise ConfigError(f"command line: {_one_line(stderr.getvalue())}") from None


def parse_args(
    argv: list[str],
    world_size: int = 1,
    prog: str = "torchtitan_rl.train",
    entry: Literal["train", "sft"] = "train",
) -> JobConfig:
    """The resolved, validated JobConfig for CLI `argv`: defaults < --job.config_file TOML <
    flags, checked for an RL run (`entry` train) or an SFT run (sft)."""
    config = JobConfig()
    config_file = _config_file_arg(argv)
    if config_file is not None:
        apply_toml(config, load_toml(config_file))
    description = DESCRIPTIONS[entry]
    config = _tyro_cli(config, normalize_bool_args(argv), prog, description)
    config.resolve(entry)
    config.validate(world_size, entry)
    return config


def to_dict(config: Any, prefix: str = "") -> dict[str, Any]:
    """`config` as nested dicts for TOML: None (TOML has no null) and invocation fields dropped."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        dotted = f"{prefix}{f.name}"
        if dotted in INVOCATION_FIELDS or value is None:
            continue
        out[f.name] = _plain(value, dotted)
    return out


def _plain(value: Any, dotted: str) -> Any:
    """A field's value as TOML values: a section as a table, a table of sections as tables."""
    if dataclasses.is_dataclass(value):
        return to_dict(value, f"{dotted}.")
    if isinstance(value, dict):
        return {k: _plain(v, f"{dotted}.{k}") for k, v in value.items()}
    return value


def to_toml(config: JobConfig) -> str:
    """The resolved config as TOML text; parsing it back gives the same config."""
    return tomli_w.dumps(to_dict(config))


def write_config(config: JobConfig, path: Path) -> None:
    """Write the resolved config to `path` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(to_toml(config), encoding="utf-8")
    tmp.replace(path)
