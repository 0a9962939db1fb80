"""What `pdserve bench` asks: sessions of one or more turns built from a dataset config (random
token ids or words, a jsonl file, ShareGPT conversations, simulated multi-turn users)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdserve.bench_config import DatasetConfig, length_bounds

# Common English words: most are one token in BPE vocabularies, so N words are roughly N tokens.
_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "by", "be", "at", "this",
    "have", "from", "or", "one", "had", "not", "but", "what", "all", "were", "when", "we", "there", "can",
    "an", "your", "which", "their", "said", "if", "do", "will", "each", "about", "how", "up", "out", "them",
    "then", "she", "many", "some", "so", "these", "would", "other", "into", "has", "more", "her", "two",
    "like", "him", "see", "time", "could", "no", "make", "than", "first", "been", "its", "who", "now",
    "people", "my", "made", "over", "did", "down", "only", "way", "find", "use", "may", "water", "long",
    "little", "very", "after", "words", "called", "just", "where", "most", "know", "get", "through", "back",
    "much", "before", "go", "good", "new", "write", "our", "used", "me", "man", "too", "any", "day", "same",
    "right", "look", "think", "also", "around", "another", "came", "come", "work", "three", "word", "must",
    "because", "does", "part", "even", "place", "well", "such", "here", "take", "why", "things", "help", "put",
    "years", "different", "away", "again", "off", "went", "old",
)
# ShareGPT filters, as vLLM's benchmark datasets apply them: shorter pairs are noise, longer ones
# do not fit small models.
_SHAREGPT_MIN_LEN = 4
_SHAREGPT_MAX_PROMPT_LEN = 1024
_SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class Turn:
    """One request of a session: the user's message and the output asked for."""

    prompt: str | list[int]  # text, or token ids (completions endpoint only)
    max_tokens: int
    num_prompt_tokens: int | None = None  # known before sending (token ids), else None: from usage


@dataclass(frozen=True)
class Session:
    """A user: turns sent one after another, each after the previous answer, which joins the
    history (with the system prompt) of the next turn. Single-shot datasets have one turn."""

    turns: tuple[Turn, ...]
    system: str | None = None


@dataclass(frozen=True)
class Dataset:
    sessions: list[Session]
    notes: dict[str, str] = field(default_factory=dict)  # how lengths were found, shortfalls

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


TokenCounter = Callable[[str], int]


def build_dataset(config: DatasetConfig, endpoint: str, count_tokens: TokenCounter | None = None,
                  counter_source: str = "") -> Dataset:
    """The sessions config asks for. endpoint ("completions" or "chat") decides whether random
    prompts are token ids or words; count_tokens measures ShareGPT answers (counter_source names
    how). Raises ValueError for a bad file or a prompt the endpoint cannot take."""
    if config.name == "random":
        return Dataset(random_sessions(config, is_token_ids=endpoint == "completions"))
    if config.name == "multiturn":
        return Dataset(multiturn_sessions(config))
    if config.name == "jsonl":
        return _jsonl_dataset(config, endpoint)
    if count_tokens is None:
        raise ValueError("the sharegpt dataset needs a token counter")
    return _sharegpt_dataset(config, count_tokens, counter_source)


def make_prompts(config: DatasetConfig) -> list[list[int]]:
    """The random dataset's token-id prompts (what the completions endpoint is sent), in order."""
    return [s.turns[0].prompt for s in random_sessions(config, is_token_ids=True)]


def random_sessions(config: DatasetConfig, is_token_ids: bool) -> list[Session]:
    rng = random.Random(config.seed)
    in_low, in_high = length_bounds(config.input_len, config.input_len_range)
    out_low, out_high = length_bounds(config.output_len, config.output_len_range)
    sessions = []
    for _ in range(config.num_requests):
        num_tokens, max_tokens = rng.randint(in_low, in_high), rng.randint(out_low, out_high)
        if is_token_ids:
            ids = [rng.randrange(config.vocab_low, config.vocab_high) for _ in range(num_tokens)]
            turn = Turn(ids, max_tokens, num_tokens)
        else:
            turn = Turn(_words(rng, num_tokens), max_tokens)
        sessions.append(Session((turn,)))
    return sessions


