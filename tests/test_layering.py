"""The import table of STYLE.md: no package imports what it may not, and the proxy stays torch-free."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OURS = {"kernels", "engine", "kv_transfer", "node", "prefill_node", "decode_node", "proxy", "pdserve"}
ALLOWED = {
    "kernels": set(),
    "engine": {"kernels"},
    "kv_transfer": set(),
    "node": {"engine", "kv_transfer"},
    "prefill_node": {"node", "engine", "kv_transfer"},
    "decode_node": {"node", "engine", "kv_transfer"},
    # NOTE: the torch-free modules of rules proxy and nodes share: messages and option ranges, the
    # model directory check, the grammar budget, the garbage collector's policy.
    "proxy": {"engine.protocol", "engine.sampling_rules", "engine.model_files", "engine.schema_budget",
              "engine.gc_policy"},
    # NOTE: the launcher starts nodes as processes (`pdserve prefill|decode`); it never imports
    # the node server, whose room is the nodes' alone.
    "pdserve": OURS - {"node"},
}


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_imports_follow_the_table():
    violations = []
    for package, allowed in ALLOWED.items():
        for path in sorted((REPO / package).rglob("*.py")):
            for name in imports_of(path):
                top = name.split(".")[0]
                if top not in OURS or top == package:
                    continue
                if not any(name == a or name.startswith(a + ".") for a in allowed):
                    violations.append(f"{path.relative_to(REPO)} imports {name}")
    assert not violations, "\n".join(violations)


def test_proxy_does_not_import_torch():
    code = ("import sys, proxy.app, proxy.main; "
            "bad = [m for m in ('torch', 'triton', 'nixl', 'transformers') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_package_init_files_stay_empty_except_the_lazy_offline_api():
    for package in OURS - {"engine"}:
        assert (REPO / package / "__init__.py").read_text().strip() == "", package
    assert "import torch" not in (REPO / "engine" / "__init__.py").read_text()
