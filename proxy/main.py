"""`pdserve proxy`: serve the OpenAI API in front of prefill and decode nodes."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from proxy.config import ProxyConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (tokenizer, chat template, config)")
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: the directory name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", default="", help="prefill nodes, HOST:PORT,... (empty: colocated)")
    parser.add_argument("--decode", required=True, help="decode nodes, HOST:PORT,...")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/")
    parser.add_argument("--request-timeout-s", type=float, default=600.0,
                        help="longest wait for a node's next tokens once decoding")
    parser.add_argument("--first-token-timeout-s", type=float, default=300.0,
                        help="longest wait for a prompt's first token (queueing and prefill)")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--local-prefill-min-wait-s", type=float, default=1.0,
                        help="prefill on the decode node when the prefill pool's queue wait is at least this "
                             "and the decode node would start sooner (negative: never)")
    parser.add_argument("--local-prefill-penalty", type=float, default=2.0,
                        help="how much a decode node's own queue wait counts against the pool's (>= 1)")
    parser.add_argument("--log-level", default="info")


def main(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; 0 on a clean stop, 2 for bad arguments or model files."""
    from proxy.app import run

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
        run(config, args.log_level)
    except (ValueError, OSError) as exc:  # process edge: a readable message, not a traceback
        print(f"pdserve proxy: {exc}", file=sys.stderr)
        return 2
    return 0


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """Raises ValueError naming a bad argument."""
    return ProxyConfig(
        model_dir=args.model,
        served_model_name=args.served_model_name or Path(args.model).resolve().name,
        host=args.host,
        port=args.port,
        prefill_addresses=_addresses(args.prefill),
        decode_addresses=_addresses(args.decode),
        request_timeout_s=args.request_timeout_s,
        first_token_timeout_s=args.first_token_timeout_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        api_key=args.api_key,
        max_model_len=args.max_model_len,
        local_prefill_min_wait_s=None if args.local_prefill_min_wait_s < 0 else args.local_prefill_min_wait_s,
        local_prefill_penalty=args.local_prefill_penalty,
    )


def _addresses(joined: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in joined.split(",") if a.strip())
