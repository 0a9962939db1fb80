"""A choice keeps its tokens only where its logprobs are asked for (the body's logprobs are made
from them): a long stream without them holds its text, not a token object per token until it ends."""

from __future__ import annotations

import pytest

from engine import protocol
from proxy.choices import ChoiceState
from proxy.tokenizer import ModelTokenizer, TextOptions


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> ModelTokenizer:
    return ModelTokenizer.from_dir(model_dir, template_timeout_s=1.0)


@pytest.mark.parametrize("wants_logprobs", [False, True])
def test_tokens_are_kept_only_for_logprobs(tokenizer, wants_logprobs):
    ids = tokenizer.encode("a long answer, one token at a time")
    state = ChoiceState(0, tokenizer, TextOptions([]), wants_logprobs=wants_logprobs)
    deltas = [state.add([protocol.TokenLogprob(i, -1.0, [])], None) for i in ids[:-1]]
    deltas.append(state.add([protocol.TokenLogprob(ids[-1], -1.0, [])], "length"))
    assert state.num_tokens == len(ids) and state.text == "a long answer, one token at a time"
    assert [t.token_id for d in deltas for t in d.tokens] == ids  # each delta still carries its own
    assert [t.token_id for t in state.tokens] == (ids if wants_logprobs else [])
    logprobs = state.chat_logprobs(state.tokens)
    assert (logprobs is None) != wants_logprobs and (not wants_logprobs or len(logprobs["content"]) == len(ids))
