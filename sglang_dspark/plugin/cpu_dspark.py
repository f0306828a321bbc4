"""Let SGLang's DSPARK worker run on a CPU device (the embedded default).

Upstream 0.5.23 gates DSPARK to CUDA/NPU/XPU and assumes a CUDA stream and a GPU draft
attention backend. Each function below closes one of those gaps and is a named hook:

- `dspark_cpu_device_gate`: `_handle_dspark` raises for `--device cpu`; we let resolution see
  the CPU device as an accelerator for that one check and nothing else.
- `torch_native_draft_backend`: `torch_native` is missing from the draft attention backend
  allow-list, so resolution falls back to flashinfer, which cannot run on CPU.
- `cpu_record_stream_noop`: the worker calls `Tensor.record_stream` on CPU tensors, which torch
  rejects; stream bookkeeping has no meaning for CPU memory.
- `cpu_bf16_draft_kernels`: in bf16 the draft takes two Triton-only fast paths that have no CPU
  driver: the injected-context KV write (`fused_kv_norm_rope_write`) and the q/k norm + rope
  (`table_qk_norm_rope_`). On CPU we decline both so the draft runs its own torch code, which
  is what fp16 already does.
"""

from __future__ import annotations

import functools

import torch

from sglang_dspark.plugin.registry import applied_check, register_after, register_around


class _AcceleratorView:
    """A resolving view whose `device` reads "cuda" when the real device is the CPU."""

    def __init__(self, view):
        self._view = view

    def __getattr__(self, name):
        value = getattr(self._view, name)
        if name == "device" and isinstance(value, str) and value.startswith("cpu"):
            return "cuda"
        return value


def _handle_dspark_on_cpu(original, server_args):
    import sglang.srt.arg_groups.speculative_hook as hook_module

    real_view = hook_module.resolving_view
    if not str(real_view(server_args).device).startswith("cpu"):
        return original(server_args)
    hook_module.resolving_view = lambda args: _AcceleratorView(real_view(args))
    try:
        return original(server_args)
    finally:
        hook_module.resolving_view = real_view


def install_device_gate() -> None:
    register_around("sglang.srt.arg_groups.speculative_hook._handle_dspark", _handle_dspark_on_cpu)


@applied_check("torch_native_draft_backend")
def _draft_backend_applied() -> str | None:
    from sglang.srt.arg_groups import choices

    if "torch_native" not in choices.DRAFT_ATTENTION_BACKEND_CHOICES:
        return "torch_native is still missing from DRAFT_ATTENTION_BACKEND_CHOICES"
    return None


def install_torch_native_draft_backend() -> None:
    from sglang.srt.arg_groups import choices

    if "torch_native" not in choices.DRAFT_ATTENTION_BACKEND_CHOICES:
        choices.add_draft_attention_backend_choices(["torch_native"])


_original_record_stream = torch.Tensor.record_stream


@functools.wraps(_original_record_stream)
def _record_stream(self, stream):
    if self.device.type == "cpu":
        return None
    return _original_record_stream(self, stream)


@applied_check("cpu_record_stream_noop")
def _record_stream_applied() -> str | None:
    if torch.Tensor.record_stream is not _record_stream:
        return "torch.Tensor.record_stream is not the CPU no-op"
    return None


def install_record_stream_noop() -> None:
    if torch.Tensor.record_stream is not _record_stream:
        torch.Tensor.record_stream = _record_stream


def _fused_kv_write_bundle(original, model, pool):
    if next(model.parameters()).device.type == "cpu":
        return None
    return original(model, pool)


def _no_table_qk_norm_rope(result, attention, *args, **kwargs):
    from sglang.srt.utils import is_cpu

    if is_cpu():
        attention.use_table_qk_norm_rope = False


def install_cpu_bf16_draft_kernels() -> None:
    register_around(
        "sglang.srt.models.dspark.DSparkDraftMixin._fused_kv_write_bundle", _fused_kv_write_bundle
    )
    register_after("sglang.srt.models.dflash.DFlashAttention.__init__", _no_table_qk_norm_rope)


HOOKS = {
    "dspark_cpu_device_gate": install_device_gate,
    "torch_native_draft_backend": install_torch_native_draft_backend,
    "cpu_record_stream_noop": install_record_stream_noop,
    "cpu_bf16_draft_kernels": install_cpu_bf16_draft_kernels,
}
