"""pdserve bench against a fake OpenAI server with a known timing schedule (TTFT, chunk gaps,
tokens per chunk, failures, latency growing with load), and once against a real tiny deployment
whose own /metrics it must agree with."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, StreamingResponse

from pdserve import bench_client, cli
from pdserve.bench import add_arguments, config_from_args, prepare_datasets, run_benchmark
from pdserve.bench_client import RequestRecord
from pdserve.bench_config import BenchConfig, DatasetConfig, EndpointConfig, LoadConfig, SloConfig
from pdserve.bench_datasets import build_dataset, make_prompts
from pdserve.bench_load import arrival_offsets
from pdserve.bench_metrics import summarize
from pdserve.launcher import start_local, wait_healthy
from tests.conftest import UvicornServer

MODEL = "fake-model"


@dataclass
class FakeSchedule:
    ttft_s: float = 0.05
    gap_s: float = 0.02  # between chunks
    tokens_per_chunk: int = 1  # usage counts max_tokens; chunks = ceil(max_tokens / tokens_per_chunk)
    ttft_per_in_flight_s: float = 0.0  # added to TTFT per other request in flight at arrival
    has_usage: bool = True
    has_tokenize: bool = False
    fail_every: int | None = None  # every k-th request fails
    failure: str = "http_500"  # or "error_event": an SSE error after the first chunk; or "redirect" (307)


@dataclass
class FakeOpenAI:
    """A streaming OpenAI-style server following a FakeSchedule; records what it saw."""

    schedule: FakeSchedule
    bodies: list[dict] = field(default_factory=list)
    num_requests: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0

    def app(self) -> FastAPI:
        app = FastAPI()
        app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._answer(await request.json(), is_chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._answer(await request.json(), is_chat=True)

        if self.schedule.has_tokenize:
            @app.post("/tokenize")
            async def tokenize(request: Request):
                return {"count": len((await request.json())["prompt"].split())}

        return app

    async def _answer(self, body: dict, is_chat: bool):
        self.num_requests += 1
        number = self.num_requests
        is_failing = self.schedule.fail_every is not None and number % self.schedule.fail_every == 0
        if is_failing and self.schedule.failure == "http_500":
            return JSONResponse({"error": {"message": "fake overload"}}, status_code=500)
        if is_failing and self.schedule.failure == "redirect":  # to an answer it would count, if followed
            return RedirectResponse("/v1/models", status_code=307)
        self.bodies.append(body)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        ttft_s = self.schedule.ttft_s + self.schedule.ttft_per_in_flight_s * (self.in_flight - 1)
        if not body["stream"]:
            return await self._whole(body, ttft_s, is_chat)
        return StreamingResponse(self._events(body, number, is_chat, ttft_s, is_failing),
                                 media_type="text/event-stream")

    async def _whole(self, body: dict, ttft_s: float, is_chat: bool) -> dict:
        try:
            max_tokens = body.get("max_tokens") or body["max_completion_tokens"]
            await asyncio.sleep(ttft_s + self.schedule.gap_s * (max_tokens - 1))
            choice = {"message": {"role": "assistant", "content": "whole"}} if is_chat else {"text": "whole"}
            return {"choices": [{"index": 0, **choice, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 7, "completion_tokens": max_tokens}}
        finally:
            self.in_flight -= 1

    async def _events(self, body: dict, number: int, is_chat: bool, ttft_s: float, is_failing: bool):
        # NOTE: done counts when the last event is yielded, not in a finally: a client closing its
        # connection leaves the generator to the garbage collector, and in_flight would lag.
        for event in self._event_list(body, number, is_chat, is_failing):
            if event == "TTFT":
                await asyncio.sleep(ttft_s)
            elif event == "GAP":
                await asyncio.sleep(self.schedule.gap_s)
            else:
                yield event
        self.in_flight -= 1
        yield "data: [DONE]\n\n"

    def _event_list(self, body: dict, number: int, is_chat: bool, is_failing: bool) -> list[str]:
        """The SSE events of one answer, with "TTFT" and "GAP" where the waits go."""
        max_tokens = body.get("max_tokens") or body["max_completion_tokens"]
        events = ["TTFT"]
        for idx in range(math.ceil(max_tokens / self.schedule.tokens_per_chunk)):
            if idx:
                events.append("GAP")
            if is_failing and idx == 1:
                return [*events, _sse({"error": {"message": "node died", "code": 502}})]
            text = f" r{number}c{idx}"
            choice = {"index": 0, "delta": {"content": text}} if is_chat else {"index": 0, "text": text}
            events.append(_sse({"choices": [{**choice, "finish_reason": None}]}))
        if self.schedule.has_usage and body.get("stream_options", {}).get("include_usage"):
            events.append(_sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": max_tokens}}))
        return events


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


@pytest.fixture
def fake_server():
    """fake_server(**FakeSchedule fields) -> (FakeOpenAI, base_url); stopped at teardown."""
    servers = []

    def start(**schedule) -> tuple[FakeOpenAI, str]:
        fake = FakeOpenAI(FakeSchedule(**schedule))
        server = UvicornServer(fake.app())
        servers.append(server)
        server.start()
        return fake, server.base_url

    yield start
    for server in servers:
        server.stop()


def _config(base_url: str, endpoint: str = "completions", slo: SloConfig | None = None, **fields) -> BenchConfig:
    """A quiet config: dataset and load fields by name (unknown names fail loudly)."""
    dataset_names = {f for f in DatasetConfig.__dataclass_fields__}
    dataset = {k: v for k, v in fields.items() if k in dataset_names}
    load = {k: v for k, v in fields.items() if k not in dataset_names}
    dataset.setdefault("input_len", 16)
    return BenchConfig(EndpointConfig(base_url=base_url, model=MODEL, endpoint=endpoint, timeout_s=30),
                       DatasetConfig(**dataset), LoadConfig(show_progress=False, **load), slo or SloConfig())


def test_ttft_tpot_and_itl_follow_the_servers_schedule_with_usage_token_counts(fake_server):
    fake, url = fake_server(ttft_s=0.08, gap_s=0.04, tokens_per_chunk=2)
    result = run_benchmark(_config(url, num_requests=4, output_len=10))
    s = result.summary
    assert s["num_failed"] == 0 and s["output_tokens_source"] == {"usage": 4} and s["total_output_tokens"] == 40
    assert s["total_input_tokens"] == 4 * 7  # usage.prompt_tokens, not the dataset's 16
    for record in result.records:
        assert record.num_output_tokens == 10 and len(record.itl_s) == 4  # 5 chunks of 2 tokens
        assert record.tpot_s == pytest.approx((record.e2e_s - record.ttft_s) / 9)
        assert record.e2e_s == pytest.approx(record.ttft_s + sum(record.itl_s))
    # Generous upper bounds: the client and server share two busy cores.
    assert 80 <= s["ttft_ms"]["mean"] < 200
    assert 30 <= s["itl_ms"]["mean"] < 80
    assert 4 * 30 / 9 <= s["tpot_ms"]["mean"] < 4 * 80 / 9  # 4 gaps over 9 tokens: usage, not chunks
    assert {b["stream_options"]["include_usage"] for b in fake.bodies} == {True}


def test_without_usage_the_chunks_with_text_are_counted_and_the_summary_says_so(fake_server):
    _, url = fake_server(ttft_s=0.01, gap_s=0.005, tokens_per_chunk=2, has_usage=False)
    result = run_benchmark(_config(url, num_requests=3, output_len=10))
    assert result.summary["output_tokens_source"] == {"chunks": 3}
    assert [r.num_output_tokens for r in result.records] == [5, 5, 5]
    assert all(r["output_tokens_source"] == "chunks" for r in (rec.to_json() for rec in result.records))


def test_without_streaming_ttft_is_e2e_and_tokens_come_from_usage(fake_server):
    _, url = fake_server(ttft_s=0.02, gap_s=0.01)
    config = _config(url, num_requests=2, output_len=5)
    result = run_benchmark(replace(config, endpoint=replace(config.endpoint, is_stream=False)))
    assert result.summary["num_completed"] == 2 and result.summary["itl_ms"] is None
    for record in result.records:
        assert record.ttft_s == record.e2e_s >= 0.06 and record.num_output_tokens == 5 and record.tpot_s == 0.0
        assert record.output_tokens_source == "usage" and record.text == "whole"


@pytest.mark.parametrize("failure, reason", [("http_500", "HTTP 500"), ("error_event", "error event"),
                                             ("redirect", "HTTP 307")])
def test_failed_requests_are_listed_with_their_reason(fake_server, failure, reason):
    _, url = fake_server(ttft_s=0.01, gap_s=0.005, fail_every=3, failure=failure)
    result = run_benchmark(_config(url, num_requests=6, output_len=4))
    s = result.summary
    assert s["num_failed"] == 2 and s["num_completed"] == 4
    assert s["failure_reasons"] == {reason: 2}
    assert all(f["error"].startswith(reason) for f in s["failures"])
    assert s["request_throughput"] == pytest.approx(4 / s["duration_s"])


def test_a_line_past_the_clients_limit_fails_its_request_not_the_run(fake_server, monkeypatch):
    """aiohttp refuses an SSE line over twice its read buffer (LineTooLong): that request is
    recorded as failed with the reason, and the run goes on to its end."""
    monkeypatch.setattr(bench_client, "READ_BUFSIZE", 16)  # lines over 32 bytes: every chunk
    _, url = fake_server(ttft_s=0.01, gap_s=0.005)
    s = run_benchmark(_config(url, num_requests=3, output_len=4)).summary
    assert s["num_failed"] == 3 and s["failure_reasons"] == {"LineTooLong": 3}


def test_healthy_server_gives_zero_failures_and_full_attainment(fake_server):
    _, url = fake_server(ttft_s=0.01, gap_s=0.005)
    result = run_benchmark(_config(url, num_requests=4, output_len=4, slo=SloConfig(ttft_ms=5000, tpot_ms=5000)))
    assert result.summary["num_failed"] == 0 and result.summary["failures"] == []
    assert result.summary["slo_attainment"] == 1.0


@pytest.mark.parametrize("arrival, burstiness, expected_cv", [
    ("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0), ("gamma", 4.0, 0.5), ("constant", 1.0, 0.0),
])
def test_arrival_offsets_have_the_asked_mean_rate_and_spread(arrival, burstiness, expected_cv):
    num, rate = 4000, 8.0
    offsets = np.array(arrival_offsets(num, LoadConfig(request_rate=rate, arrival=arrival, burstiness=burstiness,
                                                       seed=3)))
    gaps = np.diff(np.concatenate([[0.0], offsets]))
    assert offsets[-1] == pytest.approx(num / rate) and gaps.mean() == pytest.approx(1 / rate)
    assert np.all(gaps >= 0)
    # Gamma(shape b) gaps have coefficient of variation 1/sqrt(b); 4000 draws pin it to a few %.
    assert gaps.std() / gaps.mean() == pytest.approx(expected_cv, abs=0.1 * max(expected_cv, 0.1))
    assert arrival_offsets(5, LoadConfig()) == [0.0] * 5  # rate inf: all at once


def test_requests_are_sent_at_the_asked_rate(fake_server):
    _, url = fake_server(ttft_s=0.005, gap_s=0.002)
    result = run_benchmark(_config(url, num_requests=20, output_len=2, request_rate=40.0, arrival="constant"))
    starts = [r.start_s for r in result.records]
    assert 0.45 <= max(starts) < 1.5  # the 20th arrival is due at 0.5 s
    assert result.summary["duration_s"] >= 0.5


def test_max_concurrency_is_never_exceeded(fake_server):
    fake, url = fake_server(ttft_s=0.05, gap_s=0.01)
    result = run_benchmark(_config(url, num_requests=12, output_len=3, max_concurrency=3))
    assert fake.peak_in_flight == 3 and result.summary["peak_concurrency"] == 3
    assert result.summary["num_failed"] == 0
    assert max(r.queue_s for r in result.records) > 0.05  # the later ones waited for a slot


def test_sweep_goodput_rate_is_the_highest_rate_meeting_the_slo(fake_server, tmp_path, capsys):
    # Latency grows with load: TTFT 20 ms + 150 ms per other request in flight. At 2 and 4 req/s a
    # request (~30 ms) is alone, 250 ms or more before the next arrives; at 100 req/s they pile up and
    # all but the first miss TTFT <= 100 ms. A target of 75% lets a machine slowed by the suite's
    # other workers overlap two requests (at 4 and 8 req/s, 60 ms requests overlapped on a loaded
    # 2-core machine: 5 of 8 met the target).
    _, url = fake_server(ttft_s=0.02, gap_s=0.005, ttft_per_in_flight_s=0.15)
    argv = ["bench", "--base-url", url, "--model", MODEL, "--num-requests", "8", "--input-len", "8",
            "--output-len", "3", "--arrival", "constant", "--sweep", "2,4,100", "--slo-ttft-ms", "100",
            "--slo-target", "0.75", "--no-progress", "--result-json", str(tmp_path / "sweep.json"),
            "--plot-dir", str(tmp_path / "plots")]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["goodput_rate"] == 4.0
    assert min(result["attainment"][:2]) >= 0.75 and result["attainment"][2] <= 0.25
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert [run["request_rate"] for run in saved["runs"]] == [2.0, 4.0, 100.0]
    assert (tmp_path / "plots" / "attainment_vs_rate.png").stat().st_size > 1000


def test_cli_writes_the_table_json_plots_and_a_last_result_line(fake_server, tmp_path, capsys):
    _, url = fake_server(ttft_s=0.01, gap_s=0.005)
    argv = ["bench", "--base-url", url, "--num-requests", "5", "--input-len", "8", "--output-len", "4",
            "--request-rate", "50", "--arrival", "gamma", "--burstiness", "0.5", "--max-concurrency", "2",
            "--warmup-requests", "2", "--slo-ttft-ms", "1000", "--no-progress",
            "--result-json", str(tmp_path / "r.json"), "--plot-dir", str(tmp_path / "plots")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("TTFT") for line in out) and any("Goodput" in line for line in out)
    summary = json.loads(out[-1].removeprefix("RESULT "))
    assert summary["num_completed"] == 5 and summary["model"] == MODEL  # found via /v1/models
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["config"]["load"]["burstiness"] == 0.5 and len(saved["records"]) == 5
    assert saved["summary"]["tpot_ms"]["p99"] == summary["tpot_ms"]["p99"]
    for name in ("latency_cdf.png", "in_flight.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000


def test_help_states_the_definitions(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = capsys.readouterr().out
    for phrase in ("(E2E - TTFT) / (output tokens - 1)", "pooled", "numpy.percentile", "SLO attainment", "goodput"):
        assert phrase in text


def test_summary_follows_the_vllm_definitions_on_fabricated_records():
    records = [
        RequestRecord(0, is_ok=True, ttft_s=0.1, e2e_s=0.5, itl_s=[0.1, 0.1, 0.2], num_output_tokens=5,
                      num_prompt_tokens=10, output_tokens_source="usage", end_s=0.5),
        RequestRecord(1, is_ok=True, ttft_s=0.3, e2e_s=0.3, itl_s=[], num_output_tokens=1, num_prompt_tokens=10,
                      output_tokens_source="usage", start_s=0.1, end_s=0.4),
        RequestRecord(2, is_ok=True, ttft_s=0.2, e2e_s=1.2, itl_s=[0.5, 0.5], num_output_tokens=3,
                      num_prompt_tokens=10, output_tokens_source="usage", start_s=0.2, end_s=1.4),
        RequestRecord(3, error="HTTP 500: b'x'", start_s=0.3, end_s=0.35),
    ]
    s = summarize(records, 2.0, SloConfig(ttft_ms=250, tpot_ms=200))
    ttfts_ms, tpots_ms = [100.0, 300.0, 200.0], [100.0, 500.0]  # TPOT: (0.5-0.1)/4, (1.2-0.2)/2; 1 token left out
    assert s["ttft_ms"]["p90"] == pytest.approx(np.percentile(ttfts_ms, 90))
    assert s["tpot_ms"]["mean"] == pytest.approx(300.0) and s["tpot_ms"]["p50"] == pytest.approx(300.0)
    assert s["tpot_ms"]["p99"] == pytest.approx(np.percentile(tpots_ms, 99))
    assert s["itl_ms"]["p50"] == pytest.approx(np.percentile([100, 100, 200, 500, 500], 50))
    assert s["e2e_ms"]["mean"] == pytest.approx(1000 * (0.5 + 0.3 + 1.2) / 3)
    # Meeting TTFT <= 250 and TPOT <= 200: only request 0 (request 1's TTFT is 300; 2's TPOT 500).
    assert s["slo_attainment"] == pytest.approx(1 / 4) and s["goodput_req_s"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(9 / 2.0) and s["total_token_throughput"] == pytest.approx(39 / 2)
    assert s["peak_concurrency"] == 4 and s["num_failed"] == 1


def test_random_dataset_lengths_fall_in_the_asked_ranges():
    config = DatasetConfig(num_requests=200, input_len=100, input_len_range="0.2", output_len=10,
                           output_len_range="5:15", vocab_low=3, vocab_high=50, seed=1)
    prompts = make_prompts(config)
    assert min(map(len, prompts)) >= 80 and max(map(len, prompts)) <= 120 and len({len(p) for p in prompts}) > 20
    assert all(3 <= token < 50 for p in prompts for token in p)
    max_tokens = [s.turns[0].max_tokens for s in build_dataset(config, "completions").sessions]
    assert min(max_tokens) == 5 and max(max_tokens) == 15
    words = build_dataset(config, "chat").sessions[0].turns[0].prompt
    assert isinstance(words, str) and 80 <= len(words.split()) <= 120
    with pytest.raises(ValueError, match="range"):
        DatasetConfig(input_len_range="1.5")


def test_multiturn_turns_wait_for_and_carry_the_previous_answers(fake_server):
    fake, url = fake_server(ttft_s=0.01, gap_s=0.005)
    result = run_benchmark(_config(url, endpoint="chat", name="multiturn", num_users=2, turns=3, input_len=5,
                                   output_len=2, system_prompt_len=12))
    assert result.summary["num_completed"] == 6
    by_system = {}
    for body in fake.bodies:
        by_system.setdefault(body["messages"][0]["content"], []).append(body["messages"])
    assert len(by_system) == 1  # one system prompt shared by every user
    histories = sorted(next(iter(by_system.values())), key=len)
    assert [len(m) for m in histories] == [2, 2, 4, 4, 6, 6]  # system + (user, assistant) x k + user
    answers = {r.text for r in result.records}
    assert all(m[2 * k + 2]["content"] in answers for m in histories for k in range(len(m) // 2 - 1))


def test_jsonl_prompts_and_max_tokens_are_sent_as_written(fake_server, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello there", "max_tokens": 3}\n\n{"prompt": [5, 6, 7]}\n')
    fake, url = fake_server(ttft_s=0.005, gap_s=0.002)
    result = run_benchmark(_config(url, name="jsonl", path=str(path), num_requests=2, output_len=4))
    assert result.summary["num_completed"] == 2
    assert sorted((str(b["prompt"]), b["max_tokens"]) for b in fake.bodies) == [("[5, 6, 7]", 4), ("hello there", 3)]
    with pytest.raises(ValueError, match="token-id prompts need --endpoint completions"):
        run_benchmark(replace(_config(url, name="jsonl", path=str(path)), endpoint=EndpointConfig(
            base_url=url, model=MODEL, endpoint="chat")))


@pytest.mark.parametrize(("endpoint", "asked"), [("completions", {"logprobs": 2}),
                                                  ("chat", {"logprobs": True, "top_logprobs": 2})])
def test_logprobs_are_asked_for_as_each_endpoint_names_them(fake_server, endpoint, asked):
    """--logprobs N: every token then comes in a chunk of its own, even one without text."""
    fake, url = fake_server(ttft_s=0.005, gap_s=0.002)
    config = _config(url, endpoint, num_requests=2, output_len=4)
    run_benchmark(replace(config, endpoint=replace(config.endpoint, logprobs=2)))
    run_benchmark(config)
    assert [{k: b[k] for k in ("logprobs", "top_logprobs") if k in b} for b in fake.bodies] == [asked] * 2 + [{}] * 2
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--logprobs", "0"])).endpoint.logprobs == 0
    with pytest.raises(ValueError, match="logprobs must be >= 0"):
        EndpointConfig(logprobs=-1)


@pytest.mark.parametrize("has_tokenize, source", [(True, "/tokenize"), (False, "characters / 4")])
def test_sharegpt_answer_lengths_come_from_tokenize_when_the_endpoint_has_it(fake_server, tmp_path, has_tokenize,
                                                                             source):
    answer = "one two three four five six seven eight nine ten eleven twelve"  # 12 words, 62 characters
    conversations = [{"conversations": [{"from": "human", "value": f"question number {i} is here"},
                                        {"from": "gpt", "value": answer}]} for i in range(3)]
    conversations.append({"conversations": [{"from": "human", "value": "no answer"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    _, url = fake_server(has_tokenize=has_tokenize)
    dataset, _ = prepare_datasets(_config(url, name="sharegpt", path=str(path), num_requests=5), MODEL)
    assert len(dataset.sessions) == 3 and "gave 3 usable prompts" in dataset.notes["shortfall"]
    assert source in dataset.notes["output_len_source"]
    assert {s.turns[0].max_tokens for s in dataset.sessions} == {12 if has_tokenize else math.ceil(len(answer) / 4)}


OUTPUT_LEN = 48  # tokens per request: the decoding after the first token is what a late first-token time would add


def _histogram_means(base_url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the proxy's TTFT and E2E histograms."""
    import httpx

    text = httpx.get(base_url + "/metrics", timeout=10).text
    values = {}
    for name in ("pdserve_time_to_first_token_seconds", "pdserve_e2e_request_latency_seconds"):
        sums = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "_sum")]
        counts = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "_count")]
        values[name] = (sums[0], counts[0])
    return values


