"""Child process for tests/test_tiny_v4.py: SGLang 0.5.23 loads a DeepSeek-V4 checkpoint on CPU.

    python tests/v4_sglang_load.py CHECKPOINT_DIR...   # one JSON line: {dir: report}

For the target (``DeepseekV4ForCausalLM``) and, when the config bundles one, the DSpark draft
(``DeepseekV4ForCausalLMDSpark``, the architecture SGLang's ``ModelConfig`` picks for a draft
of a V4 checkpoint with ``dspark_*`` keys): build the model as SGLang's ``DefaultModelLoader``
does (``ModelConfig`` from the directory, the model dtype as default dtype, CPU device), fill
every parameter with a sentinel (NaN, -1 for integers), then run SGLang's own weight iterator
and ``load_weights``. The report lists the parameters still holding the sentinel, the
checkpoint tensors the loader read, the warnings it logged ("not found in params_dict",
"unexpected weight", "not initialized from checkpoints") and dtype differences.

Set-up SGLang needs on CPU (``_ENV`` is set here, before sglang is imported): a one-process
gloo group and ``publish_build_topology(device="cpu")``; ``SGLANG_USE_CPU_ENGINE=1`` (else
RotaryEmbedding imports vllm's kernel); ``SGLANG_OPT_USE_TILELANG_MHC_PRE=0`` (else the
target's ``load_weights`` ends in ``_prewarm_mhc_kernels``, which queries CUDA devices);
``SGLANG_RAGGED_VERIFY_MODE=compact`` (in the default ``static`` mode the draft builds no
confidence head and skips its tensors). And one shim: ``MQALayer`` asks for a
RoPE with ``rope_scaling=None`` on sliding-window layers (deepseek_v4.py, ``active_rope_scaling``)
and ``get_rope_cpu`` asserts on that (rotary_embedding/factory.py), so here a None scaling
becomes YaRN with factor 1, which is plain RoPE. That module holds no parameters.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys

_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_OPT_USE_TILELANG_MHC_PRE": "0",
    "SGLANG_RAGGED_VERIFY_MODE": "compact",
}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("sglang.srt.model") or "weight" in record.getMessage():
            self.messages.append(f"{record.name}: {record.getMessage()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_up_cpu() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.layers.rotary_embedding import factory
    from sglang.test.test_utils import publish_build_topology

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    publish_build_topology(tp_size=1, ep_size=1, pp_size=1, device="cpu")
    initialize_model_parallel(backend="gloo")

    get_rope_cpu = factory.get_rope_cpu

    def plain_rope_as_yarn(head_size, rotary_dim, max_position, base, is_neox_style=True,
                           rope_scaling=None, *args, **kwargs):  # fmt: skip
        if rope_scaling is None:
            rope_scaling = {"rope_type": "deepseek_yarn", "factor": 1.0,
                            "original_max_position_embeddings": max_position}  # fmt: skip
        return get_rope_cpu(head_size, rotary_dim, max_position, base, is_neox_style,
                            rope_scaling, *args, **kwargs)  # fmt: skip

    factory.get_rope_cpu = plain_rope_as_yarn


def _load(checkpoint: str, *, draft: bool) -> dict:
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    model_config = ModelConfig(
        model_path=checkpoint,
        is_draft_model=draft,
        speculative_algorithm="DSPARK" if draft else None,
    )
    loader = DefaultModelLoader(LoadConfig())
    cpu = torch.device("cpu")
    with set_default_torch_dtype(model_config.dtype), cpu:
        model = _initialize_model(model_config, loader.load_config, None)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan") if p.is_floating_point() else -1)

    read: dict[str, tuple[list[int], str]] = {}

    def tap(weights):
        for name, tensor in weights:
            read[name] = (list(tensor.shape), str(tensor.dtype).removeprefix("torch."))
            yield name, tensor

    handler = _Warnings()
    logging.getLogger().addHandler(handler)
    try:
        with set_default_torch_dtype(model_config.dtype):
            DefaultModelLoader.load_weights_only(
                model, tap(loader._get_all_weights(model_config, model)), cpu
            )
    finally:
        logging.getLogger().removeHandler(handler)

    def untouched(p) -> bool:
        return bool(p.isnan().any() if p.is_floating_point() else (p == -1).any())

    remap = (
        model._remap_dspark_weight_name
        if draft
        else lambda n: type(model).remap_weight_name_to_dpsk_hf_format(n)
    )
    dtype_checked, dtype_mismatch = 0, []
    for name, (shape, dtype) in read.items():
        mapped = remap(name)
        p = params.get(mapped) if mapped else None
        if p is None or list(p.shape) != shape:
            continue  # fused (wqkv_a, wkv_gate, w13, gate_up_proj) or not this model's tensor
        dtype_checked += 1
        if str(p.dtype).removeprefix("torch.") != dtype:
            dtype_mismatch.append(f"{name}: checkpoint {dtype}, {mapped} {p.dtype}")
    with set_default_torch_dtype(model_config.dtype):
        DefaultModelLoader.postprocess_weights(model, cpu)
    return {
        "architecture": type(model).__name__,
        "params": {
            n: [list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in params.items()
        },
        "untouched": sorted(n for n, p in params.items() if untouched(p)),
        "read": read,
        "warnings": handler.messages,
        "dtype_checked": dtype_checked,
        "dtype_mismatch": dtype_mismatch,
    }


def main(checkpoints: list[str]) -> None:
    os.environ.update(_ENV)
    _set_up_cpu()
    from sglang.srt.speculative.dspark_components.dspark_config import (
        checkpoint_bundles_dspark_draft,
    )

    reports = {}
    for checkpoint in checkpoints:
        report = {"target": _load(checkpoint, draft=False)}
        with open(os.path.join(checkpoint, "config.json")) as f:
            if checkpoint_bundles_dspark_draft(json.load(f)):
                report["draft"] = _load(checkpoint, draft=True)
        reports[checkpoint] = report
    print(json.dumps(reports))


if __name__ == "__main__":
    main(sys.argv[1:])
