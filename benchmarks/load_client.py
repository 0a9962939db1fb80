"""The load generator's own CPU per streamed chunk: `pdserve bench`'s aiohttp client against an
httpx AsyncClient (its client before), on the same streams.

A local server (a child process, uvicorn on a free port) streams --streams concurrent
completions of --chunks SSE chunks each (one every --gap-ms, as a decode node's steps would).
Each client, in its own process pinned to --core, runs --rounds rounds of all the streams at
once, alternated with the other; a client's figure is its process's CPU seconds per chunk over a
round (the first round, which opens the connections, is reported apart). Ends with
`RESULT {json}`.

    .venv/bin/python benchmarks/load_client.py [--streams 64] [--chunks 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# NOTE: the chunk is a pdserve completions chunk's shape and size, without the proxy behind it.
_SERVER = r'''
import asyncio, json, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

port, chunks, gap_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

async def events():
    for i in range(chunks):
        await asyncio.sleep(gap_s)
        choice = {"index": 0, "text": f" tok{i}", "logprobs": None, "finish_reason": None}
        yield "data: " + json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
                                     "choices": [choice]}) + "\n\n"
    yield "data: " + json.dumps({"id": "cmpl-0", "choices": [], "usage": {"completion_tokens": chunks}}) + "\n\n"
    yield "data: [DONE]\n\n"

async def completions(request):
    await request.body()
    return StreamingResponse(events(), media_type="text/event-stream")

async def health(request):
    return PlainTextResponse("ok")

app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)])
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools")
'''


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per client process (the first opens the pool)")
    parser.add_argument("--repeats", type=int, default=2, help="client processes per client, alternated")
    parser.add_argument("--core", type=int, default=None, help="pin each client process to this core")
    parser.add_argument("--client", choices=["aiohttp", "httpx"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # NOTE: microseconds; os.times() counts 10 ms ticks
    return usage.ru_utime + usage.ru_stime


async def _client_rounds(args: argparse.Namespace) -> list[float]:
    """CPU seconds per chunk of each round, in this process."""
    from pdserve.bench_client import http_session, sse_data

    url = f"http://127.0.0.1:{args.port}/v1/completions"
    body = {"model": "m", "prompt": [1] * 256, "max_tokens": args.chunks, "stream": True}

    def count(line: bytes) -> int:
        data = sse_data(line)
        if not data or data == b"[DONE]":
            return 0
        return 1 if json.loads(data).get("choices") else 0

    if args.client == "aiohttp":
        async def one(client) -> int:
            async with client.post(url, json=body) as response:
                return sum([count(line) async for line in response.content])
        session = http_session(None, 60.0)
    else:
        import httpx

        async def one(client) -> int:
            async with client.stream("POST", url, json=body) as response:
                return sum([count(line.encode()) async for line in response.aiter_lines()])
        session = httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=None,
                                                                      max_keepalive_connections=None))
    per_chunk = []
    async with session as client:
        for _ in range(args.rounds):
            before = _cpu_s()
            num = sum(await asyncio.gather(*[one(client) for _ in range(args.streams)]))
            if num != args.streams * args.chunks:
                raise RuntimeError(f"{args.client}: {num} chunks, expected {args.streams * args.chunks}")
            per_chunk.append((_cpu_s() - before) / num)
    return per_chunk


def run_client(args: argparse.Namespace, client: str, port: int) -> list[float]:
    command = [sys.executable, __file__, "--client", client, "--port", str(port), "--streams", str(args.streams),
               "--chunks", str(args.chunks), "--rounds", str(args.rounds)]
    if args.core is not None:
        command = ["taskset", "-c", str(args.core), *command]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.client:
        import uvloop

        print(json.dumps(uvloop.run(_client_rounds(args))))
        return
    from pdserve.ports import free_port, wait_http_ok

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), str(args.chunks), str(args.gap_ms / 1e3)])

    def check_alive() -> None:
        if server.poll() is not None:
            raise RuntimeError(f"the stream server exited with {server.returncode} while starting")

    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 30.0, check_alive)
        rounds: dict[str, list[list[float]]] = {"httpx": [], "aiohttp": []}
        for repeat in range(args.repeats):
            for client in rounds:
                per_chunk = run_client(args, client, port)
                rounds[client].append(per_chunk)
                print(f"repeat {repeat} {client}: us of CPU a chunk, round by round: "
                      + ", ".join(f"{1e6 * c:.1f}" for c in per_chunk), flush=True)
    finally:
        server.terminate()
        server.wait(30)
    result = {"streams": args.streams, "chunks": args.chunks, "gap_ms": args.gap_ms}
    for client, runs in rounds.items():
        first = [run[0] * 1e6 for run in runs]
        later = [c * 1e6 for run in runs for c in run[1:]]
        result[client] = {"first_round_us_per_chunk": round(statistics.median(first), 1),
                          "later_rounds_us_per_chunk": round(statistics.median(later), 1) if later else None}
        print(f"{client}: {result[client]['later_rounds_us_per_chunk']} us of CPU a chunk (median of the later "
              f"rounds), first round {result[client]['first_round_us_per_chunk']}")
    from results_io import write_result

    write_result("load_client", result)


if __name__ == "__main__":
    main()
