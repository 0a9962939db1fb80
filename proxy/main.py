"""`pdserve proxy`: serve the OpenAI API in front of prefill and decode nodes."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


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
    parser.add_argument("--log-level", default="info")


def main(args: argparse.Namespace) -> int:
    from proxy.app import run
    from proxy.config import ProxyConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = ProxyConfig(
        model_dir=args.model,
        served_model_name=args.served_model_name or Path(args.model).name,
        host=args.host,
        port=args.port,
        prefill_addresses=tuple(a for a in args.prefill.split(",") if a),
        decode_addresses=tuple(a for a in args.decode.split(",") if a),
        request_timeout_s=args.request_timeout_s,
        first_token_timeout_s=args.first_token_timeout_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        api_key=args.api_key,
        max_model_len=args.max_model_len,
    )
    run(config, args.log_level)
    return 0
