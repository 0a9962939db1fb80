"""The docs site: it builds with `mkdocs build --strict` (a warning, a broken link or anchor, a
missing image or a page left out of the nav fails), its configuration reference is what the CLI's
parsers give now, and its benchmark tables are what benchmarks/results/ holds now."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen_config():
    return _script(ROOT / "docs" / "gen_config_reference.py")


@pytest.fixture(scope="module")
def render_results():
    return _script(ROOT / "benchmarks" / "render_results.py")


def test_the_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "WARNING" not in out.stderr, out.stderr[-3000:]
    for page in ("index", "architecture", "openai", "configuration", "deployment", "operations", "slo-tuning",
                 "offline", "benchmarks"):
        assert (tmp_path / "site" / ("index.html" if page == "index" else f"{page}/index.html")).exists(), page


def test_the_configuration_reference_is_current(gen_config):
    fresh = gen_config.render()
    assert (ROOT / "docs" / "configuration.md").read_text() == fresh, (
        f"docs/configuration.md is stale: run {gen_config.COMMAND}")


def test_the_configuration_reference_lists_every_flag(gen_config):
    from pdserve import cli

    page = (ROOT / "docs" / "configuration.md").read_text()
    for name, _, _ in cli.COMMANDS:
        assert f"## pdserve {name}\n" in page
        _, _, sub = cli._parser(name)
        for action in sub._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert f"`{option}" in page, (name, option)


def test_the_benchmark_tables_are_current(render_results):
    blocks, plots = render_results.render(render_results.load())
    page = render_results.PAGE.read_text()
    assert render_results.fill(page, blocks) == page, f"docs/benchmarks.md is stale: run {render_results.COMMAND}"
    missing = [name for name, _ in plots if not (render_results.IMG / name).exists()]
    assert not missing, f"plots missing in docs/img/results: run {render_results.COMMAND}"


def test_every_result_file_has_its_provenance_and_a_renderer(render_results):
    records = render_results.load()
    assert records
    for record in records:
        assert {"benchmark", "date", "commit", "machine", "versions", "result"} <= record.keys(), record["_file"]
        assert record["benchmark"] in render_results.RENDERERS, record["_file"]
        assert record["_file"].startswith(record["benchmark"] + "-"), record["_file"]
