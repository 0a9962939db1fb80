"""Renderers for docs/benchmarks.md's served and comparative benchmarks: against vLLM and an older
tree, serving throughput, disaggregated vs colocated, prefix caching, chaos, hostile soak, overload,
the proxy's capacity, core lending, the load generator, profiles and fuzzing.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.results_format import (
    IMG_LINK,
    cpu,
    cpu_kind,
    latest,
    num,
    provenance,
    pyplot,
    rng,
    save,
    slug,
    table,
    with_plot,
)


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
    return with_plot(lines, "multiturn.png", "multi-turn TTFT", lambda path: plot_multiturn(current, path))


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
    return with_plot(lines, "disagg_vs_colocated.png", "attainment vs rate", lambda path: plot_disagg(result, path))


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


def render_overload(records: list[dict]) -> tuple[list[str], list]:
    """The newest run: one row per burst, and all bursts together."""
    record = records[-1]
    r = record["result"]

    def row(name: str, b: dict) -> list:
        refusal, admitted = b.get("refusal_ms", {}), b.get("admitted_ms", {})
        return [name, b["admitted"], b["refused"], ", ".join(map(str, b["other"])) or "none",
                f"{refusal.get('p50', 0):.1f} / {refusal.get('p90', 0):.1f} / {refusal.get('max', 0):.1f}",
                f"{num(admitted.get('first_end', 0), 0)} / {num(admitted.get('median', 0), 0)}",
                f"**{b['refusal_p90_over_admitted_median']:.3f}**" if "refusal_p90_over_admitted_median" in b else "",
                b.get("refused_after_first_admitted_end", 0)]

    rows = [row(str(i + 1), b) for i, b in enumerate(r["per_burst"])] + [row("**all**", r["all"])]
    lines = [f"{r['model']}, 1P+1D, decode batch {r['max_num_seqs']}, `--max-num-requests {r['max_num_requests']}`; "
             f"{r['bursts']} bursts of {r['burst']} completions x {r['output_len']} tokens sent at once; proxy RSS "
             f"{r['proxy_rss_mb']['before']:.0f} MB before, {r['proxy_rss_mb']['peak']:.0f} MB at the peak:", ""]
    lines += table(["burst", "admitted", "refused (429)", "other statuses", "refusal p50 / p90 / max (ms)",
                    "admitted: first end / median (ms)", "refusal p90 / admitted median",
                    "refusals after an admitted request ended"], rows)
    return lines + ["", "- " + provenance(record), ""], []


def render_proxy_capacity(records: list[dict]) -> tuple[list[str], list]:
    """The newest run: its rounds, and the proxy's CPU per token over them."""
    record = records[-1]
    r = record["result"]
    rows = [[str(i + 1), num(x["output_tok_s"]), f"{x['completed']} / {x['failed']}", f"{x['proxy_cpu_s']:.2f}",
             f"{x['nodes_cpu_s']:.2f}", f"{x['client_cpu_s']:.2f}", f"{x['proxy_us_per_token']:.1f}"]
            for i, x in enumerate(r["rounds"])]
    lines = [f"{r['num_requests']} streamed completions of {r['input_len']} -> {r['output_len']} tokens at rate inf, "
             f"fake nodes stepping every {r['step_ms']:g} ms; the proxy's CPU per output token "
             f"**{r['proxy_us_per_token_median']:.1f} µs** (median), so one proxy core carries about "
             f"**{r['tok_s_per_proxy_core']:,} tok/s**:", ""]
    lines += table(["round", "output tok/s", "completed / failed", "proxy CPU s", "fake nodes CPU s", "client CPU s",
                    "proxy µs per token"], rows)
    return lines + ["", "- " + provenance(record), ""], []


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
             f"{r['streams']} concurrent streams of {r['stream_tokens']} tokens; busy<N>: a busy loop on core N "
             "(busy<N>:<P>: busy P% of each 10 ms):", ""]
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
    statuses = "; ".join(f"{source}: " + ", ".join(f"{count:,} x {status}" for status, count in by.items())
                         for source, by in r["by_status"].items())
    accepted = r.get("num_negative_accepted")
    tail = "" if accepted is None else f", {accepted} negative cases accepted"
    lines = [f"{r['num_cases']:,} cases ({statuses}), **{r['num_problems']} problems**{tail}.", "",
             "- " + provenance(record), ""]
    return lines, []


