"""benchmarks/host_ceiling.py: the engine's host side per decode step with the device's work free,
beside the newest GPU record's step. Its timed steps run the static decode path's replaced forward
(never the model), and its record holds what the docs' table reads."""

import json
import shutil
from pathlib import Path

from benchmarks import host_ceiling, render_results
from engine.model import CausalLM

REPO = Path(__file__).resolve().parents[2]


def _gpu_record(folder: Path, date: str, commit: str, step_ms: float, smoke: bool = False) -> None:
    record = {"benchmark": "gpu_engine", "date": date, "commit": commit,
              "result": {"hardware": {"gpu": "NVIDIA H200"}, "smoke": smoke,
                         "presets": [{"preset": "llama-1b", "decode": [{"batch": 1, "step_ms_median": step_ms}]},
                                     {"preset": "llama-8b", "error": "not run"}]}}
    (folder / f"gpu_engine-{date}-{commit}.json").write_text(json.dumps(record))


def test_the_newest_gpu_record_with_decode_steps_is_the_one_beside_and_a_smoke_run_never(tmp_path):
    assert host_ceiling.newest_gpu_steps(tmp_path) is None
    _gpu_record(tmp_path, "2026-12-01T00:00:00Z", "aaaaaaa", 2.0)
    _gpu_record(tmp_path, "2026-12-02T00:00:00Z", "bbbbbbb", 1.0)
    _gpu_record(tmp_path, "2026-12-03T00:00:00Z", "ccccccc", 9.0, smoke=True)  # a toy run on the CPU: not a GPU's
    assert host_ceiling.newest_gpu_steps(tmp_path) == {"gpu": "NVIDIA H200", "commit": "bbbbbbb",
                                                       "preset": "llama-1b", "step_ms": {"1": 1.0}}


def test_timed_steps_run_the_static_path_without_the_model_and_are_recorded(tiny_model_dir, tmp_path, monkeypatch):
    models = tmp_path / "models"
    shutil.copytree(tiny_model_dir, models / "tiny-seed0")
    monkeypatch.setattr(host_ceiling, "model_dir_for", lambda preset: models / f"{preset}-seed0")
    gpu = {"gpu": "NVIDIA H200", "commit": "c0e8b24", "preset": "llama-1b", "step_ms": {"1": 2.0}}
    monkeypatch.setattr(host_ceiling, "newest_gpu_steps", lambda: gpu)
    monkeypatch.setenv("PDSERVE_RESULTS_DIR", str(tmp_path / "results"))
    forwards = []
    real = CausalLM.forward

    def counted(self, input_ids, meta, *args):
        forwards.append(meta.num_decode_tokens == input_ids.shape[0])  # a decode-only step reached the model
        return real(self, input_ids, meta, *args)

    monkeypatch.setattr(CausalLM, "forward", counted)
    inside = []  # the model's calls while host_steps ran (not the engine's start-up warm-ups)
    real_steps = host_ceiling.host_steps

    def host_steps(*args):
        start = len(forwards)
        times = real_steps(*args)
        inside.extend(forwards[start:])
        return times

    monkeypatch.setattr(host_ceiling, "host_steps", host_steps)
    assert host_ceiling.main(["--batches", "1,3", "--steps", "4", "--prompt-len", "20"]) == 0
    [record_file] = (tmp_path / "results").glob("host_ceiling-*.json")
    record = {**json.loads(record_file.read_text()), "_file": record_file.name}
    rows = record["result"]["rows"]
    assert [(r["prefix_caching"], r["batch"]) for r in rows] == [(False, 1), (False, 3), (True, 1), (True, 3)]
    for r in rows:
        assert 0 < r["step_ms_min"] <= r["step_ms_median"] <= r["step_ms_max"]
        assert r["ceiling_tok_s"] > 0
    assert [r.get("host_over_gpu") is not None for r in rows] == [True, False, True, False]
    # The prompts' prefill ran the model; no decode-only step did (the model is the device's work, not timed).
    assert inside and not any(inside)
    lines, _ = render_results.RENDERERS["host_ceiling"]([record])
    assert any("host / GPU" in line for line in lines) and any("c0e8b24" in line for line in lines)
