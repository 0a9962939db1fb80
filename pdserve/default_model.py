"""The default model: the `tiny` preset, made on first use under ./models/tiny."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path("models") / "tiny"


def ensure_default_model(model_dir: Path = DEFAULT_MODEL_DIR) -> Path:
    """Return the default model's directory, making it (seconds) if it is missing."""
    if (model_dir / "config.json").exists():
        return model_dir
    from pdserve.make_model import make_model

    logger.info("making the default model in %s", model_dir)
    return Path(make_model(model_dir, "tiny"))
