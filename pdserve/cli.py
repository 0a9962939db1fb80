"""The `pdserve` command: subcommands backed by modules imported only when chosen, so
`pdserve proxy` never loads torch."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from pdserve.huge_heap import restart_with_huge_heap
from pdserve.logs import configure as configure_logs
from pdserve.settings import SettingsError, add_config_argument, apply_settings, describe

# (name, module with add_arguments(parser) and main(args), help)
COMMANDS = [
    ("up", "pdserve.launcher", "start proxy + prefill + decode nodes on this machine"),
    ("proxy", "proxy.main", "start the OpenAI-compatible proxy alone"),
    ("prefill", "prefill_node.main", "start one prefill node"),
    ("decode", "decode_node.main", "start one decode (or colocated) node"),
    ("generate", "pdserve.generate", "offline completions for prompts"),
    ("make-model", "pdserve.make_model", "write a checkpoint: the real SmolLM2 (--preset smollm2) or a random preset"),
    ("bench", "pdserve.bench", "drive an OpenAI endpoint and report latency/throughput"),
    ("tune", "pdserve.tune", "choose the P:D split and batch limits that maximize goodput under SLOs"),
    ("env", "pdserve.env", "what this machine offers: versions, CPU kernel levels, backends, GPUs, NIXL, RDMA"),
]


SERVERS = ("up", "proxy", "prefill", "decode")  # print their effective settings at start
# The commands that run the model: run as the program, they restart at once with glibc's heap on
# huge pages (pdserve.huge_heap).
MODEL_COMMANDS = ("prefill", "decode", "generate")


def version() -> str:
    """The installed distribution's version, with the commit where a git checkout is at hand."""
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    try:
        text = version("pdserve")
    except PackageNotFoundError:
        text = "(not installed)"
    head = Path(__file__).resolve().parents[1] / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            ref = (head.parent / ref[5:]).read_text().strip()
        return f"{text} (commit {ref[:7]})"
    except OSError:
        return text


def _show_every_default(parser: argparse.ArgumentParser) -> None:
    """--help gives each option's default where its help text does not already say it (an option
    whose default is None or empty is decided elsewhere, which its help says)."""
    for action in parser._actions:
        if not action.option_strings or action.default in (None, "", argparse.SUPPRESS):
            continue
        if "default" not in (action.help or "").lower():
            action.own_help = action.help  # the reference's table has a default column of its own
            action.help = f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"


def _parser(chosen: str | None) -> tuple[argparse.ArgumentParser, object | None, argparse.ArgumentParser | None]:
    """The whole parser, and the chosen subcommand's module and subparser (None if none)."""
    parser = argparse.ArgumentParser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
    parser.add_argument("--version", action="version", version=f"pdserve {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    module = chosen_parser = None
    for name, module_name, help_text in COMMANDS:
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                # Only the subcommand's own module (or its package) missing; a broken import inside it raises.
                if exc.name == module_name or module_name.startswith(f"{exc.name}."):
                    print(f"pdserve {name}: not available: {module_name} missing", file=sys.stderr)
                    sys.exit(2)
                raise
            module.add_arguments(sub)
            add_config_argument(sub)
            _show_every_default(sub)
            chosen_parser = sub
    return parser, module, chosen_parser


def main(argv: list[str] | None = None) -> int:
    """The command line argv (None: this program's own, sys.argv[1:]); returns the exit code."""
    is_program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    if is_program and chosen in MODEL_COMMANDS:
        restart_with_huge_heap()
    parser, module, chosen_parser = _parser(chosen if chosen in {c[0] for c in COMMANDS} else None)
    taken = []
    if chosen_parser is not None:
        try:
            taken = apply_settings(chosen_parser, chosen, argv)
        except SettingsError as exc:
            print(f"pdserve {chosen}: {exc}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command in SERVERS:
        settings = f"pdserve {args.command}: {describe(args, chosen_parser, taken)}"
        if getattr(args, "log_format", "text") == "json":
            configure_logs(getattr(args, "log_level", "INFO"), "json")
            logging.getLogger("pdserve.settings").info("%s", settings)
        else:
            configure_logs(getattr(args, "log_level", "INFO"), "text")
            print(settings, file=sys.stderr, flush=True)
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
