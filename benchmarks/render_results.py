"""Renders the current benchmark results (benchmarks/results/*.json, written by each benchmark
through results_io.write_result) into docs/benchmarks.md and docs/img/results/: each benchmark's
tables between its `<!-- results:NAME -->` and `<!-- /results:NAME -->` markers, and its plots
as PNGs. "Current" is the latest record per benchmark and what it measured on (machine, dtype,
preset, ...); older records stay in the folder as history.

    .venv/bin/python benchmarks/render_results.py           # rewrite the tables and the plots
    .venv/bin/python benchmarks/render_results.py --check   # exit 1 if the tables are stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img" / "results"
IMG_LINK = "img/results"  # from docs/benchmarks.md
COMMAND = ".venv/bin/python benchmarks/render_results.py"


def load(folder: Path = RESULTS) -> list[dict]:
    """Every record, oldest first (undated ones first of all)."""
    records = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        record["_file"] = path.name
        records.append(record)
    return sorted(records, key=lambda r: (r.get("date") or "", r["_file"]))


def latest(records: list[dict], key: Callable[[dict], object]) -> list[dict]:
    """The newest record for each key, in the order the keys first appear."""
    found: dict = {}
    for record in records:
        found[key(record)] = record
    return list(found.values())


def cpu(record: dict) -> str:
    machine = record.get("machine") or {}
    return machine.get("gpu") or machine.get("cpu") or "unknown machine"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def provenance(record: dict) -> str:
    machine = record.get("machine") or {}
    where = machine.get("cpu") or "machine not recorded"
    if machine.get("cores"):
        where += f", {machine['cores']} cores"
    if machine.get("gpu"):
        where = f"{machine['gpu']} ({where})"
    parts = [where, record.get("date") or "undated", f"commit {record['commit']}" if record.get("commit") else
             "commit not recorded"]
    text = "Measured on " + "; ".join(parts)
    if record.get("command"):
        text += f"; `{record['command']}`"
    if record.get("note"):
        text += f". Note: {record['note']}"
    return f"*{text}* (data: `benchmarks/results/{record['_file']}`)"


def num(value, digits: int = 1, unit: str = "") -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    text = f"{value:,.{digits}f}"
    return text + unit


def rng(values, digits: int = 2) -> str:
    if not values:
        return ""
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


# ---- one renderer per benchmark: (markdown lines, plots to draw as (file name, function)) ----

def render_vs_vllm(records: list[dict]) -> tuple[list[str], list]:
    cells = {}
    for record in records:
        for row in record["result"]["rows"]:
            cells[(cpu(record), record["result"]["dtype"], row["preset"], row["mode"])] = (record, row)
    lines, plots = [], []
    for machine in dict.fromkeys(k[0] for k in cells):
        mine = {k: v for k, v in cells.items() if k[0] == machine}
        rows = []
        for (_, dtype, preset, mode), (record, row) in mine.items():
            each = row.get("ratio_each_round") or row.get("ratio_each_round_range")
            tpot = (f"{row['vllm']['tpot_p50_s'] * 1000:.1f} / {row['pdserve']['tpot_p50_s'] * 1000:.1f} ms"
                    if "tpot_p50_s" in row["pdserve"] else "")
            rows.append([dtype, preset, mode, num(row["vllm"]["tok_s"]), num(row["pdserve"]["tok_s"]),
                         f"**{row['ratio']:.2f}x** ({rng(each)})", tpot,
                         f"{row['equal_outputs']} of 64" if row.get("equal_outputs") is not None else "",
                         record.get("commit") or ""])
        lines += [f"**{machine}**", ""]
        lines += table(["dtype", "preset", "mode", "vLLM tok/s", "pdserve tok/s", "pdserve / vLLM (rounds' own)",
                        "TPOT p50 vLLM / pdserve", "greedy equal", "commit"], rows)
        lines.append("")
        for record in dict.fromkeys(id(r) for r, _ in mine.values()):
            rec = next(r for r, _ in mine.values() if id(r) == record)
            lines += ["- " + provenance(rec)]
        name = f"vs_vllm-{slug(machine)}.png"
        lines += ["", f"![pdserve vs vLLM, {machine}]({IMG_LINK}/{name})", ""]
        plots.append((name, lambda path, mine=mine, machine=machine: plot_vs_vllm(mine, machine, path)))
    return lines, plots


def plot_vs_vllm(cells: dict, machine: str, path: Path) -> None:
    plt = pyplot()
    panels = list(dict.fromkeys((dtype, preset) for _, dtype, preset, _ in cells))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, (dtype, preset) in zip(axes[0], panels):
        rows = [row for (_, d, p, _), (_, row) in cells.items() if (d, p) == (dtype, preset)]
        for offset, engine, color in ((-0.2, "vllm", "tab:blue"), (0.2, "pdserve", "tab:orange")):
            xs = [i + offset for i in range(len(rows))]
            ax.bar(xs, [r[engine]["tok_s"] for r in rows], width=0.4, color=color,
                   label="vLLM" if engine == "vllm" else "pdserve")
            for x, row in zip(xs, rows):
                each = row[engine].get("tok_s_each_round") or []
                ax.plot([x] * len(each), each, "k.", markersize=4)
        for i, row in enumerate(rows):
            top = max([row["pdserve"]["tok_s"], *(row["pdserve"].get("tok_s_each_round") or [])])
            ax.annotate(f"{row['ratio']:.2f}x", (i + 0.2, 1.02 * top), ha="center", va="bottom")
        ax.set_xticks(range(len(rows)), [r["mode"].replace("served ", "served\n") for r in rows])
        ax.set_title(f"{preset}, {dtype}")
        ax.set_ylim(0, 1.2 * max(max(r["pdserve"]["tok_s"], r["vllm"]["tok_s"]) for r in rows))
    axes[0][0].set_ylabel("output tokens/s")
    axes[0][0].legend(loc="lower left")
    fig.suptitle(f"pdserve vs vLLM at equal cores: {machine}\n(bars: median of rounds; dots: each round)")
    save(fig, path)


def render_kernels_gpu(records: list[dict]) -> tuple[list[str], list]:
    lines = []
    for record in latest(records, cpu):
        result = record["result"]
        ceilings = result.get("ceilings") or {}
        lines += [f"Ceilings measured on the same GPU: a device-to-device copy at {num(ceilings.get('copy_gbps'), 0)}"
                  f" GB/s, a bf16 matmul at {num(ceilings.get('matmul_tflops'), 0)} TFLOP/s.", ""]
        rows = []
        for k in result["kernels"]:
            if "error" in k:
                rows.append([k["kernel"], "", "", "", "", f"error: {k['error']}", ""])
                continue
            share = (f"{100 * k['frac_of_copy_bw']:.0f}% of copy" if "frac_of_copy_bw" in k else
                     f"{100 * k['frac_of_matmul']:.0f}% of matmul" if "frac_of_matmul" in k else "")
            achieved = num(k.get("gbps"), 0, " GB/s") if "gbps" in k else num(k.get("tflops"), 0, " TFLOP/s")
            versus = (f"{k['speedup_vs_torch']:.2f}x torch" if "speedup_vs_torch" in k else
                      f"{k['ratio_to_sdpa_flash']:.2f}x SDPA flash's time" if "ratio_to_sdpa_flash" in k else "")
            target = (f">= {100 * k['target_frac_of_copy_bw']:.0f}% of copy" if "target_frac_of_copy_bw" in k else
                      f"<= {k['target_ratio_to_sdpa_flash']}x flash" if "target_ratio_to_sdpa_flash" in k else "")
            rows.append([k["kernel"], k.get("shape", ""), num(k.get("ms"), 3, " ms"), achieved, share, versus, target])
        lines += table(["kernel", "shape", "time", "achieved", "share of ceiling", "vs torch", "target"], rows)
        lines += ["", "- " + provenance(record), ""]
    return lines, []


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
    name = "offline_throughput.png"
    lines += [f"![offline throughput]({IMG_LINK}/{name})", ""]
    return lines, [(name, lambda path: plot_offline(current, path))]


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


def render_serve_throughput(records: list[dict]) -> tuple[list[str], list]:
    record = records[-1]
    rows = []
    for r in record["result"]["results"]:
        d = r["disaggregated"]
        rows.append([r["preset"], num(d["output_throughput"]),
                     f"{d['ttft_ms']['p50'] / 1000:.2f} / {d['ttft_ms']['p99'] / 1000:.2f} s",
                     f"{d['tpot_ms']['p50']:.0f} / {d['tpot_ms']['p99']:.0f} ms",
                     num((r.get("colocated") or {}).get("output_throughput")), num(r["hf_single_tok_s"]),
                     f"**{r['disaggregated_over_single']:.1f}x**",
                     f"{r['colocated_over_single']:.1f}x" if r.get("colocated_over_single") else ""])
    lines = table(["preset", "1P+1D tok/s", "TTFT p50 / p99", "TPOT p50 / p99", "colocated (2 cores) tok/s",
                   "transformers one at a time", "1P+1D / one at a time", "colocated / one at a time"], rows)
    return lines + ["", "- " + provenance(record), ""], []


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


def render_multiturn(records: list[dict]) -> tuple[list[str], list]:
    current = latest(records, lambda r: r["result"]["preset"])
    rows = []
    for record in current:
        result = record["result"]
        for name, c in result["configs"].items():
            vs_off = (result.get("vs_off") or {}).get(name, {}).get("ttft_p50_ms")
            hit = (f"{100 * c['prefill_hit_rate']:.1f}% ({100 * c['prefill_hit_of_ideal']:.0f}% of "
                   f"{100 * c['ideal_hit_rate']:.1f}%)" if c.get("prefill_hit_rate") else "0")
            ttft = (f"{c['ttft_p50_ms'] / 1000:.2f} / {c['ttft_p99_ms'] / 1000:.2f} s"
                    if c.get("ttft_p50_ms") is not None and c.get("ttft_p99_ms") is not None else "")
            rows.append([result["preset"], name, ttft,
                         f"{vs_off:.2f}x" if vs_off else "1", hit, num(c["prefill_computed_tokens"], 0),
                         f"{c['kv_blocks_pulled']:,} / {c['kv_blocks_skipped']:,}"])
    lines = table(["preset", "config", "TTFT p50 / p99", "p50 vs off", "prefill hit rate (of ideal)",
                   "prefill tokens computed", "decode: blocks pulled / skipped"], rows)
    lines += [""] + ["- " + provenance(record) for record in current] + [""]
    name = "multiturn.png"
    lines += [f"![multi-turn TTFT]({IMG_LINK}/{name})", ""]
    return lines, [(name, lambda path: plot_multiturn(current, path))]


def plot_multiturn(current: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(current), figsize=(5 * len(current), 4), squeeze=False)
    for ax, record in zip(axes[0], current):
        configs = record["result"]["configs"]
        ax.bar(list(configs), [c["ttft_p50_ms"] / 1000 for c in configs.values()], color=["#999", "#69c", "#e73"])
        ax.set_title(f"{record['result']['preset']}: TTFT p50")
        ax.set_ylabel("seconds")
    save(fig, path)


def render_disagg_vs_colocated(records: list[dict]) -> tuple[list[str], list]:
    record = records[-1]
    result = record["result"]
    slo = result["slo"]
    lines = [f"`{result['preset']}`, {result['input_len']:,}-token prompts, {result['output_len']} output tokens, "
             f"{result['num_requests']} requests per rate; SLO ({result.get('slo_rule', '')}): TTFT <= "
             f"{slo['ttft_ms'] / 1000:.2f} s and TPOT <= {slo['tpot_ms']:.1f} ms for >= {100 * slo['target']:.0f}% "
             "of requests.", ""]
    rows = []
    for name, setup in result["setups"].items():
        for p in setup["points"]:
            rows.append([name, f"{p['request_rate']:.3f}", f"{100 * p['attainment']:.0f}%",
                         f"{p['ttft_ms']['p50'] / 1000:.2f} / {p['ttft_ms']['p99'] / 1000:.2f} s",
                         f"{p['tpot_ms']['p50']:.1f} / {p['tpot_ms']['p99']:.1f} ms"])
    lines += table(["setup", "rate (req/s)", "attainment", "TTFT p50 / p99", "TPOT p50 / p99"], rows) + [""]
    goodput = ", ".join(f"{name} {num(setup.get('goodput_rate'), 3) or 'none'} req/s"
                        for name, setup in result["setups"].items())
    lines += [f"Goodput (highest passing rate): {goodput}.", "", "- " + provenance(record), ""]
    name = "disagg_vs_colocated.png"
    lines += [f"![attainment vs rate]({IMG_LINK}/{name})", ""]
    return lines, [(name, lambda path: plot_disagg(result, path))]


def plot_disagg(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, setup in result["setups"].items():
        points = sorted(setup["points"], key=lambda p: p["request_rate"])
        ax.plot([p["request_rate"] for p in points], [100 * p["attainment"] for p in points], "o-", label=name)
    ax.axhline(100 * result["slo"]["target"], color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.legend()
    save(fig, path)


def render_chaos(records: list[dict]) -> tuple[list[str], list]:
    record = records[-1]
    r = record["result"]
    lines = [f"{r['sent']} sent, {r['completed']} completed, {r['disconnected']} disconnected on purpose, "
             f"{r['failed']} failed, {r['wrong']} wrong; leaked blocks {sum((r.get('leaked_blocks') or {}).values())}; "
             f"{r['probes']} probes, {r['probes_failed']} failed. Recovery max **{num(r['max_recovery_s'], 2)} s**, "
             f"p50 {num(r['p50_recovery_s'], 2)} s (target <= 2 s).", ""]
    rows = [[i + 1, k.get("node", ""), num(k.get("serve_s"), 2), num(k.get("stall_s"), 2),
             f"**{k['recovery_s']:.2f}**" if k.get("recovery_s") is not None else "", num(k.get("restart_s"), 2),
             num(k.get("rejoin_s"), 2), " -> ".join(f"{b:,}" for b in k["blocks"]) if k.get("blocks") else ""]
            for i, k in enumerate(r["kills"])]
    lines += table(["kill", "node", "serve_s", "stall_s", "recovery_s", "restart_s", "rejoin_s", "KV blocks"], rows)
    return lines + ["", "- " + provenance(record), ""], []


def render_hostile_soak(records: list[dict]) -> tuple[list[str], list]:
    """One row per recorded run (each its own layout and traffic)."""
    rows = []
    for record in records:
        r = record["result"]
        hostile = ", ".join(f"{kind} {sum(c.values()):,} ({', '.join(f'{n:,} x {s}' for s, n in c.items())})"
                            for kind, c in r["hostile_statuses"].items())
        rows.append([r["nodes"], f"{r['requests_sent']:,}", f"{r['canary_ok']}/{r['canary_ok'] + r['canary_failed']}",
                     f"{num(r['canary_ttft_quiet_p99_ms'], 0)} -> {num(r['canary_ttft_hostile_p99_ms'], 0)} ms "
                     f"(**{r['ttft_p99_ratio']:.2f}x**)", hostile, r["nodes_marked_stuck"],
                     f"{r['proxy_log_bytes'] / 1e6:.2f} MB", f"{r['requests_open_at_end']:.0f} / "
                     f"{r['requests_unanswered']:.0f}", provenance(record)])
    lines = table(["nodes", "requests", "canary exact", "canary TTFT p99 quiet -> hostile", "hostile answers",
                   "nodes marked stuck", "proxy log", "open / unanswered at the end", "run"], rows)
    return lines + [""], []


def render_core_lending(records: list[dict]) -> tuple[list[str], list]:
    """The newest run: per condition, the default (lending) against --no-lend-cores."""
    record = records[-1]
    r = record["result"]
    rows = []
    for row in r["summary"]:
        for mode in ("default", "no-lend"):
            runs = [x for x in r["runs"] if x["condition"] == row["condition"] and x["mode"] == mode]
            m = row[mode]
            rows.append([row["condition"], "`pdserve up`" if mode == "default" else "`--no-lend-cores`",
                         " / ".join(f"{s:.2f}" for s in m["first_chat_s"]), f"{m['later_chat_median_s']:.2f}",
                         " / ".join(num(t) for t in m["stream_tok_s"]),
                         " / ".join(f"{x.get('borrowed_steps', 0):.0f} ({x.get('preempted_steps', 0):.0f})"
                                    for x in runs)])
        rows.append(["", "**default / no-lend**", "", f"**{row['chat_ratio']:.2f}x**",
                     f"**{row['stream_ratio']:.2f}x**", ""])
    lines = [f"{r['model']}, {r['cores']} cores; the README's chat request {r['chats']} times after ready, then "
             f"{r['streams']} concurrent streams of {r['stream_tokens']} tokens; busy<N>: a busy loop on core N:", ""]
    lines += table(["condition", "run", "first chat after ready (s)", "later chats, median (s)",
                    "streams (output tok/s)", "borrowed decode steps (preempted)"], rows)
    return lines + ["", "- " + provenance(record), ""], []


def render_load_client(records: list[dict]) -> tuple[list[str], list]:
    record = records[-1]
    r = record["result"]
    rows = [[client, num(r[client]["later_rounds_us_per_chunk"]), num(r[client]["first_round_us_per_chunk"])]
            for client in ("httpx", "aiohttp") if client in r]
    lines = [f"{r['streams']} streams x {r['chunks']} chunks, CPU microseconds per chunk:", ""]
    lines += table(["client", "later rounds", "first round (opens the connections)"], rows)
    return lines + ["", "- " + provenance(record), ""], []


def render_profile_serve(records: list[dict]) -> tuple[list[str], list]:
    record = records[-1]
    rows = []
    for r in record["result"]["results"]:
        shares = r["cpu_share"]
        cells = [f"{r['cpu_s'][name]:.2f} ({100 * shares[name]:.1f}%)" if name in r["cpu_s"] else ""
                 for name in ("prefill0", "decode0", "proxy", "load generator")]
        rows.append([r["preset"], r["dtype"], num(r["output_tok_s"]), f"{r['wall_s']:.1f} s", *cells,
                     f"{100 * r['idle_share']:.1f}%", num(r.get("tail_s"), 2, " s"), num(r.get("local_prefills"), 0)])
    lines = table(["preset", "dtype", "tok/s", "wall", "prefill node CPU s", "decode node", "proxy", "load generator",
                   "idle", "tail", "prompts prefilled on the decode node"], rows)
    return lines + ["", "- " + provenance(record), ""], []


def render_fuzz(records: list[dict]) -> tuple[list[str], list]:
    record = records[-1]
    r = record["result"]
    statuses = ", ".join(f"{count:,} x {status}" for by in r["by_status"].values() for status, count in by.items())
    lines = [f"{r['num_cases']:,} cases ({statuses}), **{r['num_problems']} problems**.", "", "- " + provenance(record),
             ""]
    return lines, []


def render_ab_trees(records: list[dict]) -> tuple[list[str], list]:
    record = records[-1]
    result = record["result"]
    rows = [[r["mode"], num(r["a_tok_s"]), num(r["b_tok_s"]), f"**{r['b_over_a']:.3f}**",
             ", ".join(f"{x:.3f}" for x in r["round_ratios"])] for r in result["rows"]]
    lines = [f"`{result['preset']}`, {result['dtype']}: tree A `{result['tree_a']}`, tree B `{result['tree_b']}`.", ""]
    lines += table(["mode", "A tok/s", "B tok/s", "B / A", "each round's B / A"], rows)
    return lines + ["", "- " + provenance(record), ""], []


def render_gpu_engine(records: list[dict]) -> tuple[list[str], list]:
    runs = [r for r in records if not r["result"].get("smoke")]
    if not runs:
        return ["*No GPU run recorded yet.*"], []
    record = runs[-1]
    result = record["result"]
    hw = result["hardware"]
    lines = [f"Bounds measured on the same GPU: a device-to-device copy at {num(hw['copy_bandwidth_gbs'], 0)} GB/s, "
             f"a bf16 matmul at {num(hw['bf16_matmul_tflops'], 0)} TFLOP/s.", ""]
    plots = []
    for preset in result["presets"]:
        name = preset["preset"]
        if "error" in preset or "decode" not in preset:
            lines += [f"**{name}**: {preset.get('error', 'not run (time)')}", ""]
            continue
        eager = {row["batch"]: row for row in preset.get("decode_eager", [])}
        rows = [[str(row["batch"]), num(row["step_ms_median"], 3, " ms"),
                 num(eager[row["batch"]]["step_ms_median"], 3, " ms") if row["batch"] in eager else "",
                 num(row["bound_ms"], 3, " ms"), f"{100 * row['of_bound']:.0f}%"] for row in preset["decode"]]
        graphs = preset.get("graphs", {})
        lines += [f"**{name}** decode step (median; {len(graphs.get('sizes', []))} graphs captured in "
                  f"{num(graphs.get('capture_s'), 1)} s, {num(graphs.get('memory_mib'), 0)} MiB):", ""]
        lines += table(["batch", "CUDA graphs", "--enforce-eager", "bandwidth bound", "of bound"], rows)
        if preset.get("prefill"):
            first = preset["prefill"][0]
            lines += ["", f"**{name}** prefill (one step, {first['num_prompts'] * first['prompt_len']:,} tokens):", ""]
            lines += table(["prompt", "tokens/s", "TFLOP/s", "of matmul rate"],
                           [[f"{row['num_prompts']} x {row['prompt_len']:,}", num(row["tokens_per_s"], 0),
                             num(row["tflops"], 0), f"{100 * row['of_matmul_rate']:.0f}%"]
                            for row in preset["prefill"]])
        if preset.get("offline"):
            hf = preset.get("hf", {}).get("output_tokens_per_s")
            lines += ["", f"**{name}** offline, 256 x 512 -> 128: {num(preset['offline']['output_tokens_per_s'], 0)} "
                          f"output tok/s; transformers generate (sdpa, batch 256): {num(hf, 0)} tok/s."]
        figure = f"gpu_engine_{slug(name)}.png"
        lines += ["", f"![decode step vs bound]({IMG_LINK}/{figure})", ""]
        plots.append((figure, lambda path, preset=preset: plot_gpu_decode(preset, path)))
    lines += ["- " + provenance(record), ""]
    return lines, plots


def plot_gpu_decode(preset: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    batches = [row["batch"] for row in preset["decode"]]
    ax.plot(batches, [row["step_ms_median"] for row in preset["decode"]], "o-", label="CUDA graphs")
    if preset.get("decode_eager"):
        ax.plot([row["batch"] for row in preset["decode_eager"]],
                [row["step_ms_median"] for row in preset["decode_eager"]], "s--", label="--enforce-eager")
    ax.plot(batches, [row["bound_ms"] for row in preset["decode"]], "k:", label="bandwidth bound")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch")
    ax.set_ylabel("step (ms)")
    ax.set_title(preset["preset"])
    ax.legend()
    save(fig, path)


def render_kv_transfer_gpu(records: list[dict]) -> tuple[list[str], list]:
    runs = [r for r in records if r["result"].get("device") != "cpu"]
    if not runs:
        return ["*No GPU run recorded yet.*"], []
    record = runs[-1]
    rows = []
    for name, r in record["result"]["settings"].items():
        rows.append([name, num(r.get("gb_s"), 1, " GB/s"), num(r.get("ms"), 2, " ms"),
                     f"{r.get('transport')} ({r.get('method')})"] if "gb_s" in r else
                    [name, "", "", r.get("error", "")[:80]])
    return table(["UCX settings", "READ", "time", "transport"], rows) + ["", "- " + provenance(record)], []


def render_gpu_served(records: list[dict]) -> tuple[list[str], list]:
    runs = [r for r in records if r["result"].get("device") != "cpu"]
    if not runs:
        return ["*No GPU run recorded yet.*"], []
    record = runs[-1]
    result = record["result"]
    rows = []
    for name, r in result["setups"].items():
        if "output_throughput" not in r:
            rows.append([name, r.get("error", "")[:80], "", "", ""])
            continue
        pulls = r.get("pulls") or {}
        ttft, tpot = r["ttft_ms"], r["tpot_ms"]
        rows.append([name, num(r["output_throughput"], 0), f"{num(ttft['p50'], 0)} / {num(ttft['p99'], 0)}",
                     f"{num(tpot['p50'], 1)} / {num(tpot['p99'], 1)}",
                     f"{num(pulls.get('gb_s'), 1)} GB/s over {(pulls.get('transport') or {}).get('transport')}"
                     if pulls else ""])
    lines = [f"{result['num_requests']} x {result['prompt_len']} -> {result['output_len']} tokens, all at once, "
             f"{result['model']}:", ""]
    lines += table(["setup", "output tok/s", "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)", "KV pulls"], rows)
    if "pd_over_colocated" in result:
        lines += ["", f"1P+1D / colocated: {result['pd_over_colocated']:.2f}x; greedy outputs equal: "
                      f"{result['greedy_equal']}."]
    return lines + ["", "- " + provenance(record)], []


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


RENDERERS: dict[str, Callable[[list[dict]], tuple[list[str], list]]] = {
    "ab_trees": render_ab_trees,
    "vs_vllm": render_vs_vllm, "kernels_gpu": render_kernels_gpu, "kernels_cpu": render_kernels_cpu,
    "kv_transfer": render_kv_transfer, "offline_throughput": render_offline_throughput,
    "serve_throughput": render_serve_throughput, "decode_latency": render_decode_latency,
    "multiturn": render_multiturn, "disagg_vs_colocated": render_disagg_vs_colocated, "chaos": render_chaos,
    "load_client": render_load_client, "profile_serve": render_profile_serve, "fuzz": render_fuzz,
    "gpu_engine": render_gpu_engine, "kv_transfer_gpu": render_kv_transfer_gpu, "gpu_served": render_gpu_served,
    "tensor_parallel": render_tensor_parallel, "kv_transfer_tp": render_kv_transfer_tp,
    "hostile_soak": render_hostile_soak, "core_lending": render_core_lending,
}


def render(records: list[dict]) -> tuple[dict[str, str], list]:
    """{benchmark: markdown block}, and the plots [(file name, draw(path))]."""
    blocks, plots = {}, []
    for name, renderer in RENDERERS.items():
        mine = [r for r in records if r["benchmark"] == name]
        if not mine:
            blocks[name] = "*No results recorded yet.*\n"
            continue
        lines, figures = renderer(mine)
        while lines and lines[-1] == "":
            lines.pop()
        blocks[name] = "\n".join(lines) + "\n"
        plots += figures
    return blocks, plots


def fill(page: str, blocks: dict[str, str]) -> str:
    """The page with each marked block replaced; a block the page has no markers for is an error."""
    for name, block in blocks.items():
        pattern = re.compile(rf"(<!-- results:{re.escape(name)} -->\n).*?(<!-- /results:{re.escape(name)} -->)", re.S)
        if not pattern.search(page):
            raise SystemExit(f"{PAGE.relative_to(ROOT)} has no <!-- results:{name} --> markers")
        page = pattern.sub(lambda m, block=block: m.group(1) + block + m.group(2), page)
    return page


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="render docs/benchmarks.md's tables and plots from benchmarks/results")
    parser.add_argument("--check", action="store_true", help="exit 1 if the tables differ from a fresh render")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    args = parser.parse_args(argv)
    blocks, plots = render(load())
    page = PAGE.read_text()
    new = fill(page, blocks)
    if args.check:
        missing = [name for name, _ in plots if not (IMG / name).exists()]
        if new != page or missing:
            print(f"{PAGE.relative_to(ROOT)} is stale (or plots missing: {missing}): run {COMMAND}",  # noqa: T201
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    if not args.no_plots:
        IMG.mkdir(parents=True, exist_ok=True)
        for name, draw in plots:
            draw(IMG / name)
    print(f"wrote {PAGE.relative_to(ROOT)}" + ("" if args.no_plots else f" and {len(plots)} plots in "  # noqa: T201
                                                f"{IMG.relative_to(ROOT)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