def render_ab_trees(records: list[dict]) -> tuple[list[str], list]:
    """For each kind of CPU (its name and widest vector level: the kernels differ), the newest run
    of each mode."""
    newest = {(cpu_kind(record), row["mode"]): (record, row) for record in records for row in record["result"]["rows"]}
    by_kind: dict[str, list[tuple[dict, dict]]] = {}
    for (kind, _), cell in newest.items():
        by_kind.setdefault(kind, []).append(cell)
    lines = []
    for kind, cells in by_kind.items():
        rows = [[row["mode"], num(row["a_tok_s"]), num(row["b_tok_s"]), f"**{row['b_over_a']:.3f}**",
                 ", ".join(f"{x:.3f}" for x in row["round_ratios"]), _what_ran(record["result"])]
                for record, row in cells]
        lines += [f"**{kind}**", ""]
        lines += table(["mode", "A tok/s", "B tok/s", "B / A", "each round's B / A", "trees A, B"], rows)
        lines += [""] + ["- " + provenance(record) for record in {id(r): r for r, _ in cells}.values()] + [""]
    return lines, []


def _what_ran(result: dict) -> str:
    """The two trees (with their commits where recorded), the preset and the dtype."""
    return ", ".join(f"`{result[f'tree_{side}']}`" + (f" ({result[f'tree_{side}_commit']})"
                                                      if result.get(f"tree_{side}_commit") else "")
                     for side in ("a", "b")) + f"; `{result['preset']}`, {result['dtype']}"


def render_kv_streaming(records: list[dict]) -> tuple[list[str], list]:
    """The newest run on each device (a GPU's first): per prompt length, the pull streamed chunk by
    chunk against whole."""
    newest = {record["result"].get("device", "cpu"): record for record in records}
    lines, plots = [], []
    for device in sorted(newest, key=lambda d: d == "cpu"):
        more_lines, more_plots = _render_kv_streaming_run(newest[device])
        lines += more_lines
        plots += more_plots
    return lines, plots


def _render_kv_streaming_run(record: dict) -> tuple[list[str], list]:
    r = record["result"]
    rows = []
    for row in r["rows"]:
        for mode in ("streamed", "whole"):
            rows.append([f"{row['length']:,}", mode, num(row[f"{mode}_ttft_s"] * 1e3, 1),
                         num(row[f"{mode}_second_gap_s"] * 1e3, 1), num(row[f"{mode}_tpot_s"] * 1e3, 1),
                         num(row[f"{mode}_pull_cost_s"] * 1e3, 1)])
        ratio = row["pull_cost_ratio"]
        ttft = f"{row['ttft_ratio']:.3f}x ({rng(row['ttft_ratio_each_round'])})" if "ttft_ratio" in row else ""
        rows.append(["", "**streamed / whole**", ttft, "", "", f"**{ratio:.2f}x**" if ratio is not None else ""])
    device = r.get("device", "cpu")
    where = "one core each" if device == "cpu" else f"{device}, {r.get('dtype')}"
    lines = [f"{r['model']}, 1 prefill + 1 decode node ({where}, NIXL, chunks of {r['chunk']:,} tokens), two "
             f"proxies on them, one streaming the KV and one not; one request at a time, alternating, "
             f"{r['rounds']} per mode and length, medians (TTFT ratio: the median of each round's pair, its range); "
             "pull cost = the gap from the first token to the second minus TPOT:", ""]
    lines += table(["prompt tokens", "KV pull", "TTFT ms", "1st -> 2nd token ms", "TPOT ms", "pull cost ms"], rows)
    lines += ["", "- " + provenance(record), ""]
    name = "kv_streaming.png" if device == "cpu" else f"kv_streaming_{device}.png"
    return with_plot(lines, name, f"pull cost, streamed vs whole ({device})",
                     lambda path: plot_kv_streaming(r["rows"], path))


def plot_kv_streaming(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.35
    for k, mode in enumerate(("streamed", "whole")):
        ax.bar([x + (k - 0.5) * width for x in range(len(rows))], [row[f"{mode}_pull_cost_s"] * 1e3 for row in rows],
               width, label=mode)
    ax.set_xticks(list(range(len(rows))), [f"{row['length']:,} tokens" for row in rows])
    ax.set_ylabel("pull cost (ms): 1st->2nd token gap - TPOT")
    ax.legend()
    save(fig, path)
