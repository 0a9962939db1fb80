"""benchmarks/gpu_engine.py, the GPU slot's engine benchmark, checked on the CPU at toy sizes
(--smoke): every phase runs and its record holds what the docs' table reads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import render_results

REPO = Path(__file__).resolve().parents[2]


def test_every_phase_runs_and_is_recorded(tiny_model_dir, tmp_path):
    env = {**os.environ, "PDSERVE_RESULTS_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_engine.py", "--smoke", "--device", "cpu", "--model", str(tiny_model_dir),
         "--presets", "tiny", "--kv-cache-gb", "0.1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [record_file] = tmp_path.glob("gpu_engine-*.json")
    result = json.loads(record_file.read_text())["result"]
    [preset] = result["presets"]
    assert [row["batch"] for row in preset["decode"]] == [1, 3]
    assert [row["batch"] for row in preset["decode_eager"]] == [2]
    assert preset["graphs"]["sizes"] == [1, 2, 3] and preset["mixed_graphs"]["sizes"] == [32, 64, 128]
    assert [row["prompt_len"] for row in preset["prefill"]] == [32, 64]
    for key in ("short_prefill", "short_prefill_eager"):
        assert [row["prompt_len"] for row in preset[key]] == [16, 40] and all(row["ms"] > 0 for row in preset[key])
    for row in preset["decode"] + preset["decode_eager"]:
        assert row["bound_ms"] > 0 and row["step_ms_min"] <= row["step_ms_median"] <= row["step_ms_max"]
    assert preset["offline"]["output_tokens_per_s"] > 0 and preset["hf"]["output_tokens_per_s"] > 0
    for key, temperature in (("offline", 0.0), ("offline_sampled", 1.0)):
        run = preset[key]
        assert run["temperature"] == temperature and run["prefill_steps"] >= 1 and run["decode_steps"] >= 1
        assert 0 < run["prefill_steps_s"] + run["decode_steps_s"] <= run["seconds"]
    assert {(row["proj"], row["rows"]) for row in preset["layouts"]} == {
        (proj, rows) for proj in ("qkv", "o", "gate_up", "down", "lm_head") for rows in (1, 3)}
    assert all(row["us_wt"] > 0 and row["us_w"] > 0 for row in preset["layouts"])
    [profiled] = preset["profile"]  # on the CPU, the aten ops' own time stands in for the kernels
    assert profiled["batch"] == 3 and profiled["busy_ms_per_step"] > 0 and profiled["kernels_per_step"] > 0
    assert profiled["top"] and all(k["us_per_step"] > 0 and k["calls_per_step"] > 0 for k in profiled["top"])
    assert sum(c["us_per_step"] for c in profiled["categories"].values()) == pytest.approx(
        profiled["busy_ms_per_step"] * 1e3)
    assert "RESULT {" in proc.stdout
    # The profile phase runs last: on a GPU the profiler's CUPTI stays attached after it and slows what follows.
    assert proc.stdout.rindex("transformers generate") < proc.stdout.index("profile batch")
    # The docs render such a record (smoke runs are left out there: taken as a real run here), and
    # plot it: the first GPU record must not meet a renderer that never ran.
    [record] = render_results.load(tmp_path)
    record["result"]["smoke"] = False
    record["result"]["presets"][0]["decode_w"] = [{**row, "step_ms_median": 7.125} for row in preset["decode"]]
    # the GPU-only parts: the fused small-batch layers' decode phase, the Triton kernel's layout columns
    record["result"]["presets"][0]["decode_fused"] = [{**preset["decode"][0], "step_ms_median": 6.375}]
    tunings = [{"block_n": 64, "num_warps": 4, "num_stages": 2, "min_tokens_per_split": 256},
               {"block_n": 128, "num_warps": 8, "num_stages": 3, "min_tokens_per_split": 256}]
    record["result"]["presets"][0]["attention"] = [
        {"batch": b, "tuning": t, "default": i == 0, "us": 10.0 * b + i, "of_copy_bw": 0.5}
        for b in (1, 256) for i, t in enumerate(tunings)]
    record["result"]["presets"][0]["layouts"][0].update(
        us_small_wt=2.5, us_small_w=1.75, of_copy_bw_small_w=0.75, of_copy_bw_small_wt=0.25,
        small_tunings=[{"tuning": {"tile_bytes": 1024, "num_warps": 4, "num_stages": 2}, "us": 3.25,
                        "of_copy_bw": 0.625}])
    blocks, plots = render_results.render([record])
    assert "No results" not in blocks["gpu_engine"] and "**tiny**" in blocks["gpu_engine"], blocks["gpu_engine"]
    assert "where a decode step's time goes" in blocks["gpu_engine"] and "one prompt alone" in blocks["gpu_engine"]
    assert "as graph pieces, 3 buckets" in blocks["gpu_engine"]
    assert "weights as stored" in blocks["gpu_engine"] and "7.125 ms" in blocks["gpu_engine"]
    assert "| 128, 8, 3, 256 | 11.0 us (50%) | 2,561.0 us (50%) |" in blocks["gpu_engine"], blocks["gpu_engine"]
    assert "| 1024, 4, 2 |" in blocks["gpu_engine"] and "| qkv | 1 | 3.2 us (62%) |" in blocks["gpu_engine"]
    assert "fused small-batch layers" in blocks["gpu_engine"] and "6.375 ms" in blocks["gpu_engine"]
    assert "| 2.5 us (25%) | 1.8 us (75%) |" in blocks["gpu_engine"], blocks["gpu_engine"]
    assert "temperature 1" in blocks["gpu_engine"] and "| lm_head | 3 |" in blocks["gpu_engine"], blocks["gpu_engine"]
    for name, draw in plots:
        draw(tmp_path / name)
        assert (tmp_path / name).stat().st_size > 0


def test_profiled_kernels_are_sorted_by_kind():
    from benchmarks.gpu_engine import kernel_category

    kinds = {"nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NNT": "matmul", "sm90_xmma_gemm_bf16bf16_bf16f32": "matmul",
             "void splitKreduce_kernel<32, 16, int, float>": "matmul", "_rms_norm_kernel": "norm",
             "_decode_attention_kernel": "attention", "_decode_reduce_kernel": "attention",
             "_prefill_attention_kernel": "attention", "_rotary_write_kv_kernel": "rotary+kv",
             "_silu_and_mul_kernel": "silu", "_small_linear_kernel": "matmul", "_qkv_rotary_kernel": "matmul",
             "Memcpy HtoD (Pinned -> Device)": "copy",
             "void at::native::index_elementwise_kernel<128, 4>": "copy",
             "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, ArgMaxOps>>": "sampling",
             "void something_else": "other"}
    assert {name: kernel_category(name) for name in kinds} == kinds


_FAILING_RUN = """
import os, signal, sys
sys.argv = sys.argv[:1] + sys.argv[2:]
import benchmarks.gpu_engine as bench

