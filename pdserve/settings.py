"""Every flag of a pdserve subcommand also from a YAML file (`--config FILE`) and from PDSERVE_*
environment variables. One precedence order: command line > environment > config file >
built-in default; the effective non-default settings and their sources are printed at start."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

ENV_PREFIX = "PDSERVE_"
CONFIG_ENV = "PDSERVE_CONFIG"  # the config file when --config is not given
PRECEDENCE = "command line > PDSERVE_* environment > --config file > built-in default"
_SECRET_WORDS = {"secret", "key", "password", "token"}  # a dest with one of these words is masked
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """A config file or environment variable that cannot be applied (names the key and source)."""


@dataclass(frozen=True)
class Setting:
    dest: str
    value: object
    source: str  # "config FILE", "env PDSERVE_X"


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE",
                        help=f"YAML file of settings (keys: flag names; also {CONFIG_ENV}); precedence: {PRECEDENCE}")


def apply_settings(parser: argparse.ArgumentParser, command: str, argv: list[str],
                   environ: Mapping[str, str] | None = None) -> list[Setting]:
    """Set parser defaults from the config file and the environment (the command line still
    wins, since argparse applies it over defaults). Returns the settings taken, for printing.
    Raises SettingsError for an unknown key or a value of the wrong type."""
    environ = os.environ if environ is None else environ
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config") and a.option_strings}
    taken: dict[str, Setting] = {}
    config_path = _config_path(argv, environ)
    if config_path is not None:
        for dest, raw in _read_config(config_path, command).items():
            if dest not in actions:
                raise SettingsError(f"config {config_path}: unknown setting {dest!r} for `pdserve {command}`")
            taken[dest] = Setting(dest, _convert(actions[dest], raw, f"config {config_path}"), f"config {config_path}")
    for dest, action in actions.items():
        name = ENV_PREFIX + dest.upper()
        if name in environ:
            taken[dest] = Setting(dest, _convert(action, environ[name], f"env {name}"), f"env {name}")
    for setting in taken.values():
        actions[setting.dest].required = False  # supplied: the command line may leave it out
    parser.set_defaults(**{s.dest: s.value for s in taken.values()})
    return list(taken.values())


def describe(args: argparse.Namespace, parser: argparse.ArgumentParser, taken: list[Setting]) -> str:
    """One line per setting that differs from its built-in default, with its source; secrets
    are masked."""
    sources = {s.dest: s.source for s in taken}
    defaults = {a.dest: a.default for a in parser._actions}
    lines = [f"settings ({PRECEDENCE}):"]
    for dest, value in sorted(vars(args).items()):
        if dest in ("command", "config") or (dest not in sources and value == defaults.get(dest)):
            continue
        shown = "***" if value is not None and _SECRET_WORDS & set(dest.split("_")) else value
        lines.append(f"  {dest} = {shown!r} ({sources.get(dest, 'command line')})")
    return "\n".join(lines)


def _config_path(argv: list[str], environ: Mapping[str, str]) -> Path | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1])
    return Path(environ[CONFIG_ENV]) if environ.get(CONFIG_ENV) else None


def _read_config(path: Path, command: str) -> dict[str, object]:
    """The file's top-level settings, overridden by its section named after the command
    (e.g. `proxy:`); other commands' sections are skipped. Keys may use - or _."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SettingsError(f"config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"config {path}: must be a mapping of settings, got {type(data).__name__}")
    from pdserve.cli import COMMANDS  # NOTE: here: cli imports this module

    # NOTE: a command's name with a mapping is its section; with a plain value it is a setting
    # (`pdserve up` has --prefill and --decode counts).
    sections = {name for name, _, _ in COMMANDS}
    flat = {k: v for k, v in data.items() if not (k in sections and isinstance(v, dict))}
    section = data.get(command) if isinstance(data.get(command), dict) else {}
    return {str(k).replace("-", "_"): v for k, v in {**flat, **section}.items()}


def _convert(action: argparse.Action, raw: object, source: str) -> object:
    """raw (a YAML value or an environment string) as the flag's type."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        return _as_bool(raw, action.dest, source)
    if raw is None:
        return None
    try:
        value = action.type(raw) if action.type is not None and not isinstance(raw, bool) else raw
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{source}: {action.dest} = {raw!r}: {exc}") from exc
    if isinstance(value, (list, dict)) or (isinstance(raw, bool) and action.type not in (None, str)):
        raise SettingsError(f"{source}: {action.dest} = {raw!r} is not a {getattr(action.type, '__name__', 'str')}")
    value = str(value) if action.type is None else value
    if action.choices is not None and value not in action.choices:
        raise SettingsError(f"{source}: {action.dest} = {value!r} is not one of {list(action.choices)}")
    return value


def _as_bool(raw: object, dest: str, source: str) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise SettingsError(f"{source}: {dest} = {raw!r} is not a boolean (true/false)")
