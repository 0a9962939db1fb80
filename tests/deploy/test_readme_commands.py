"""The README's deployment guide runs commands the CLI takes: every `pdserve ...` line of its
code blocks parses with pdserve's own parser (settings from the environment applied, as the
guide exports the cluster secret), and the by-hand nodes bind 0.0.0.0 with an advertised address."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.settings import apply_settings

README = Path(__file__).resolve().parents[2] / "README.md"


def _guide_commands() -> list[list[str]]:
    text = README.read_text()
    guide = text[text.index("## Deployment"):text.index("## Architecture")]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", guide, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("pdserve "):
                commands.append(shlex.split(line.replace("$ADMIN_TOKEN", "t" * 24))[1:])
    return commands


def test_the_guide_has_by_hand_commands_for_every_role():
    assert {argv[0] for argv in _guide_commands()} >= {"prefill", "decode", "proxy"}


@pytest.mark.parametrize("argv", _guide_commands(), ids=lambda argv: argv[0])
def test_every_guide_command_parses(argv, monkeypatch):
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "s" * 24)
    parser, _, chosen = cli._parser(argv[0])
    apply_settings(chosen, argv[0], argv)
    args = parser.parse_args(argv)
    if argv[0] in ("prefill", "decode"):
        assert (args.host, args.cluster_secret) == ("0.0.0.0", "s" * 24)
        assert args.advertise_host and args.advertise_host != "0.0.0.0"
