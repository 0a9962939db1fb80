"""node.process.keep_freed_memory: after it, the memory a step freed is there for the next steps
without faulting in fresh pages; without it (glibc's defaults), 20 steps of three 12 MB
activations fault in more than a step's worth afresh. In child processes: the setting is
process-wide."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

STEPS = 20
STEP_PAGES = 3 * (12 << 20) // os.sysconf("SC_PAGE_SIZE")
CHILD = textwrap.dedent(f"""
    import resource, sys, torch
    from node.process import keep_freed_memory
    kept = keep_freed_memory() if sys.argv[1] == "keep" else None
    def step():  # three 12 MB activations live at once, written, then freed
        live = [torch.empty(3 << 20).fill_(1.0) for _ in range(3)]
        del live
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range({STEPS}):
        step()
    print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def faults_of_steps(mode: str) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120,
                          cwd=os.getcwd())
    assert done.returncode == 0, done.stderr
    kept, faults = done.stdout.split()
    return kept, int(faults)


def test_freed_activations_are_kept_for_the_next_step():
    kept, faults = faults_of_steps("keep")
    # Measured: 3,072 or 6,144 (the heap settling in the first steps), against 12,238 or 125,294
    # with glibc's defaults (which trim and regrow the heap, in some runs every step).
    assert kept == "True" and faults <= STEP_PAGES
    _, faults = faults_of_steps("default")
    assert faults > STEP_PAGES  # the control: the same bound fails without it


def test_a_node_zeroes_its_kv_cache_at_start_but_not_when_restarted_from_a_standby(tiny_model_dir):
    import argparse

    from engine.protocol import Role
    from node.args import add_node_arguments, node_configs_from_args
    from node.process import start_configs

    parser = argparse.ArgumentParser()
    add_node_arguments(parser)
    configs = node_configs_from_args(parser.parse_args(["--model", str(tiny_model_dir)]), Role.DECODE)
    assert configs.engine.cache.prefault
    assert start_configs(configs, handed_over=False).engine.cache.prefault
    restarted = start_configs(configs, handed_over=True)
    assert not restarted.engine.cache.prefault and restarted.engine.cache.block_size == configs.engine.cache.block_size
