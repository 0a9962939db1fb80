"""Renderers for docs/benchmarks.md's engine benchmarks on CPU: the compiled kernels, KV transfer,
the offline engine, decode latency, the host's share of a decode step and tensor parallelism (whose
section also holds its GPU runs).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from benchmarks.results_format import cpu, latest, num, provenance, pyplot, rng, save, table, with_plot


def render_kernels_cpu(records: list[dict]) -> tuple[list[str], list]:
    sections = {}
    for record in records:
        result = record["result"]
        if "decode_attention" in result and "ms_per_step" in result["decode_attention"]:
            sections[("decode_attention", cpu(record))] = (record, result["decode_attention"])
        for name, value in (result.get("compiled") or {}).items():
            if name != "device" and value:
                sections[(name, cpu(record))] = (record, value)
    lines, used = [], {}

    def note(record):
        used[record["_file"]] = record
        return record.get("commit") or record.get("date") or ""

    rows = []
    for (name, machine), (record, d) in sections.items():
        if name == "decode_attention":
            ms = d["ms_per_step"]
            rows.append([machine, num(ms.get("c_kernel")), num(ms.get("c_kernel_bf16")), num(ms.get("torch_ref")),
                         num(ms.get("gather_only")), num(d.get("kv_gbps")), note(record)])
    if rows:
        lines += ["**Paged decode attention**, one thread, ms per model step (30 layers):", ""]
        lines += table(["CPU", "C kernel, float32", "C kernel, bfloat16", "torch reference (gather + SDPA)",
                        "bare gather of the bytes", "K/V GB/s (float32)", "run"], rows) + [""]
    rows = []
    for (name, machine), (record, groups) in sections.items():
        if name == "projections_small_decode_step":
            for group in groups:
                for r in group.get("rows", []):
                    kernel_ms = next(v for k, v in r["ms_per_step"].items() if k != "onednn")
                    rows.append([machine, f"{group['dtype']} ({group.get('mb', '')} MB)", r["rows"], num(kernel_ms, 2),
                                 num(r["ms_per_step"]["onednn"], 2), f"{r['speedup']:.2f}x", note(record)])
    if rows:
        lines += ["**Projections of one decode step** (30 layers and the LM head, each weight read from memory), "
                  "small-batch kernel against oneDNN's prepacked linear, ms:", ""]
        lines += table(["CPU", "dtype", "rows", "kernel", "oneDNN", "speed-up", "run"], rows) + [""]
    rows = []
    for (name, machine), (record, d) in sections.items():
        if name == "gate_up_prefill" and isinstance(d, dict):
            for r in d["rows"]:
                ms = r["ms_30_layers"]
                errors = r.get("max_abs_err_vs_float64") or r.get("mean_abs_err_vs_float64") or {}
                rows.append([machine, r["rows"], num(ms["kernel"]), num(ms["onednn_then_silu_and_mul"]),
                             f"{r['speedup']:.2f}x", num(r.get("kernel_gflops")),
                             " / ".join(str(v) for v in errors.values()), note(record)])
    if rows:
        lines += ["**float32 gate/up projections with SiLU-and-mul in one pass** (30 layers' weights), against "
                  "oneDNN's linear then `silu_and_mul`, ms:", ""]
        lines += table(["CPU", "rows", "kernel", "oneDNN + silu_and_mul", "speed-up", "kernel GFLOP/s",
                        "error vs float64: kernel / oneDNN path", "run"], rows) + [""]
    rows = []
    for (name, machine), (record, items) in sections.items():
        if name == "prefill_attention":
            for a in items:
                if "ms" in a:
                    rows.append([machine, a["shape"], a["dtype"], num(a["ms"]["kernel"], 2),
                                 num(a["ms"]["sdpa_ref"], 2), f"{a['speedup']:.2f}x", note(record)])
    if rows:
        lines += ["**Prefill attention** against the per-sequence SDPA reference, ms:", ""]
        lines += table(["CPU", "shape", "dtype", "kernel", "SDPA", "speed-up", "run"], rows) + [""]
    rows = []
    for (name, machine), (record, heads) in sections.items():
        if name == "greedy_head":
            for head in heads:
                for r in head.get("rows", []):
                    rows.append([machine, head["head"], r["rows"], num(r["ms"]["greedy_head"], 2),
                                 num(r["ms"]["logits_argmax"], 2), f"{r['speedup']:.2f}x", note(record)])
    if rows:
        lines += ["**Greedy LM head** (the token without the logits) against the logits and their argmax, ms:", ""]
        lines += table(["CPU", "head", "rows", "greedy head", "logits + argmax", "speed-up", "run"], rows) + [""]
    lines += ["- " + provenance(record) for record in used.values()] + [""]
    return lines, []


def render_kv_transfer(records: list[dict]) -> tuple[list[str], list]:
    lines = []
    current = latest(records, lambda r: (cpu(r), r["result"].get("storage")))
    rows = []
    for record in current:
        for r in record["result"]["rows"]:
            scattered = num(r.get("nixl_gb_s"), 2)
            if r.get("nixl_descriptors") is not None:
                scattered += f" ({r['nixl_descriptors']:,})"
            contiguous = num(r.get("nixl_contiguous_gb_s"), 2)
            if r.get("nixl_contiguous_descriptors") is not None:
                contiguous += f" ({r['nixl_contiguous_descriptors']:,})"
            storage = record["result"].get("storage") or ""
            rows.append([cpu(record), f"{storage}-major" if storage in ("block", "layer") else storage,
                         f"{r['tokens']:,}", num(r.get("megabytes")),
                         num(r.get("copy_gb_s"), 2), scattered, contiguous, num(r.get("nixl_ratio"), 2),
                         num(r.get("nixl_latency_ms")), num(r.get("gloo_gb_s"), 2), record.get("commit") or "undated"])
    lines += table(["CPU", "caches", "tokens", "MB", "in-process copy GB/s", "NIXL, reader's blocks scattered GB/s "
                    "(descriptors)", "NIXL, contiguous GB/s (descriptors)", "NIXL / copy", "NIXL latency ms",
                    "gloo GB/s", "run"], rows)
    lines += [""] + ["- " + provenance(record) for record in current] + [""]
    return lines, []


def render_offline_throughput(records: list[dict]) -> tuple[list[str], list]:
    current = latest(records, lambda r: (cpu(r), r["result"].get("device")))
    rows = []
    for record in current:
        for r in record["result"]["results"]:
            rows.append([cpu(record), r["preset"], num(r["engine_tok_s"]), num(r.get("hf_single_tok_s")),
                         num(r.get("hf_batch_tok_s")),
                         f"**{r['engine_over_single']:.1f}x**" if r.get("engine_over_single") else "",
                         f"{r.get('num_identical', '')} of 64" if r.get("num_identical") is not None else "",
                         record.get("commit") or "undated"])
    lines = table(["device", "preset", "pdserve engine tok/s", "transformers, one prompt at a time",
                   "transformers, one batch", "engine / one at a time", "greedy equal", "run"], rows)
    lines += [""] + ["- " + provenance(record) for record in current] + [""]
    return with_plot(lines, "offline_throughput.png", "offline throughput", lambda path: plot_offline(current, path))


def plot_offline(current: list[dict], path: Path) -> None:
    plt = pyplot()
    panels = [(record, r) for record in current for r in record["result"]["results"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for ax, (record, r) in zip(axes[0], panels):
        labels = ["transformers\none at a time", "transformers\none batch", "pdserve\nengine"]
        values = [r.get("hf_single_tok_s") or 0, r.get("hf_batch_tok_s") or 0, r["engine_tok_s"]]
        ax.bar(labels, values, color=["#999", "#69c", "#e73"])
        ax.set_title("\n".join(textwrap.wrap(f"{r['preset']} on {cpu(record)}", 44)), fontsize=9)
        ax.set_ylabel("output tokens/s")
    save(fig, path)


def render_decode_latency(records: list[dict]) -> tuple[list[str], list]:
    current = latest(records, lambda r: (cpu(r), r["result"]["preset"], r["result"]["dtype"], r["result"]["threads"]))
    lines = []
    for record in current:
        result = record["result"]
        rows = [[r["batch"], (rng(r["tpot_ms_range"], 1) + " ms") if "tpot_ms_range" in r else
                 num(r["tpot_ms"], 2, " ms"), num(r.get("tok_s"))] for r in result["rows"]]
        lines += [f"`{result['preset']}`, {result['dtype']}, {result['threads']} thread(s):", ""]
        lines += table(["sequences", "TPOT", "tok/s"], rows) + ["", "- " + provenance(record), ""]
    return lines, []


def render_host_ceiling(records: list[dict]) -> tuple[list[str], list]:
    current = latest(records, lambda r: (cpu(r), r["result"]["preset"]))
    lines = []
    for record in current:
        result = record["result"]
        gpu = result.get("gpu_record")
        rows = [["on" if r["prefix_caching"] else "off", r["batch"], num(r["step_ms_median"], 3, " ms"),
                 num(r["us_per_sequence"], 1, " us"), num(r["ceiling_tok_s"], 0)]
                + ([num(r.get("gpu_step_ms"), 3, " ms"), num(r.get("host_over_gpu"), 2, "x")] if gpu else [])
                for r in result["rows"]]
        beside = (f"; the GPU's step: {gpu['preset']} on {gpu['gpu']} with CUDA graphs at {gpu['commit']} "
                  "(`gpu_engine`)") if gpu else ""
        lines += [f"{result['prompt_len']}-token prompts, median of {result['steps']} steps{beside}:", ""]
        lines += table(["prefix caching", "batch", "host a step", "a sequence", "tok/s at most"]
                       + (["GPU step", "host / GPU"] if gpu else []), rows)
        lines += ["", "- " + provenance(record), ""]
    return lines, []


def render_tensor_parallel(records: list[dict]) -> tuple[list[str], list]:
    runs = [r for r in records if not r["result"].get("smoke")]
    lines = []
    for device in ("cpu", "cuda"):
        mine = [r for r in runs if r["result"]["device"].startswith(device)]
        if not mine:
            lines += [f"*No {device.upper()} run recorded yet.*" if device == "cuda" else "*No CPU run yet.*", ""]
            continue
        record = mine[-1]
        result = record["result"]
        if "skipped" in result:
            lines += [f"{device.upper()}: not measured ({result['skipped']}).", "", "- " + provenance(record), ""]
            continue
        base = str(result["sizes"][0])
        rows = []
        for size, row in result["summary"].items():
            cells = [f"{num(row['decode_step_ms'][str(b)], 1)} ms ({row['decode_over_base'][str(b)]:.2f}x)"
                     for b in result["batches"]]
            prefill = f"{num(row['prefill_step_ms'], 1)} ms ({row['prefill_over_base']:.2f}x)"
            rows.append([f"TP={size}", *cells, prefill])
        lines += [f"`{result['preset']}`, {result['dtype']}, {device.upper()}, {result['threads']} threads in all; "
                  f"median of {result['rounds']} alternated rounds, ratios against TP={base} in the same round.", ""]
        lines += table(["ranks", *[f"decode step, batch {b}" for b in result["batches"]],
                        f"prefill step, {result['prefill_len']} tokens"], rows)
        lines += ["", "- " + provenance(record), ""]
    return lines, []


def render_kv_transfer_tp(records: list[dict]) -> tuple[list[str], list]:
    record = records[-1]
    r = record["result"]
    shape = r["layout"]
    lines = [f"{r['tokens']:,} tokens of a {shape['num_layers']}-layer, {shape['num_kv_heads']}-KV-head "
             f"{shape['dtype']} cache, stored {r['storage']}-major on both sides, NIXL between two processes, "
             f"median of {r['repeats']} reads:", ""]
    rows = [[split, num(row["latency_ms"], 1) + " ms", num(row["gb_s"], 2), f"{row['descriptors']:,}",
             f"{row['latency_over_1_1']:.2f}x"] for split, row in r["splits"].items()]
    lines += table(["holder:reader ranks", "latency", "GB/s", "descriptors", "vs 1:1"], rows)
    return lines + ["", "- " + provenance(record), ""], []
