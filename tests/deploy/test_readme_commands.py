"""The manual and the docs site show commands the CLI takes: every `pdserve ...` line of a bash
code block in README.md and docs/**/*.md parses with pdserve's own parser (settings from the
environment applied, as the deployment guide exports the cluster secret), and the deployment
guide's by-hand nodes bind 0.0.0.0 with an advertised address."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.settings import apply_settings

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
GUIDE = ROOT / "docs" / "deployment.md"
# Shell variables the pages use in command lines, with values the parsers take.
VARIABLES = {"$ADMIN_TOKEN": "t" * 24, "$T": "t" * 24}
# A command may start with environment assignments (UCX_TCP_PORT_RANGE=... pdserve decode ...).
_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:\.venv/bin/)?pdserve\s")


def commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, argv after `pdserve`) of every pdserve command line in the text's bash blocks;
    a trailing backslash continues a line, a # starts a comment."""
    found = []
    for block in re.finditer(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S):
        first_line = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).split("\n")
        idx = 0
        while idx < len(lines):
            start, line = idx, lines[idx]
            while line.rstrip().endswith("\\") and idx + 1 < len(lines):
                idx += 1
                line = line.rstrip()[:-1] + " " + lines[idx]
            idx += 1
            line = line.split(" #", 1)[0].strip()
            if _PREFIX.match(line):
                for name, value in VARIABLES.items():
                    line = line.replace(f'"{name}"', value).replace(name, value)
                words = shlex.split(line)
                while "=" in words[0]:
                    words.pop(0)
                found.append((first_line + start, words[1:]))
    return found


def _cases() -> list:
    cases = []
    for page in PAGES:
        for lineno, argv in commands(page.read_text()):
            where = f"{page.relative_to(ROOT)}:{lineno}"
            cases.append(pytest.param(where, argv, id=f"{where}-{argv[0] if argv else ''}"))
    return cases


def _guide_section() -> str:
    text = GUIDE.read_text()
    return text[text.index("## Several hosts"):text.index("### Nodes joining and leaving")]


def test_the_pages_show_pdserve_commands():
    assert {argv[0] for page in PAGES for _, argv in commands(page.read_text())} >= {
        "up", "prefill", "decode", "proxy", "generate", "make-model", "bench", "tune"}


def test_the_guide_has_by_hand_commands_for_every_role():
    assert {argv[0] for _, argv in commands(_guide_section())} >= {"prefill", "decode", "proxy"}


def test_the_readme_shows_make_run_and_make_test():
    text = (ROOT / "README.md").read_text()
    assert "make run" in text and "make test" in text


@pytest.mark.parametrize(("where", "argv"), _cases())
def test_every_command_parses(where, argv, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "s" * 24)
    assert argv and argv[0] in {name for name, _, _ in cli.COMMANDS}, f"{where}: unknown subcommand {argv[:1]}"
    parser, _, chosen = cli._parser(argv[0])
    apply_settings(chosen, argv[0], argv)
    try:
        parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `pdserve {shlex.join(argv)}` does not parse: {capsys.readouterr().err.strip()}")


@pytest.mark.parametrize("argv", [argv for _, argv in commands(_guide_section())], ids=lambda argv: argv[0])
def test_by_hand_nodes_bind_every_interface_and_advertise_an_address(argv, monkeypatch):
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "s" * 24)
    parser, _, chosen = cli._parser(argv[0])
    apply_settings(chosen, argv[0], argv)
    args = parser.parse_args(argv)
    if argv[0] in ("prefill", "decode"):
        assert (args.host, args.cluster_secret) == ("0.0.0.0", "s" * 24)
        assert args.advertise_host and args.advertise_host != "0.0.0.0"


_SCRIPT = re.compile(r"^(?:\.venv/bin/python|python3?)\s+((?:benchmarks|docs)/\S+\.py)(.*)$")


def script_commands(text: str) -> list[tuple[str, list[str]]]:
    """(script path, its --flags) of every `.venv/bin/python benchmarks/X.py ...` line of the text's
    bash blocks (continuations joined, comments dropped)."""
    found = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            match = _SCRIPT.match(line.split(" #", 1)[0].strip())
            if match:
                found.append((match.group(1), re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", match.group(2))))
    return found


def test_every_script_command_names_a_script_and_flags_it_has():
    """The scripts build their parsers inside main(), so a flag is checked by its name in the
    script's text (as argparse or a sys.argv check spells it)."""
    checked = 0
    for page in PAGES:
        for script, flags in script_commands(page.read_text()):
            path = ROOT / script
            assert path.exists(), f"{page.relative_to(ROOT)}: {script} does not exist"
            text = path.read_text()
            for flag in flags:
                assert f'"{flag}"' in text, f"{page.relative_to(ROOT)}: {script} has no {flag}"
            checked += 1
    assert checked >= 10


_IMPORT_ALL = """
import importlib.util, pathlib, sys
failed = []
for path in sorted(pathlib.Path("benchmarks").glob("*.py")):
    name = "bench_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - each failure is reported
        failed.append(f"{path}: {type(exc).__name__}: {exc}")
print("\\n".join(failed))
"""


def test_every_benchmark_script_imports():
    """Module-level code only (each script's work is in main()): a name a refactor moved away
    from under a script fails here, not on the day someone runs it."""
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", done.stdout
