"""Renderers for docs/benchmarks.md's GPU benchmarks: the Triton kernels, the engine's decode step
and prefill, KV transfer between GPUs and disaggregated serving on GPUs.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.results_format import IMG_LINK, cpu, latest, num, provenance, pyplot, save, slug, table


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
        stored = {row["batch"]: row for row in preset.get("decode_w", [])}
        fused = {row["batch"]: row for row in preset.get("decode_fused", [])}
        rows = [[str(row["batch"]), num(row["step_ms_median"], 3, " ms"), _step_cell(eager, row["batch"]),
                 num(row["bound_ms"], 3, " ms"), f"{100 * row['of_bound']:.0f}%"]
                + [_step_cell(other, row["batch"]) for other in (stored, fused) if other]
                for row in preset["decode"]]
        graphs, mixed = preset.get("graphs", {}), preset.get("mixed_graphs")
        mixed_text = "" if not mixed else (
            f"; steps with prompt tokens up to {mixed['sizes'][-1]} tokens as graph pieces, {len(mixed['sizes'])} "
            f"buckets captured in {num(mixed['capture_s'], 1)} s, {num(mixed['memory_mib'], 0)} MiB")
        lines += [f"**{name}** decode step (median; {len(graphs.get('sizes', []))} graphs captured in "
                  f"{num(graphs.get('capture_s'), 1)} s, {num(graphs.get('memory_mib'), 0)} MiB{mixed_text}):", ""]
        lines += table(["batch", "CUDA graphs", "--enforce-eager", "bandwidth bound", "of bound"]
                       + (["graphs, weights as stored (F.linear's form)"] if stored else [])
                       + (["graphs, fused small-batch layers (W as stored)"] if fused else []), rows)
        if preset.get("short_prefill"):
            eager_short = {row["prompt_len"]: row for row in preset.get("short_prefill_eager", [])}
            lines += ["", f"**{name}** one prompt alone, one step (best of 5):", ""]
            lines += table(["prompt", "graph pieces", "--enforce-eager"],
                           [[f"{row['prompt_len']:,}", num(row["ms"], 2, " ms"),
                             num(eager_short[row["prompt_len"]]["ms"], 2, " ms") if row["prompt_len"] in eager_short
                             else ""] for row in preset["short_prefill"]])
        if preset.get("profile"):
            kinds = list(dict.fromkeys(kind for row in preset["profile"] for kind in row.get("categories", {})))
            lines += ["", f"**{name}** where a decode step's time goes (torch.profiler, graphs on; each kind: "
                          "its kernels' summed time a step, and how many):", ""]
            lines += table(["batch", "step", "kernels busy", "kernels"] + kinds,
                           [[str(row["batch"]), num(row["step_ms_median"], 3, " ms"),
                             num(row["busy_ms_per_step"], 3, " ms"), num(row["kernels_per_step"], 0)]
                            + [_kind_cell(row.get("categories", {}).get(kind)) for kind in kinds]
                            for row in preset["profile"]])
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
            runs_offline = [preset[key] for key in ("offline", "offline_sampled") if key in preset]
            if any("decode_steps" in run for run in runs_offline):
                lines += [""] + table(
                    ["offline", "output tok/s", "steps with prompt tokens", "decode steps", "decode step (median)",
                     "outside the steps"],
                    [[f"temperature {run.get('temperature', 0.0):g}", num(run["output_tokens_per_s"], 0),
                      f"{run['prefill_steps']}: {num(run['prefill_steps_s'], 3, ' s')}",
                      f"{run['decode_steps']}: {num(run['decode_steps_s'], 3, ' s')}",
                      num(run["decode_step_ms_median"], 3, " ms"),
                      num(run["seconds"] - run["prefill_steps_s"] - run["decode_steps_s"], 3, " s")]
                     for run in runs_offline if "decode_steps" in run])
        if preset.get("layouts"):
            forms = [("wt", "W^T"), ("w", "W")]
            small = any("us_small_w" in row for row in preset["layouts"])
            if small:
                forms += [("small_wt", "Triton small-batch, W^T"), ("small_w", "Triton small-batch, W")]
            lines += ["", f"**{name}** projections, x @ W^T (the backend's form) against F.linear(x, W)"
                          + (" and the Triton small-batch kernel on either form" if small else "")
                          + ", 20 calls in a CUDA graph (microseconds a call, the weight's bytes over it against "
                          "the copy bandwidth):", ""]
            lines += table(["projection", "rows"] + [title for _, title in forms],
                           [[row["proj"], str(row["rows"])]
                            + [f"{num(row[f'us_{form}'], 1)} us ({100 * row[f'of_copy_bw_{form}']:.0f}%)"
                               if f"us_{form}" in row else "" for form, _ in forms]
                            for row in preset["layouts"]])
        tuned = [row for row in preset.get("layouts", []) if row.get("small_tunings")]
        if tuned:
            lines += ["", f"**{name}** the Triton small-batch kernel on W, by tuning (K tile bytes, warps, stages"
                          "[, columns a program: 16 where not given]; its default beside cuBLAS above):", ""]
            tunings = [row["tuning"] for row in tuned[0]["small_tunings"]]
            lines += table(["projection", "rows"] + [", ".join(str(v) for v in t.values()) for t in tunings],
                           [[row["proj"], str(row["rows"])]
                            + [f"{num(cell['us'], 1)} us ({100 * cell['of_copy_bw']:.0f}%)"
                               for cell in row["small_tunings"]] for row in tuned])
        if preset.get("attention"):
            lines += ["", f"**{name}** the decode attention kernel alone, at the decode steps' context, by tuning "
                          "(microseconds a call in a CUDA graph, the KV read over it against the copy bandwidth; "
                          "the first row is the backend's):", ""]
            lines += _attention_table(preset["attention"])
        figure = f"gpu_engine_{slug(name)}.png"
        lines += ["", f"![decode step vs bound]({IMG_LINK}/{figure})", ""]
        plots.append((figure, lambda path, preset=preset: plot_gpu_decode(preset, path)))
    lines += ["- " + provenance(record), ""]
    return lines, plots


def _attention_table(rows: list[dict]) -> list[str]:
    batches = list(dict.fromkeys(row["batch"] for row in rows))
    tunings = list(dict.fromkeys(tuple(row["tuning"].items()) for row in rows))
    cells = {(row["batch"], tuple(row["tuning"].items())): row for row in rows}
    return table(["token tile, warps, stages, split >= tokens"] + [f"batch {b}" for b in batches],
                 [[", ".join(str(value) for _, value in tuning)]
                  + [f"{num(cells[b, tuning]['us'], 1)} us ({100 * cells[b, tuning]['of_copy_bw']:.0f}%)"
                     if (b, tuning) in cells else "" for b in batches] for tuning in tunings])


def _step_cell(rows: dict, batch: int) -> str:
    return num(rows[batch]["step_ms_median"], 3, " ms") if batch in rows else ""


def _kind_cell(kind: dict | None) -> str:
    return "" if not kind else f"{num(kind['us_per_step'], 0)} us x{num(kind['calls_per_step'], 0)}"


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
        if "gb_s" not in r:
            rows.append([name, "", "", "", "", "", r.get("error", "")[:80]])
            continue
        for blocks, run in (("scattered", r), ("contiguous", r.get("contiguous"))):
            if run is not None:
                rows.append([name, blocks, num(run.get("descriptors"), 0), num(run["gb_s"], 1, " GB/s"),
                             num(run["ms"], 2, " ms"), num(run.get("transfer_ms"), 2, " ms"),
                             f"{r.get('transport')} ({r.get('method')})"])
    head = ["UCX settings", "reader's blocks", "descriptors", "READ (confirmed)", "time", "of it the transfer",
            "transport"]
    return table(head, rows) + ["", "- " + provenance(record)], []


def _rate(rate_rps: float | None) -> str:
    return "inf" if rate_rps is None else f"Poisson {rate_rps:.1f}/s"


def _steps(steps: dict | None) -> str:
    if not steps or not steps.get("count"):
        return ""
    return f"{num(steps['mean_ms'], 2)} / {num(steps['mean_batch'], 0)}"


def render_gpu_served(records: list[dict]) -> tuple[list[str], list]:
    runs = [r for r in records if r["result"].get("device") != "cpu"]
    if not runs:
        return ["*No GPU run recorded yet.*"], []
    record = runs[-1]
    result = record["result"]
    rows = []
    every_run = [r for setup in result["setups"].values() for r in setup.get("runs", [])]
    busy_keys = [k for k in ("proxy", "client", "decode") if any(k in r["cores_busy"] for r in every_run)]
    for name, setup in result["setups"].items():
        for r in setup.get("runs", []):
            pulls = r.get("pulls") or {}
            ttft, tpot, busy = r["ttft_ms"], r["tpot_ms"], r["cores_busy"]
            rows.append([name, f"{r['num_requests']} x {r['prompt_len']}",
                         _rate(r["rate_rps"]),
                         num(r["output_throughput"], 0), f"{num(ttft['p50'], 0)} / {num(ttft['p99'], 0)}",
                         f"{num(tpot['p50'], 1)} / {num(tpot['p99'], 1)}",
                         f"{num(pulls.get('gb_s'), 1)} GB/s over {(pulls.get('transport') or {}).get('transport')}"
                         if pulls else "", _steps(r.get("decode_steps")),
                         " / ".join(f"{busy[k]:.2f}" if k in busy else "" for k in busy_keys)])
        if "error" in setup:  # after the runs it finished
            rows.append([name, setup["error"][:80], "", "", "", "", "", "", ""])
    lines = [f"{result['model']}, prompts -> {result['output_len']} tokens, all at once (rate inf), then Poisson at "
             f"{result['poisson_fraction']:g}x colocated's rate-inf request rate; the decode node's steps over the "
             "run (mean time, mean decode batch); cores busy: the proxy's, the load generator's and the decode "
             "node's CPU over the run (near 1: that process was the limit):", ""]
    lines += table(["setup", "requests x prompt", "rate", "output tok/s", "TTFT p50 / p99 (ms)",
                    "TPOT p50 / p99 (ms)", "KV pulls", "decode steps: mean ms / batch",
                    "cores busy: " + " / ".join(busy_keys)], rows)
    comparisons = [[str(c["prompt_len"]), _rate(c["rate_rps"]),
                    f"**{c['pd_over_colocated']:.2f}x**",
                    f"{num(c['tpot_ms']['colocated']['p99'], 1)} / {num(c['tpot_ms']['1P+1D']['p99'], 1)}",
                    f"{c['tpot_ms']['colocated']['p99'] / max(c['tpot_ms']['colocated']['p50'], 1e-9):.2f}"]
                   for c in result.get("comparisons", [])]
    if comparisons:
        lines += ["", *table(["prompt", "rate", "1P+1D / colocated tok/s", "TPOT p99 colocated / 1P+1D (ms)",
                              "colocated TPOT p99 / p50"], comparisons)]
    if "greedy_equal" in result:
        lines += ["", f"Greedy outputs of 16 prompts through both setups equal: {result['greedy_equal']}."]
    return lines + ["", "- " + provenance(record)], []
