"""Fixtures the engine tests share: an engine on the tiny random model with room for a batch of
32 requests, and that model's tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    """A module's own engine: a test module may define its own `engine` instead."""
    config = EngineConfig(ModelConfig.from_pretrained(tiny_model_dir), CacheConfig(num_blocks=1024),
                          SchedulerConfig(max_num_seqs=32))
    return LLMEngine(config)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)
