"""Models made on first use: the default (the `tiny` preset under ./models/tiny) and any preset."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path("models") / "tiny"


def ensure_default_model(model_dir: Path = DEFAULT_MODEL_DIR) -> Path:
    """Return the default model's directory, making it (seconds) if it is missing."""
    return ensure_model(model_dir, "tiny")


def ensure_model(model_dir: Path, preset: str) -> Path:
    """Return model_dir, first writing the preset's random-weight checkpoint there if it has
    none (pdserve make-model)."""
    if (model_dir / "config.json").exists():
        return model_dir
    from pdserve.make_model import make_model

    logger.info("making the %s model in %s", preset, model_dir)
    return Path(make_model(model_dir, preset))
