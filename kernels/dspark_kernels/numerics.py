"""Number formats of V4's caches, encoded bit for bit on any device.

The CUDA kernels round float32 to bfloat16 and to fp8 e4m3 to nearest even (`cvt.rn`), and build
UE8M0 scales from the float32 exponent bits (`cast_to_ue8m0` in SGLang's
`sgl_kernel/deepseek_v4/fp8_utils.cuh`). Triton's interpreter (`TRITON_INTERPRET=1`) does not:
it truncates float32 -> bfloat16 and rounds float32 -> fp8 half away from zero on the cut-off bit
without carrying into the exponent (`_convert_float` in `triton/runtime/interpreter.py`). So the
kernels never cast down to bf16 or fp8; they compute the codes with integer operations on the
float32 bits below, and write the same bytes on a GPU and under the interpreter.

Each Triton helper has a torch twin (`*_torch`) that the references use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_E4M3_MAX = 448.0


@triton.jit
def round_bf16(x):
    """float32 -> float32 holding the nearest-even bfloat16 (NaN not handled)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits(x):
    """float32 -> int16 holding the bits of the nearest-even bfloat16."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def e4m3_bits(x):
    """float32 -> uint8 fp8 e4m3fn code: clip to +-448, round to nearest even (SGLang's `pack_fp8`).

    Normal range: round the float32 mantissa to 3 bits on the integer bits and rebias the exponent
    (127 -> 7); the carry of a rounded-up mantissa lands in the exponent. Below 2^-6 e4m3 is
    subnormal with step 2^-9: scale by 2^9 and round to an integer with the 1.5 * 2^23 trick.
    """
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
    scaled = mag.to(tl.float32, bitcast=True) * 512.0
    subnormal = ((scaled + 12582912.0) - 12582912.0).to(tl.uint32)
    code = tl.where(mag >= 0x3C800000, normal, subnormal)
    return (code | sign).to(tl.uint8)


@triton.jit
def e4m3_value(code):
    """uint8 fp8 e4m3fn code -> float32 (exact; 0x7F / 0xFF NaN codes not handled)."""
    c = code.to(tl.uint32)
    exponent = (c >> 3) & 0xF
    mantissa = c & 0x7
    normal = ((exponent + 120) << 23 | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((c & 0x80) != 0, -value, value)


@triton.jit
def ue8m0_ceil(x):
    """Positive float32 -> UE8M0 exponent byte of the next power of two >= x (`cast_to_ue8m0`)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.uint32)


@triton.jit
def ue8m0_inverse(exponent):
    """UE8M0 exponent byte -> float32 1 / 2^(exponent - 127) (`inv_scale_ue8m0`)."""
    return ((254 - exponent) << 23).to(tl.float32, bitcast=True)


def round_bf16_torch(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float32 holding the nearest-even bfloat16 (torch's own cast)."""
    return x.float().to(torch.bfloat16).float()


def e4m3_bits_torch(x: torch.Tensor) -> torch.Tensor:
    """float32 -> uint8 e4m3fn codes, clipped to +-448 and rounded to nearest even."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_value_torch(code: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn codes -> float32."""
    return code.view(torch.float8_e4m3fn).float()


def ue8m0_ceil_torch(x: torch.Tensor) -> torch.Tensor:
    """Positive float32 -> int32 UE8M0 exponent of the next power of two >= x."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def ue8m0_value_torch(exponent: torch.Tensor) -> torch.Tensor:
    """int32 UE8M0 exponent -> float32 2^(exponent - 127)."""
    return (exponent.to(torch.int32) << 23).view(torch.float32)
