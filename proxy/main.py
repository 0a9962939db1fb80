"""`pdserve proxy`: serve the OpenAI API in front of prefill and decode nodes."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from engine.model_files import check_model_dir
from engine.protocol import default_of
from proxy.config import ProxyConfig, RoutingPolicy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (tokenizer, chat template, config)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients use (default: the directory name)")
    parser.add_argument("--host", default=_default("host"))
    parser.add_argument("--port", type=int, default=_default("port"))
    parser.add_argument("--prefill", default="", help="prefill nodes, HOST:PORT,... (empty: colocated)")
    parser.add_argument("--decode", default="", help="decode nodes, HOST:PORT,... (or --decode-dns/--nodes-file)")
    _add_discovery_arguments(parser)
    parser.add_argument("--api-key", default=_default("api_key"), help="require 'Authorization: Bearer KEY' on /v1/")
    parser.add_argument("--request-timeout-s", type=float, default=_default("request_timeout_s"),
                        help="longest wait for a node's next tokens once decoding")
    parser.add_argument("--first-token-timeout-s", type=float, default=_default("first_token_timeout_s"),
                        help="longest wait for a prompt's first token (queueing and prefill)")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=_default("heartbeat_timeout_s"))
    parser.add_argument("--stall-timeout-s", type=float, default=_default("stall_timeout_s"),
                        help="a node whose loop makes no progress this long while it has work is down")
    parser.add_argument("--max-attempts", type=int, default=_default("max_attempts"),
                        help="sends of a request before its first token (each failure tries another node)")
    parser.add_argument("--decode-wait-s", type=float, default=_default("decode_wait_s"),
                        help="a prompt is prefilled only once a decode node can take it; while none can (starting, "
                             "down), it waits this long, then gets a 503 naming why")
    parser.add_argument("--max-migrations", type=int, default=_default("max_migrations"),
                        help="moves of a streaming request to another decode node when its node fails")
    parser.add_argument("--drain-timeout-s", type=float, default=_default("drain_timeout_s"),
                        help="on SIGTERM, how long open streams may finish (new requests get 503) before they "
                             "end with an error event")
    parser.add_argument("--max-model-len", type=int, default=_default("max_model_len"))
    parser.add_argument("--local-prefill-min-wait-s", type=float, default=_default("local_prefill_min_wait_s"),
                        help="prefill on the decode node when the prefill pool's queue wait is at least this "
                             "and the decode node would start sooner (negative: never)")
    parser.add_argument("--kv-stream-min-tokens", type=int, default=_default("kv_stream_min_tokens"),
                        help="a prompt of at least this many tokens that its prefill node runs in several chunks "
                             "is read by its decode node chunk by chunk while it is prefilled (negative: never; "
                             "the KV is read once the whole prompt is prefilled)")
    parser.add_argument("--local-prefill-penalty", type=float, default=_default("local_prefill_penalty"),
                        help="how much a decode node's own queue wait counts against the pool's (>= 1)")
    parser.add_argument("--routing", choices=[p.value for p in RoutingPolicy], default=_default("routing").value,
                        help="cache-aware: the prefill node with the fewest uncached + queued prefill tokens, the "
                             "decode node caching the longest prefix (within the caps below; one with a free slot "
                             "first); least-loaded and round-robin ignore caches")
    parser.add_argument("--routing-max-extra-prefill-tokens", type=int,
                        default=_default("routing_max_extra_prefill_tokens"),
                        help="cache-aware: a prefill node queued more prefill tokens than this past the least "
                             "queued one gets no request for its cache")
    parser.add_argument("--routing-max-extra-decode-requests", type=int,
                        default=_default("routing_max_extra_decode_requests"),
                        help="cache-aware: a decode node with this many more requests than the least loaded one "
                             "gets no request for its cache")
    parser.add_argument("--chat-template", default=_default("chat_template_path"), metavar="FILE",
                        help="a Jinja chat template replacing the model's (default: chat_template.jinja, "
                             "else tokenizer_config.json)")
    parser.add_argument("--chat-template-timeout-s", type=float, default=_default("chat_template_timeout_s"),
                        help="longest a chat template may render before the request gets a 400")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        default=_default("trust_request_chat_template"),
                        help="let requests bring their own chat_template (run in the sandbox, bounded)")
    parser.add_argument("--strict-fields", action=argparse.BooleanOptionalAction, default=_default("strict_fields"),
                        help="refuse (400) completion requests with fields this server does not know, instead of "
                             "ignoring them with a Pdserve-Ignored-Fields header and a warning line")
    parser.add_argument("--node-metrics", action=argparse.BooleanOptionalAction, default=_default("node_metrics"),
                        help="/metrics also carries every node's vllm:* series, read from the nodes at each scrape "
                             "(turn off where the nodes are scraped themselves)")
    parser.add_argument("--cluster-secret", default=_default("cluster_secret"),
                        help="secret shared with every node (CURVE on every node socket; without one, the proxy "
                             "and its nodes must all be on loopback)")
    _add_limit_arguments(parser)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", default="text", choices=("text", "json"),
                        help="json: one object per line (time, level, logger, message, request_id)")


def _add_discovery_arguments(parser: argparse.ArgumentParser) -> None:
    """Nodes that join and leave while the proxy runs (proxy.discovery, proxy.admin)."""
    parser.add_argument("--prefill-dns", default="", metavar="HOST:PORT,...",
                        help="names re-resolved every --discovery-interval-s: each address a prefill node "
                             "(a Kubernetes headless Service)")
    parser.add_argument("--decode-dns", default="", metavar="HOST:PORT,...", help="as --prefill-dns, decode nodes")
    parser.add_argument("--nodes-file", default=_default("nodes_file"), metavar="FILE",
                        help="YAML/JSON {prefill: [HOST:PORT, ...], decode: [...]}, re-read when it changes")
    parser.add_argument("--discovery-interval-s", type=float, default=_default("discovery_interval_s"),
                        help="how often DNS names are re-resolved and the nodes file checked")
    parser.add_argument("--admin-token", default=_default("admin_token"),
                        help="bearer token of /admin/nodes (list/add/drain/remove nodes); without one the "
                             "admin routes are served on a loopback proxy only")


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Overload control and input bounds (a request past one gets a 4xx at once)."""
    parser.add_argument("--max-num-requests", type=int, default=_default("max_num_requests"),
                        help="choices (prompts x n) in flight at once; more get a 429 with Retry-After")
    parser.add_argument("--max-queue-wait-s", type=float, default=_default("max_queue_wait_s"),
                        help="refuse (429) a request whose estimated queue wait is longer (default: off)")
    parser.add_argument("--slo-ttft-ms", type=float, default=_default("slo_ttft_ms"),
                        help="refuse (429) a request whose predicted time to first token misses this (default: off)")
    parser.add_argument("--max-node-waiting", type=int, default=_default("max_node_waiting"),
                        help="queued requests that make a node full (as no free KV block while any queue)")
    parser.add_argument("--max-body-bytes", type=int, default=_default("max_body_bytes"),
                        help="largest request body (413 past it)")
    parser.add_argument("--body-timeout-s", type=float, default=_default("body_timeout_s"),
                        help="longest a request body may take to arrive (408 past it)")
    parser.add_argument("--min-upload-bytes-per-s", type=float, default=_default("min_upload_bytes_per_s"),
                        help="a body bringing fewer than this times --upload-rate-window-s bytes in a window gets a "
                             "408 and its connection closed (0: no minimum)")
    parser.add_argument("--upload-rate-window-s", type=float, default=_default("upload_rate_window_s"),
                        help="the windows, from a body's start, over which --min-upload-bytes-per-s is checked")
    parser.add_argument("--header-timeout-s", type=float, default=_default("header_timeout_s"),
                        help="longest a request's headers may take to arrive (from a new connection's start); "
                             "past it the connection is closed")
    parser.add_argument("--keep-alive-timeout-s", type=float, default=_default("keep_alive_timeout_s"),
                        help="a connection with no request in progress is closed after this long")
    parser.add_argument("--max-client-uploads", type=int, default=_default("max_client_uploads"),
                        help="request bodies one client (address) may be sending at once; more get a 429 (0: no cap)")
    parser.add_argument("--max-client-requests", type=int, default=_default("max_client_requests"),
                        help="choices one client (address) may hold in flight; more get a 429 while other clients "
                             "are served (0: no cap)")
    parser.add_argument("--expose-node-addresses", action="store_true", default=_default("expose_node_addresses"),
                        help="name nodes by address in /health, /metrics and errors (default: prefill0, decode0, ...)")