def multiturn_sessions(config: DatasetConfig) -> list[Session]:
    """num_users users (default num_requests // turns) sharing one system prompt, each with
    `turns` user messages of input_len words (drawn from input_len_range when set)."""
    rng = random.Random(config.seed)
    system = _words(rng, config.system_prompt_len)
    num_users = config.num_users or max(1, config.num_requests // config.turns)
    in_low, in_high = length_bounds(config.input_len, config.input_len_range)
    out_low, out_high = length_bounds(config.output_len, config.output_len_range)
    return [Session(tuple(Turn(_words(rng, rng.randint(in_low, in_high)), rng.randint(out_low, out_high))
                          for _ in range(config.turns)), system)
            for _ in range(num_users)]


def _words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def _jsonl_dataset(config: DatasetConfig, endpoint: str) -> Dataset:
    """The file's first num_requests lines, in order: {"prompt": text or token ids, "max_tokens"?}."""
    sessions = []
    for line_idx, line in enumerate(Path(config.path).read_text().splitlines()):
        if len(sessions) == config.num_requests:
            break
        if line.strip():
            sessions.append(Session((_jsonl_turn(json.loads(line), config, endpoint, line_idx + 1),)))
    return Dataset(sessions, _shortfall(config, len(sessions)))


def _jsonl_turn(entry: object, config: DatasetConfig, endpoint: str, line_no: int) -> Turn:
    prompt = entry.get("prompt") if isinstance(entry, dict) else None
    is_ids = isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
    if not (is_ids or (isinstance(prompt, str) and prompt)):
        raise ValueError(f"{config.path}:{line_no}: need a non-empty 'prompt' (text or token ids)")
    if is_ids and endpoint == "chat":
        raise ValueError(f"{config.path}:{line_no}: token-id prompts need --endpoint completions")
    max_tokens = entry.get("max_tokens", config.output_len)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{config.path}:{line_no}: max_tokens must be a positive integer, got {max_tokens!r}")
    return Turn(prompt, max_tokens, len(prompt) if is_ids else None)


def _sharegpt_dataset(config: DatasetConfig, count_tokens: TokenCounter, counter_source: str) -> Dataset:
    """As vLLM's ShareGPT sampling: conversations shuffled with the seed; each one's first human
    turn is the prompt, the gpt turn after it sets max_tokens (its length in tokens); pairs
    shorter than 4 tokens, prompts over 1024 or pairs over 2048 are skipped."""
    pairs = _sharegpt_pairs(json.loads(Path(config.path).read_text()), config.path)
    random.Random(config.seed).shuffle(pairs)
    sessions = []
    for prompt, answer in pairs:
        if len(sessions) == config.num_requests:
            break
        prompt_len = count_tokens(prompt)
        output_len = config.sharegpt_output_len or count_tokens(answer)
        if _is_sharegpt_pair_kept(prompt_len, output_len, config.sharegpt_output_len is not None):
            sessions.append(Session((Turn(prompt, output_len),)))
    source = "--sharegpt-output-len" if config.sharegpt_output_len else counter_source
    return Dataset(sessions, {"output_len_source": source, **_shortfall(config, len(sessions))})


def _sharegpt_pairs(data: object, path: str) -> list[tuple[str, str]]:
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}}")
    pairs = []
    for entry in data:
        turns = entry.get("conversations", []) if isinstance(entry, dict) else []
        roles = [t.get("from") if isinstance(t, dict) else None for t in turns]
        if "human" not in roles:
            continue
        first = roles.index("human")
        if first + 1 < len(turns) and roles[first + 1] == "gpt":
            pairs.append((str(turns[first]["value"]), str(turns[first + 1]["value"])))
    return pairs


def _is_sharegpt_pair_kept(prompt_len: int, output_len: int, is_output_len_fixed: bool) -> bool:
    if prompt_len < _SHAREGPT_MIN_LEN or (output_len < _SHAREGPT_MIN_LEN and not is_output_len_fixed):
        return False
    return prompt_len <= _SHAREGPT_MAX_PROMPT_LEN and prompt_len + output_len <= _SHAREGPT_MAX_TOTAL_LEN


def _shortfall(config: DatasetConfig, num_found: int) -> dict[str, str]:
    if num_found >= config.num_requests:
        return {}
    return {"shortfall": f"{config.path} gave {num_found} usable prompts of the {config.num_requests} asked"}


def warmup_dataset(config: DatasetConfig, endpoint: str, num_requests: int, count_tokens: TokenCounter | None,
                   counter_source: str) -> Dataset:
    """num_requests single-turn requests like the measured ones but drawn with another seed (a
    random prompt warmed up is not then a prefix-cache hit in the measured run)."""
    warm = replace(config, num_requests=num_requests, seed=config.seed + 1, num_users=None,
                   name="random" if config.name == "multiturn" else config.name)
    dataset = build_dataset(warm, endpoint, count_tokens, counter_source)
    return Dataset([Session(s.turns[:1], s.system) for s in dataset.sessions])
