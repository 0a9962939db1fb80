"""pdserve.huge_heap: when the tunable is added (and when the operator's setting stands), and
that a process restarted with it gets its torch tensors on transparent huge pages."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from pdserve.huge_heap import TUNABLE, huge_heap_environ, huge_heap_environ_here, thp_mode

GLIBC = ("glibc", "2.36")


def test_adds_the_tunable_alone_or_after_the_others():
    assert huge_heap_environ({"A": "1"}, GLIBC, "madvise") == {"A": "1", "GLIBC_TUNABLES": f"{TUNABLE}=1"}
    environ = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert huge_heap_environ(environ, GLIBC, "always")["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}=1"
    assert environ == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}  # the caller's mapping untouched


def test_the_operators_setting_stands():
    for value in ("0", "1", "2"):
        assert huge_heap_environ({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}={value}"},
                                 GLIBC, "madvise") is None
    # a longer name that starts with the tunable's is another tunable
    assert huge_heap_environ({"GLIBC_TUNABLES": f"{TUNABLE}x=0"}, GLIBC, "madvise") is not None


def test_nothing_to_add_without_glibc_235_or_without_thp():
    assert huge_heap_environ({}, ("glibc", "2.34"), "madvise") is None
    assert huge_heap_environ({}, ("glibc", "2.35"), "madvise") is not None
    assert huge_heap_environ({}, ("", ""), "madvise") is None  # musl, other systems
    assert huge_heap_environ({}, ("glibc", "unknown"), "madvise") is None
    assert huge_heap_environ({}, GLIBC, "never") is None
    assert huge_heap_environ({}, GLIBC, None) is None


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert thp_mode(path) == "madvise"
    path.write_text("[always] madvise never\n")
    assert thp_mode(path) == "always"
    assert thp_mode(tmp_path / "absent") is None


# A child that restarts itself, then reports its GLIBC_TUNABLES and the huge pages under a 64 MB
# tensor it filled (smaps' AnonHugePages of the mappings the tensor spans).
CHILD = textwrap.dedent("""
    import os
    from pdserve.huge_heap import restart_with_huge_heap
    restart_with_huge_heap()
    import torch
    tensor = torch.empty(16 << 20).fill_(1.0)
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    huge_kb, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low < end and start < high
        elif inside and head == "AnonHugePages:":
            huge_kb += int(line.split()[1])
    print(huge_kb, os.environ.get("GLIBC_TUNABLES", ""))
""")


def run_child(environ: dict[str, str]) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                          cwd=os.getcwd(), env=environ)
    assert done.returncode == 0, done.stderr
    huge_kb, _, tunables = done.stdout.strip().partition(" ")
    return tunables, int(huge_kb)


def test_a_restarted_process_has_its_tensors_on_huge_pages():
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    tunables, huge_kb = run_child(base)
    if huge_heap_environ_here(base) is None:  # no glibc 2.35+ or no THP here: no restart
        assert TUNABLE not in tunables
        return
    assert tunables == f"{TUNABLE}=1"
    assert huge_kb >= 32 << 10  # of the tensor's 64 MB (its ends need not be 2 MiB-aligned)
    # The control: an operator's 0 stands, and (where THP takes advice only) nothing is huge.
    tunables, huge_kb = run_child({**base, "GLIBC_TUNABLES": f"{TUNABLE}=0"})
    assert tunables == f"{TUNABLE}=0"
    if thp_mode() == "madvise":
        assert huge_kb == 0
