"""ProxyConfig: the proxy's settings, built once by `pdserve proxy` and passed down."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProxyConfig:
    model_dir: str  # tokenizer.json, tokenizer_config.json, config.json, generation_config.json
    served_model_name: str  # the only model name requests may use
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_addresses: tuple[str, ...] = ()  # HOST:PORT of prefill nodes; none: colocated mode
    decode_addresses: tuple[str, ...] = ()  # HOST:PORT of decode (or colocated) nodes
    request_timeout_s: float = 600.0  # longest wait for a decoding request's next tokens
    first_token_timeout_s: float = 300.0  # longest wait for a prompt's first token
    heartbeat_timeout_s: float = 3.0  # a node silent this long is down: no new requests, its own fail
    api_key: str | None = None  # set: /v1/ needs "Authorization: Bearer <api_key>"
    max_model_len: int | None = None  # None: the nodes' reports, else config.json max_position_embeddings
    # Conditional disaggregation: a prompt is prefilled on its decode node instead when the
    # prefill pool's estimated queue wait is at least local_prefill_min_wait_s and the decode
    # node's own wait, times local_prefill_penalty (its decodes slow down meanwhile), is shorter.
    # None: always the prefill pool.
    local_prefill_min_wait_s: float | None = 1.0
    local_prefill_penalty: float = 2.0
    chat_template_path: str | None = None  # a Jinja file replacing the model's chat template(s)
    # NOTE: rendering a 1,000-message conversation (~60k tokens) with SmolLM2's template takes
    # 5-11 ms, 10,000 messages ~100 ms; a template still running after 1 s is looping, and is
    # stopped with a 400 (the stop lands within ~20 ms of the deadline).
    chat_template_timeout_s: float = 1.0
    # Requests may bring their own chat_template (vLLM's --trust-request-chat-template): off, as
    # there, since a template runs code of the client's choosing in the proxy (sandboxed, bounded).
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        if not self.decode_addresses:
            raise ValueError("decode_addresses must name at least one decode node")
        for address in (*self.prefill_addresses, *self.decode_addresses):
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"node address must be HOST:PORT, got {address!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.local_prefill_min_wait_s is not None and self.local_prefill_min_wait_s < 0:
            raise ValueError(f"local_prefill_min_wait_s must be >= 0, got {self.local_prefill_min_wait_s}")
        if self.local_prefill_penalty < 1:
            raise ValueError(f"local_prefill_penalty must be >= 1, got {self.local_prefill_penalty}")
        for name in ("request_timeout_s", "first_token_timeout_s", "heartbeat_timeout_s", "chat_template_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