def _default(name: str):
    """ProxyConfig's default for field name (each default lives once, on its field)."""
    return default_of(ProxyConfig, name)


def main(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; 0 on a clean stop, 2 for bad arguments or model files."""
    from proxy.app import run

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
        logging.getLogger(__name__).info(
            "cluster secret set: node sockets speak CURVE" if config.cluster_secret
            else "no cluster secret: the proxy and its nodes stay on loopback")
        run(config, args.log_level)
    except (ValueError, OSError) as exc:  # process edge: a readable message, not a traceback
        print(f"pdserve proxy: {exc}", file=sys.stderr)
        return 2
    return 0


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """Raises ValueError naming a bad argument (a model directory without what the proxy reads
    included)."""
    check_model_dir(args.model, weights=False)
    return ProxyConfig(
        model_dir=args.model,
        served_model_name=args.served_model_name or Path(args.model).resolve().name,
        host=args.host,
        port=args.port,
        prefill_addresses=_addresses(args.prefill),
        decode_addresses=_addresses(args.decode),
        prefill_dns=_addresses(args.prefill_dns),
        decode_dns=_addresses(args.decode_dns),
        nodes_file=args.nodes_file,
        discovery_interval_s=args.discovery_interval_s,
        admin_token=args.admin_token,
        request_timeout_s=args.request_timeout_s,
        first_token_timeout_s=args.first_token_timeout_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        stall_timeout_s=args.stall_timeout_s,
        decode_wait_s=args.decode_wait_s,
        max_attempts=args.max_attempts,
        max_migrations=args.max_migrations,
        drain_timeout_s=args.drain_timeout_s,
        api_key=args.api_key,
        max_model_len=args.max_model_len,
        local_prefill_min_wait_s=_never_if_negative(args.local_prefill_min_wait_s),
        local_prefill_penalty=args.local_prefill_penalty,
        kv_stream_min_tokens=None if args.kv_stream_min_tokens < 0 else args.kv_stream_min_tokens,
        routing=RoutingPolicy(args.routing),
        routing_max_extra_prefill_tokens=args.routing_max_extra_prefill_tokens,
        routing_max_extra_decode_requests=args.routing_max_extra_decode_requests,
        chat_template_path=args.chat_template,
        chat_template_timeout_s=args.chat_template_timeout_s,
        trust_request_chat_template=args.trust_request_chat_template,
        strict_fields=args.strict_fields,
        node_metrics=args.node_metrics,
        cluster_secret=args.cluster_secret,
        max_num_requests=args.max_num_requests,
        max_queue_wait_s=args.max_queue_wait_s,
        slo_ttft_ms=args.slo_ttft_ms,
        max_node_waiting=args.max_node_waiting,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout_s,
        min_upload_bytes_per_s=args.min_upload_bytes_per_s or None,
        upload_rate_window_s=args.upload_rate_window_s,
        header_timeout_s=args.header_timeout_s,
        keep_alive_timeout_s=args.keep_alive_timeout_s,
        max_client_uploads=args.max_client_uploads or None,
        max_client_requests=args.max_client_requests or None,
        expose_node_addresses=args.expose_node_addresses,
    )


def _addresses(joined: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in joined.split(",") if a.strip())


def _never_if_negative(min_wait_s: float | None) -> float | None:
    return None if min_wait_s is None or min_wait_s < 0 else min_wait_s
