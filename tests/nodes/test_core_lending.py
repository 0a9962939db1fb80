"""node.core_lending's two sides on one shared byte: the borrower runs on the lender's cores too
(its stepping thread's affinity and torch's thread count) exactly while the lender says it is
idle and its own next step has no prompt to prefill, and back on its own cores once the lender
has work or it has a prompt. In a child process, so that pytest's own
affinity and threads stay as they are."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import os, sys, torch
    from node.core_lending import Borrower, Lender
    own, lent, path = {int(sys.argv[1])}, {int(sys.argv[2])}, sys.argv[3]
    os.sched_setaffinity(0, own)
    torch.set_num_threads(1)
    lender, borrower = Lender(path), Borrower(path, lent)
    seen = []
    for busy, prefilling in ((True, False), (False, False), (False, False), (True, False), (False, False),
                             (False, True), (True, True), (False, False)):
        lender.tell(busy)
        borrower.update(prefilling=prefilling)
        seen.append((sorted(os.sched_getaffinity(0)), torch.get_num_threads(), borrower.is_borrowing))
    print(seen, borrower.num_switches)
""")


def test_the_borrower_follows_the_lenders_flag_and_its_own_prompts(tmp_path):
    assert len(os.sched_getaffinity(0)) >= 2, "lending needs two cores (CI has two)"
    own, lent = sorted(os.sched_getaffinity(0))[:2]
    flag = tmp_path / "flag"
    flag.write_bytes(b"\x01")  # as pdserve.launcher makes it: busy
    done = subprocess.run([sys.executable, "-c", CHILD, str(own), str(lent), str(flag)], capture_output=True,
                          text=True, timeout=120, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr
    alone, both = ([own], 1, False), ([own, lent], 2, True)
    assert done.stdout.strip() == f"{[alone, both, both, alone, both, alone, alone, both]} 5"
