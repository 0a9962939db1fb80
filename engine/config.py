"""Engine configuration: one frozen dataclass per concern, composed by EngineConfig."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.protocol import DTYPE_CHOICES, Role
from engine.tp_shard import check_tensor_parallel
from kernels.select import BACKENDS as KERNEL_BACKENDS

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DECODE_GRAPH_MODES = ("auto", "off", "static")  # EngineConfig.decode_graphs
DEFAULT_DTYPE = "float32"  # greedy output equals transformers' token for token in float32


def resolve_dtype(dtype: str | None, device: str, model_dir: str | Path) -> str:
    """The dtype to run in: dtype as given, or for "auto" (and None) float32 on the CPU (the
    dtype that equals transformers token for token) and on CUDA the checkpoint's own bfloat16 or
    float16, bfloat16 for a float32 checkpoint (float16 on a GPU without bfloat16). Raises
    ValueError for an unknown name."""
    if dtype not in (None, "auto"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
        return dtype
    if torch.device(device).type != "cuda":
        return DEFAULT_DTYPE
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    saved = hf.get("dtype") or hf.get("torch_dtype")  # transformers 5 writes dtype, 4 torch_dtype
    if saved in ("bfloat16", "float16"):
        return saved
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def resolve_device(device: str) -> str:
    """"auto": CUDA when available, else the CPU; any other name as given. Raises ValueError
    (one line, for the user) for a CUDA device this torch cannot use, or a name torch does not know."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a device name (cpu, cuda, cuda:N, or auto)") from None
    if kind.type == "cuda":
        if not torch.cuda.is_available():
            build = ("a CPU-only build" if torch.version.cuda is None
                     else f"built for CUDA {torch.version.cuda}, but no GPU is visible")
            raise ValueError(f"device {device!r}: this torch ({torch.__version__}) is {build}; use --device cpu, "
                             "or a machine and torch build with CUDA")
        if kind.index is not None and kind.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s) are visible")
    return device


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, read from a Hugging Face checkpoint's config.json."""

    model_dir: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    has_qkv_bias: bool
    has_o_bias: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if not 0 < self.max_model_len <= self.max_position_embeddings:
            raise ValueError(
                f"max_model_len must be in (0, {self.max_position_embeddings}], got {self.max_model_len}"
            )

    @property
    def name(self) -> str:
        return Path(self.model_dir).name

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, dtype: str = DEFAULT_DTYPE, max_model_len: int | None = None
    ) -> ModelConfig:
        """Read config.json (and generation_config.json for eos ids). Raises ValueError for an
        unsupported architecture or dtype, FileNotFoundError for a missing config."""
        model_dir = Path(model_dir)
        hf = json.loads((model_dir / "config.json").read_text())
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        architecture = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope = _rope_parameters(hf)
        max_pos = hf.get("max_position_embeddings", 2048)
        max_pos = _capped_by_sliding_window(hf, max_pos)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_dir=str(model_dir),
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.pop("rope_theta"),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            max_position_embeddings=max_pos,
            max_model_len=max_model_len or max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            has_qkv_bias=is_qwen2 or attention_bias,
            has_o_bias=attention_bias and not is_qwen2,
            dtype=DTYPES[dtype],
            eos_token_ids=_eos_token_ids(model_dir, hf),
            bos_token_id=hf.get("bos_token_id"),
        )


def _rope_parameters(hf: dict) -> dict:
    """transformers 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", "default")
    return rope


def _capped_by_sliding_window(hf: dict, max_pos: int) -> int:
    # NOTE: no sliding-window attention here; capping the context at the window keeps Mistral
    # and Qwen2 checkpoints that use one exact instead of silently wrong past the window.
    window = hf.get("sliding_window")
    if window and hf.get("use_sliding_window", True):
        return min(max_pos, window)
    return max_pos


def _eos_token_ids(model_dir: Path, hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_cache_memory_bytes or free memory
    kv_cache_memory_bytes: int | None = None
    # On a GPU without an explicit budget: the share of the GPU's memory this engine may hold in
    # all (weights, KV cache, activations, graphs); several engines on one GPU split it this way.
    gpu_memory_utilization: float = 0.9
    # A CPU cache's pages faulted in (zeroed) at start-up, not by the steps that first write them
    # (kv_cache.allocate_kv_cache); off where a start must be quick (a node restarted from a
    # standby process), which then takes memory as its blocks are first used.
    prefault: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    seed: int = 0
    role: Role = Role.COLOCATED  # PREFILL: each request stops after its first token (see Role)
    # Reuse the KV of cached full blocks across requests with a common prefix (engine.block_pool).
    enable_prefix_caching: bool = True
    # The compute backend (kernels/select.py): auto (Triton on CUDA, the compiled CPU kernels on the
    # CPU), cpu, triton or reference (plain torch, the test oracle).
    kernel_backend: str = "auto"
    # Decode steps on static buffers (engine.decode_graphs): auto (CUDA graphs on CUDA for engines
    # that decode, none elsewhere), off (every step eager: --enforce-eager), or static (the same
    # buffers and padding without graphs, on any device: the CPU tests of that logic).
    decode_graphs: str = "auto"
    # Steps with prompt tokens, up to this many tokens in all, as CUDA graph pieces between their
    # attentions (engine.mixed_graphs); 0: eager. Follows decode_graphs: captured where it is auto
    # (on CUDA), the same buffers run eagerly where it is static, none where it is off.
    mixed_graph_tokens: int = 512
    # While the GPU runs a decode step on the static buffers, queue the next one before reading
    # this one's tokens (LLMEngine.step); pure decode steps of requests sampled on the device only
    # (greedy or drawn: sampler.samples_on_device).
    async_scheduling: bool = True
    # Ranks the model is split over (engine.tp_ranks): one process each, one GPU each on CUDA.
    tensor_parallel_size: int = 1
    # A node's engine: a worker rank lost and not noticed by a step within LOST_RANK_GRACE_S (NCCL
    # waits on a dead peer until its watchdog; an idle engine would notice at its next request)
    # ends this process (exit 1, for its supervisor to restart). Else the next step raises.
    lost_rank_ends_process: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise ValueError(f"role must be a Role, got {self.role!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {', '.join(KERNEL_BACKENDS)}, got {self.kernel_backend!r}")
        check_tensor_parallel(self.model, self.tensor_parallel_size)
        if self.mixed_graph_tokens < 0:
            raise ValueError(f"mixed_graph_tokens must be >= 0, got {self.mixed_graph_tokens}")
        if self.decode_graphs not in DECODE_GRAPH_MODES:
            raise ValueError(f"decode_graphs must be one of {', '.join(DECODE_GRAPH_MODES)}, "
                             f"got {self.decode_graphs!r}")
