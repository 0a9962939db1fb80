"""The offline API: `LLM(model_dir).generate(prompts, params)` and `LLM.chat(messages)`."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from tqdm import tqdm
from transformers import AutoTokenizer

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, resolve_device, resolve_dtype
from engine.engine import LLMEngine, StepOutput
from engine.protocol import TokenLogprob
from engine.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per token: the chosen one and the top N
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # With SamplingParams.prompt_logprobs: per prompt token its logprob and the top N
    # (entry 0 has logprob None), as protocol.PrefillResult.prompt_logprobs.
    prompt_logprobs: list[TokenLogprob] | None = None


class LLM:
    """A plain (colocated) engine on local weights. Options (each default is its config field's):
    dtype ("auto": engine.config.resolve_dtype) and max_model_len (ModelConfig.from_pretrained), block_size, num_blocks,
    kv_cache_memory_bytes and prefault (CacheConfig), max_num_seqs and max_num_batched_tokens
    (SchedulerConfig), device ("auto": CUDA when available), seed, enable_prefix_caching,
    kernel_backend, decode_graphs, mixed_graph_tokens, async_scheduling and tensor_parallel_size
    (EngineConfig). Raises TypeError for an unknown option, ValueError for a bad value. close() (or a
    with block) stops a tensor-parallel engine's worker ranks; they also stop when the LLM is
    collected or the process exits."""

    def __init__(self, model: str, *, dtype: str | None = None, max_model_len: int | None = None,
                 device: str = "auto", **options) -> None:
        device = resolve_device(device)
        config = EngineConfig(
            model=ModelConfig.from_pretrained(model, dtype=resolve_dtype(dtype, device, model),
                                              max_model_len=max_model_len),
            cache=CacheConfig(**_pick(options, CacheConfig)),
            scheduler=SchedulerConfig(**_pick(options, SchedulerConfig)),
            device=device,
            **_pick(options, EngineConfig, only=("seed", "enable_prefix_caching", "kernel_backend",
                                                  "decode_graphs", "mixed_graph_tokens", "async_scheduling",
                                                  "tensor_parallel_size")),
        )
        if options:
            raise TypeError(f"LLM got unknown options: {', '.join(sorted(options))}")
        self.engine = LLMEngine(config)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's worker ranks (tensor parallelism); nothing to do on one rank."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. Raises ValueError (naming
        the parameter) before anything runs if a prompt or parameter is bad."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        outputs = [self._make_output(p) for p in prompt_list]
        for output in outputs:
            self.engine.check_token_ids(output.request_id, output.prompt_token_ids, [])
        try:
            for output, params in zip(outputs, params_list):
                self.engine.add_request(output.request_id, output.prompt_token_ids, params)
            self._run(outputs, params_list, use_tqdm)
        except BaseException:
            # NOTE: a failed request, a failed step or a Ctrl-C: the call's other requests would
            # otherwise stay in the engine, holding blocks and stepping in the next call.
            for output in outputs:
                self.engine.abort(output.request_id)
            raise
        return outputs

    def chat(
        self, messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        if not messages:
            raise ValueError("messages must not be empty")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _make_output(self, prompt: Prompt) -> RequestOutput:
        request_id = f"offline-{next(self._ids)}"
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return RequestOutput(request_id, prompt, self.tokenizer.encode(prompt))
        return RequestOutput(request_id, None, list(prompt))

    def _run(self, outputs: list[RequestOutput], params_list: list[SamplingParams], use_tqdm: bool) -> None:
        by_id = {o.request_id: (o, p) for o, p in zip(outputs, params_list)}
        for output in outputs:
            output.outputs.append(CompletionOutput(0, "", [], None, None))
        num_unfinished = len(outputs)
        with tqdm(total=len(outputs), desc="generate", disable=not use_tqdm, unit="req") as bar:
            while num_unfinished:
                for step_output in self.engine.step():
                    if step_output.error is not None:
                        raise RuntimeError(f"request {step_output.request_id} failed: {step_output.error}")
                    output, params = by_id[step_output.request_id]
                    _absorb(output.outputs[0], step_output, params)
                    if step_output.prompt_logprobs is not None:
                        output.prompt_logprobs = step_output.prompt_logprobs
                    if step_output.is_finished:
                        output.finished = True
                        num_unfinished -= 1
                        bar.update(1)
        for output in outputs:
            completion = output.outputs[0]
            completion.text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def _pick(options: dict, config_class, only: tuple[str, ...] | None = None) -> dict:
    """Take the options named like config_class's fields (or only those listed) out of options."""
    names = only or tuple(f.name for f in dataclasses.fields(config_class))
    return {name: options.pop(name) for name in names if name in options}


def _absorb(completion: CompletionOutput, step: StepOutput, params: SamplingParams) -> None:
    completion.token_ids.extend(t.token_id for t in step.new_tokens)
    if params.logprobs is not None:
        completion.logprobs = completion.logprobs or []
        completion.logprobs.extend(_logprob_dict(t) for t in step.new_tokens)
    if step.finish_reason is not None:
        completion.finish_reason = step.finish_reason.value


def _logprob_dict(token: TokenLogprob) -> dict[int, float]:
    entries = {token_id: logprob for token_id, logprob in token.top}
    entries[token.token_id] = token.logprob
    return entries


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]
    return list(prompts)


def _as_params_list(params: SamplingParams | list[SamplingParams] | None, num: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num
    if isinstance(params, SamplingParams):
        return [params] * num
    if len(params) != num:
        raise ValueError(f"sampling_params has {len(params)} entries for {num} prompts")
    return list(params)
