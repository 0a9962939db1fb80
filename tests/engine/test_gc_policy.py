"""engine.gc_policy: once start-up is frozen, a full collection traverses only what came after it.
Run in a process of its own (a frozen object that later ends in a cycle is never freed: not pytest's)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import child_env

_PROBE = """
import gc, json
import proxy.app  # the proxy's start-up imports (FastAPI, pydantic, tokenizers, ...)
from engine.gc_policy import freeze_start_up_objects
before = len(gc.get_objects())
frozen = freeze_start_up_objects()
print(json.dumps({"before": before, "frozen": frozen, "count": gc.get_freeze_count(),
                  "tracked": len(gc.get_objects())}))
"""


def test_start_up_objects_are_frozen_out_of_the_collectors_reach():
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["before"] > 20_000 and seen["frozen"] == seen["count"]
    assert seen["frozen"] > 0.9 * seen["before"]  # start-up's own garbage collected, the rest frozen
    assert seen["tracked"] < 0.01 * seen["frozen"], seen  # what a full collection still traverses
