"""benchmarks/gpu_checks.sh, the one command a lent GPU runs, checked here with stand-ins for
python3 and nvidia-smi (each call logged, one step made to fail): every step runs in order with
the command lines its scripts accept, a failed step is recorded and the next ones still run, the
time budget bounds each step (a step without time left is skipped), and what comes back is at most
the 8 files a device call returns: the summary (as it grows), the results and one archive of all
the logs (after each step). The Python each step runs has its own CPU tests
(test_gpu_engine_bench.py, kv_transfer/test_ucx.py, e2e/test_gpu_served_smoke.py)."""

import os
import re
import stat
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = ["engine", "gpu_engine", "kv", "served", "kernels", "bench", "host"]


def _stand_in(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(tmp_path: Path, steps: list[str], total_s: int, failing: str = "",
         leaving: str = "") -> tuple[subprocess.CompletedProcess, list[str], Path]:
    bin_dir, out, calls = tmp_path / "bin", tmp_path / "out", tmp_path / "calls.log"
    bin_dir.mkdir()
    # python3: log the arguments (one line a call); the script named in FAIL_ON exits 3, everything else 0;
    # the one named in LEAVE_ON leaves a process running in a session of its own (as a step's servers run).
    _stand_in(bin_dir, "python3", f'{{ echo "$*" | tr "\\n" " "; echo; }} >> {calls}\n'
                                  f'case "$*" in *"$FAIL_ON"*) [ -n "$FAIL_ON" ] && exit 3;; esac\n'
                                  f'case "$*" in *"$LEAVE_ON"*) [ -n "$LEAVE_ON" ] && {{ setsid sleep 300 '
                                  f'</dev/null >/dev/null 2>&1 & echo $! >> {tmp_path}/left.pids; }};; esac\n'
                                  'echo "12 passed in 1.0s"\n')
    _stand_in(bin_dir, "nvidia-smi", 'echo "GPU 0: stand-in"\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TOTAL_S": str(total_s), "FAIL_ON": failing,
           "LEAVE_ON": leaving}
    proc = subprocess.run(["bash", "benchmarks/gpu_checks.sh", str(out), *steps], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in calls.read_text().splitlines()
             if "pip install" not in line and "pip list" not in line
             and not line.startswith(("-c", "-m pdserve.cli env"))]
    return proc, lines, out


def test_every_step_runs_in_order_with_its_scripts_arguments_and_the_summary_is_written(tmp_path):
    proc, calls, out = _run(tmp_path, STEPS, total_s=480, failing="kv_transfer_gpu.py")
    assert proc.returncode == 0, proc.stderr
    summary = (out / "summary.txt").read_text()
    exits = [line.split()[1:4] for line in summary.splitlines() if line.startswith("== ") and "imports" not in line]
    assert exits == [[step + ":", "exit", "3," if step == "kv" else "0,"] for step in STEPS]
    scripts = [next(word for word in call.split() if word.endswith(".py") or word == "pytest") for call in calls]
    assert scripts == ["pytest", "benchmarks/gpu_engine.py", "benchmarks/kv_transfer_gpu.py",
                       "benchmarks/gpu_served.py", "setup.py", "pytest", "benchmarks/kernels.py",
                       "benchmarks/host_ceiling.py"]
    assert "--presets llama-1b --budget-s 140" in calls[1]  # the step's 150 s, less 10
    assert "--log-dir" in calls[3] and "/served_logs" in calls[3]
    assert "tests/kernels -n 6" in calls[5] and "--deselect" in calls[5]  # the copy has no .git
    assert "--kernel-backend reference" in calls[7]  # the CPU kernels are not built on the device
    assert "== imports: ok" in summary  # the stand-in python3 imports everything
    every_call = (tmp_path / "calls.log").read_text().splitlines()
    assert every_call.index("-m pdserve.cli env ") < every_call.index(calls[0])  # what pdserve sees, before the steps
    assert "12 passed" in summary  # the test steps' counts
    # what comes back: the summary, results/ and the archive of everything
    assert sorted(p.name for p in out.iterdir()) == ["gpu_checks.tgz", "results", "summary.txt"]
    with tarfile.open(out / "gpu_checks.tgz") as archive:
        names = set(archive.getnames())
        assert {"./env.log", "./engine_tests.log", "./gpu_engine.log"} <= names, names
        assert archive.extractfile("./env.log").read().decode().startswith("GPU 0: stand-in")


def test_by_default_every_area_runs_once_and_the_commit_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_COMMIT", "abc1234")
    proc, calls, out = _run(tmp_path, [], total_s=500)
    assert proc.returncode == 0, proc.stderr
    summary = (out / "summary.txt").read_text()
    ran = [line.split()[1].rstrip(":") for line in summary.splitlines() if line.startswith("== ") and "exit" in line]
    assert ran == ["engine", "kv", "gpu_engine", "served", "tp", "stream"]
    with tarfile.open(out / "gpu_checks.tgz") as archive:
        assert "commit abc1234" in archive.extractfile("./env.log").read().decode()


def test_a_failed_import_stops_the_run_and_says_so(tmp_path):
    proc, calls, out = _run(tmp_path, ["kv"], total_s=100, failing="openai")
    assert proc.returncode == 1
    assert "== imports: FAILED" in (out / "summary.txt").read_text()
    assert calls == [] and (out / "gpu_checks.tgz").exists()  # no step ran; the logs came back


def test_the_time_budget_cuts_each_steps_limit(tmp_path):
    proc, calls, _ = _run(tmp_path, ["gpu_engine", "served"], total_s=100)
    assert proc.returncode == 0, proc.stderr
    [engine, served] = calls
    budget = int(engine.split("--budget-s ")[1].split()[0])
    assert 80 <= budget <= 90  # what is left of 100 s, less 10
    assert int(served.split("--budget-s ")[1].split()[0]) <= 95


def test_an_unknown_step_is_named_and_the_rest_still_run(tmp_path):
    proc, calls, out = _run(tmp_path, ["nonsense", "kv"], total_s=100)
    assert "unknown step nonsense" in proc.stdout
    # NOTE: a step's seconds are bash's SECONDS, which may tick during even a stand-in step
    lines = (out / "summary.txt").read_text().splitlines()[1:3]
    assert [re.sub(r", \d+ s$", ", N s", line) for line in lines] == ["== nonsense: exit 2, N s", "== kv: exit 0, N s"]
    assert any("kv_transfer_gpu.py" in call for call in calls)


def test_a_step_without_time_left_is_skipped(tmp_path):
    proc, calls, out = _run(tmp_path, ["kv", "served"], total_s=10)
    assert proc.returncode == 0, proc.stderr
    summary = (out / "summary.txt").read_text()
    assert "== kv: skipped" in summary and "== served: skipped" in summary
    assert calls == []  # nothing but the set-up ran


def test_the_stream_step_alone_makes_its_model_first(tmp_path):
    """The stream step reads the llama-1b model gpu_engine and served make: run alone (a rerun of
    that step), it makes the model first, where it is missing."""
    proc, calls, _ = _run(tmp_path, ["stream"], total_s=200)
    assert proc.returncode == 0, proc.stderr
    *make, stream = calls
    if not (REPO / ".cache" / "models" / "llama-1b-bf16" / "config.json").exists():
        [make] = make
        assert make.startswith("-m pdserve.cli make-model .cache/models/llama-1b-bf16 --preset llama-1b")
        assert "--dtype bfloat16 --device cuda" in make
    assert "benchmarks/kv_streaming.py" in stream and "--model-dir .cache/models/llama-1b-bf16" in stream


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def test_what_a_step_leaves_running_is_ended_before_the_next_and_nothing_else(tmp_path):
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)  # not the run's: left alone
    try:
        proc, calls, out = _run(tmp_path, ["served", "kv"], total_s=200, leaving="gpu_served.py")
        assert proc.returncode == 0, proc.stderr
        [left] = [int(pid) for pid in (tmp_path / "left.pids").read_text().split()]
        assert not _running(left)
        assert _running(bystander.pid)
        summary = (out / "summary.txt").read_text().splitlines()
        assert [line for line in summary if "ended" in line] == ["== served: ended 1 processes it left running"]
        assert summary.index("== served: ended 1 processes it left running") < next(
            i for i, line in enumerate(summary) if line.startswith("== kv: exit"))
    finally:
        bystander.kill()
        bystander.wait()
