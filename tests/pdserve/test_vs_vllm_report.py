"""benchmarks/vs_vllm.py's report, from rounds as its workers return them (no vLLM needed): the
summary row (medians, each round's own ratio, equal outputs), the table, and the plot (one panel
per preset, a linear axis from zero)."""

from __future__ import annotations

import pytest


def offline_round(pdserve_tok_s: float, vllm_tok_s: float) -> dict:
    return {"pdserve": {"tok_s": pdserve_tok_s, "outputs": [[1, 2], [3, 4]]},
            "vllm": {"tok_s": vllm_tok_s, "outputs": [[1, 2], [3, 5]]}}


def served_round(pdserve_tok_s: float, vllm_tok_s: float) -> dict:
    return {engine: {"tok_s": tok_s, "ttft_p50_s": 1.0, "tpot_p50_s": 0.1 if engine == "pdserve" else 0.2}
            for engine, tok_s in (("pdserve", pdserve_tok_s), ("vllm", vllm_tok_s))}


def test_summary_table_and_plot(vs_vllm, tmp_path):
    offline = vs_vllm.summarize("small", "offline", [offline_round(300, 200), offline_round(260, 210),
                                                     offline_round(310, 220)])
    assert offline["pdserve"]["tok_s"] == 300 and offline["vllm"]["tok_s"] == 210
    assert offline["ratio"] == pytest.approx(300 / 210)
    assert offline["ratio_each_round"] == [1.5, 1.238, 1.409]
    assert offline["pdserve"]["tok_s_each_round"] == [300, 260, 310]
    assert offline["equal_outputs"] == 1
    served = vs_vllm.summarize("tiny", "served 1P+1D", [served_round(4000, 2400), served_round(3000, 2000),
                                                         served_round(4200, 2500)])
    assert served["ratio"] == pytest.approx(4000 / 2400)
    assert served["pdserve"]["tpot_p50_s"] == 0.1 and "equal_outputs" not in served

    text = vs_vllm.table([offline, served])
    assert "| small | offline | 210.0 | 300.0 | **1.43x** (1.24-1.50) |" in text
    assert "| tiny | served 1P+1D | 2,400.0 | 4,000.0 | **1.67x** (1.50-1.68) | 200.0 / 100.0 ms |" in text

    path = tmp_path / "plot.png"
    figure = vs_vllm.plot([offline, served], path, "bfloat16")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [ax.get_title() for ax in figure.axes] == ["small", "tiny"]
    for ax, top in zip(figure.axes, (310, 4200), strict=True):
        assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0 and ax.get_ylim()[1] > top
        assert len(ax.patches) == 2  # one bar per engine
    assert [t.get_text() for t in figure.axes[0].texts] == ["1.43x"]
    single = tmp_path / "single.png"
    vs_vllm.plot([offline], single, "float32")
    assert single.stat().st_size > 0