def test_real_deployment_run_has_no_failures_and_agrees_with_the_proxys_metrics(tiny_model_dir, tmp_path):
    deployment = start_local(tiny_model_dir, num_prefill=1, num_decode=1, pin_cpus=False, log_dir=tmp_path)
    try:
        wait_healthy(deployment, 180)
        config = BenchConfig(EndpointConfig(base_url=deployment.base_url, timeout_s=120),
                             DatasetConfig(num_requests=6, input_len=32, output_len=OUTPUT_LEN, vocab_high=2000),
                             LoadConfig(request_rate=20.0, max_concurrency=3, show_progress=False))
        # Warm up outside the measured window: first requests pay one-off costs on both sides.
        run_benchmark(replace(config, dataset=replace(config.dataset, num_requests=2, seed=1)))
        before = _histogram_means(deployment.base_url)
        result = run_benchmark(config)
        after = _histogram_means(deployment.base_url)
    finally:
        deployment.stop()
    s = result.summary
    assert s["num_failed"] == 0, s["failures"]
    assert s["output_tokens_source"] == {"usage": 6} and s["total_output_tokens"] == 6 * OUTPUT_LEN
    proxy_ms = {}
    for name, key in (("pdserve_time_to_first_token_seconds", "ttft_ms"),
                      ("pdserve_e2e_request_latency_seconds", "e2e_ms")):
        total_s, count = (a - b for a, b in zip(after[name], before[name]))
        assert count == 6
        proxy_ms[key] = 1000 * total_s / count
    decode_ms = proxy_ms["e2e_ms"] - proxy_ms["ttft_ms"]  # the proxy's first token to its last, on average
    for key, value in proxy_ms.items():
        # The client's span holds the proxy's (connecting, HTTP parsing, the SSE hop): never below
        # it (2 ms for clock reads), and above it by the loopback overhead: 10-50 ms measured on two
        # cores shared with the nodes, 103 ms once beside the other test worker. Allowed: 150 ms or
        # a quarter; for TTFT, also half the decoding that follows, so a first token timed at the
        # stream's end still fails.
        slack = max(150.0, 0.25 * value, 0.5 * decode_ms if key == "ttft_ms" else 0.0)
        assert value - 2 <= s[key]["mean"] <= value + slack, (key, s[key]["mean"], value, decode_ms)


def test_load_client_benchmark_streams_every_chunk_through_both_clients():
    """benchmarks/load_client.py (the load generator's CPU per chunk) on a few short streams: each
    client process checks that it read every chunk, and the result reports both clients."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "load_client.py"
    out = subprocess.run([sys.executable, str(script), "--streams", "4", "--chunks", "5", "--rounds", "2",
                          "--repeats", "1", "--gap-ms", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    for client in ("httpx", "aiohttp"):
        assert result[client]["first_round_us_per_chunk"] > 0 and result[client]["later_rounds_us_per_chunk"] > 0
