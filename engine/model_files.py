"""A model directory checked up front, before anything is loaded (torch-free, so the proxy uses it
too): each missing piece named, and what to do, in one ValueError a command prints as one line."""

from __future__ import annotations

from pathlib import Path


def download_hint(name: str = "ORG/NAME") -> str:
    """The line that says how to get a model: pdserve never downloads one."""
    return (f"pdserve does not download models: fetch it with `huggingface-cli download {name} --local-dir DIR` "
            "(or make one with `pdserve make-model DIR --preset ...`) and pass --model DIR")


def check_model_dir(model_dir: str | Path, weights: bool = True, tokenizer: bool = True) -> Path:
    """model_dir as a Path once it holds config.json, and where asked safetensors weights and a
    tokenizer.json; else ValueError naming the directory, what is missing and what to do."""
    path, text = Path(model_dir), str(model_dir)
    if not path.exists():
        is_hub_id = len(path.parts) == 2 and not text.startswith(("/", "."))  # ORG/NAME, as the hub names them
        raise ValueError(f"model directory {text!r} does not exist. {download_hint(text if is_hub_id else 'ORG/NAME')}")
    if not path.is_dir():
        raise ValueError(f"--model {text!r} is a file; it must be a checkpoint directory (config.json, "
                         "*.safetensors, tokenizer.json)")
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    if weights and not any(path.glob("*.safetensors")):
        bins = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.gguf"))
        missing.append("*.safetensors weights" + (f" (it has {', '.join(bins[:3])}: pdserve reads safetensors only)"
                                                  if bins else ""))
    if tokenizer and not (path / "tokenizer.json").is_file():
        others = [name for name in ("tokenizer.model", "vocab.json", "spiece.model") if (path / name).is_file()]
        missing.append("tokenizer.json" + (f" (it has {', '.join(others)}: pdserve needs the fast tokenizer's "
                                           "tokenizer.json)" if others else ""))
    if missing:
        raise ValueError(f"model directory {text!r} has no {', no '.join(missing)}. {download_hint()}")
    return path