def prefill_fails(*args, **kwargs):
    raise RuntimeError("a stand-in failure")

def offline_stopped(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # the step's timeout, as gpu_checks.sh's timeout sends it

bench.run_prefill = prefill_fails
bench.run_offline = offline_stopped
raise SystemExit(bench.main())
"""


def test_a_failed_phase_costs_itself_only_and_sigterm_writes_what_ended(tiny_model_dir, tmp_path):
    """prefill raises: its error is recorded and the phases after it run; SIGTERM comes in the
    offline phase: the record of what ended is written all the same."""
    env = {**os.environ, "PDSERVE_RESULTS_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", _FAILING_RUN, "-", "--smoke", "--device", "cpu", "--model", str(tiny_model_dir),
         "--presets", "tiny", "--kv-cache-gb", "0.1", "--phases", "decode,prefill,layouts,offline,eager"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "prefill failed: RuntimeError('a stand-in failure')" in proc.stdout, proc.stdout[-3000:] + proc.stderr
    [record_file] = tmp_path.glob("gpu_engine-*.json")
    result = json.loads(record_file.read_text())["result"]
    assert result["stopped"] == "stopped by signal 15"
    [preset] = result["presets"]
    assert "a stand-in failure" in preset["prefill_error"] and "prefill" not in preset
    assert preset["decode"] and preset["short_prefill"] and preset["layouts"]  # before the failure and after it
    assert "offline" not in preset and "decode_eager" not in preset  # the signal ended the run there


def test_the_attention_phase_reads_the_engines_cache_through_a_graph_wide_table(tiny_model_dir, monkeypatch):
    """run_attention (GPU only in the script) on the CPU, its kernel interpreted and its timer a single
    call: a row per batch and tuning, each call given the batch's sequences on blocks of their own."""
    from benchmarks import gpu_engine
    from engine.llm import LLM
    from kernels.triton import decode_attention as triton_decode

    monkeypatch.setattr(gpu_engine, "S", gpu_engine.SmokeSizes)
    tunings = (triton_decode.DEFAULT_TUNING, triton_decode.Tuning(min_tokens_per_split=64))
    monkeypatch.setattr(gpu_engine, "ATTENTION_TUNINGS", tunings)
    calls = []

    def once(fns, calls_=20):
        out = fns[0]()
        calls.append((fns[0].args, fns[0].keywords["tuning"], len(fns), out))
        return 1e-6

    monkeypatch.setattr(gpu_engine, "_timed_calls", once)
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="bfloat16", kernel_backend="reference", max_model_len=256,
              num_blocks=64, enable_prefix_caching=False)
    rows = gpu_engine.run_attention(llm, {"copy_bandwidth_gbs": 100.0})
    cfg = llm.engine.config.model
    assert [(row["batch"], row["default"]) for row in rows] == [(1, True), (1, False), (3, True), (3, False)]
    assert all(row["us"] == 1.0 and row["of_copy_bw"] > 0 for row in rows)
    for (query, layer, table, lens, _), _, num_layers, out in calls:
        assert num_layers == cfg.num_layers and layer.shape[0] == llm.engine.kv_cache.shape[0]
        assert table.shape[1] == 256 // llm.engine.block_size  # as wide as the decode graphs' tables
        blocks = table[:, : -(-int(lens[0]) // llm.engine.block_size)]
        assert blocks.unique().numel() == blocks.numel()  # each sequence on blocks of its own
        assert out.shape == query.shape
    assert {tuning for _, tuning, _, _ in calls} == set(tunings)
    llm.close()


def test_the_layouts_phase_times_the_small_batch_kernel_on_both_forms_and_its_tunings(tiny_model_dir, monkeypatch):
    """run_layouts' Triton columns (GPU only in the script) on the CPU, the kernel interpreted and the
    timer a single call: each projection's kernel output equals x @ W^T on either form, at up to
    SMALL_ROWS rows, and at one row and the most rows timed under every tuning (here one whose programs
    are 32 columns wide, ragged on every projection's width but the LM head's)."""
    from benchmarks import gpu_engine
    from engine.llm import LLM
    from kernels.triton.small_linear import DEFAULT_SMALL_TUNING, SmallTuning

    monkeypatch.setattr(gpu_engine, "S", gpu_engine.SmokeSizes)
    monkeypatch.setattr(gpu_engine, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_engine, "TRITON_ON_CPU", True)  # conftest set TRITON_INTERPRET=1
    monkeypatch.setattr(gpu_engine, "SMALL_TUNINGS", (SmallTuning(tile_bytes=256, num_stages=2, block_n=32),))
    checked = []

    def once(fns, calls_=20):
        fn = fns[0]
        out = fn()
        if fn.func is gpu_engine.small_linear:
            x, weight_t = fn.args
            torch.testing.assert_close(out[0].float(), (x @ weight_t).float(), atol=0.05, rtol=0.05)
            checked.append((x.shape[0], weight_t.is_contiguous(), fn.keywords.get("tuning", DEFAULT_SMALL_TUNING)))
        return 1e-6

    monkeypatch.setattr(gpu_engine, "_timed_calls", once)
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="bfloat16", kernel_backend="reference", num_blocks=16,
              enable_prefix_caching=False)
    rows = gpu_engine.run_layouts(llm, {"copy_bandwidth_gbs": 100.0})
    llm.close()
    assert [(row["proj"], row["rows"]) for row in rows] == [
        (proj, m) for proj in ("qkv", "o", "gate_up", "down", "lm_head") for m in (1, 3)]
    assert all(row["us_small_w"] > 0 and row["us_small_wt"] > 0 for row in rows)
    assert all(len(row["small_tunings"]) == 1 for row in rows)
    tuned = SmallTuning(tile_bytes=256, num_stages=2, block_n=32)
    assert sorted(set(checked), key=str) == sorted({(1, True, DEFAULT_SMALL_TUNING), (1, False, DEFAULT_SMALL_TUNING),
                                                   (3, True, DEFAULT_SMALL_TUNING), (3, False, DEFAULT_SMALL_TUNING),
                                                   (1, False, tuned), (3, False, tuned)}, key=str)
