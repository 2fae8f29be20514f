"""How close served FP8 weights must be to the BF16 tensors a trainer sent (``weights.quantized_reload``).

An engine that quantizes online (vLLM's and SGLang's ``quantization="fp8"`` on a BF16 checkpoint)
serves each linear layer's weight as FP8 E4M3 codes times a scale (one per tensor, per output
row, or per block). Bit-exact checksums of those kernels against the sent tensors cannot hold,
so an update is verified here by bounding the difference instead: round-to-nearest E4M3 of
``w / scale`` is off by at most half a unit in the last place (3 mantissa bits; below the smallest
normal, 2**-6, the step is fixed at 2**-9), times ``scale``. A weight read back through the
layer's kernel (as the backends do) is also rounded once more to the output dtype (bf16: a
relative 2**-8 at most).

A tensor within the bound is what the engine's quantization of the sent tensor gives (up to the
last rounding); a stale tensor (an update not served) or another tensor exceeds it almost
everywhere. torch is imported inside the functions (the core imports no heavy module at import
time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch

#: mantissa bits of FP8 E4M3 (torch.float8_e4m3fn)
E4M3_MANTISSA_BITS = 3
#: exponent of E4M3's smallest normal number; below it the spacing is 2**(-6 - 3)
E4M3_MIN_NORMAL_EXPONENT = -6
#: the largest finite E4M3 value
E4M3_MAX = 448.0
#: relative rounding of a bf16 result (8 significant bits, round to nearest)
BF16_ROUNDING = 2.0**-8
#: float32 arithmetic inside the engine's quantizer (``w * (1/scale)`` vs ``w / scale``) may pick the
#: other neighbour at a tie; this slack keeps such ties within the bound
RATIO_SLACK = 1e-3


def e4m3_rounding_bound(sent: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Elementwise largest ``|dequantized - sent|`` of round-to-nearest E4M3 quantization of
    ``sent / scale`` (``scale`` broadcast against ``sent``; the dequantized value is ``code * scale``)."""
    import torch

    scale_t = torch.as_tensor(scale, dtype=torch.float32, device=sent.device)
    x = sent.float().abs() / scale_t
    floor = 2.0**E4M3_MIN_NORMAL_EXPONENT
    exponent = torch.floor(torch.log2(x.clamp_min(floor)))
    ulp = torch.exp2(exponent - E4M3_MANTISSA_BITS)
    return 0.5 * ulp * scale_t


@attrs.frozen
class QuantizedMatch:
    """How far a served, dequantized tensor is from the sent one, relative to FP8's rounding.

    ``ratio``: the largest ``|served - sent| / bound`` over the elements (<= 1 + slack: within
    FP8's rounding); ``max_abs_error``: the largest ``|served - sent|``.
    """

    ratio: float
    max_abs_error: float

    @property
    def ok(self) -> bool:
        """Whether every element is within the rounding bound."""
        return self.ratio <= 1.0 + RATIO_SLACK


def match_quantized(
    sent: torch.Tensor,
    served: torch.Tensor,
    scale: torch.Tensor | float,
    output_rounding: float = BF16_ROUNDING,
) -> QuantizedMatch:
    """Compare ``served`` (the dequantized weight the engine computes with, same shape as
    ``sent``) with ``sent`` under E4M3 rounding with ``scale`` plus a relative ``output_rounding``
    of the read-back value (0 where it was dequantized in float32)."""
    import torch

    sent_f = sent.float()
    served_f = served.float().to(sent_f.device)
    error = (served_f - sent_f).abs()
    bound = e4m3_rounding_bound(sent_f, scale) + output_rounding * served_f.abs()
    tiny = torch.finfo(torch.float32).tiny
    ratio = float((error / bound.clamp_min(tiny)).max()) if error.numel() else 0.0
    return QuantizedMatch(ratio=ratio, max_abs_error=float(error.max()) if error.numel() else 0.0)


def scale_grid(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A layer's weight scale as a tensor that broadcasts against its ``[rows, cols]`` weight: one
    scale (per tensor), one per row (per channel), or one per block (a ``[ceil(rows/b),
    ceil(cols/b)]`` grid, ``b`` a power of two). Anything else is summarised by its largest value, which only widens
    the bound (the subnormal spacing grows with the scale; the normal one does not depend on it)."""
    import torch

    flat = scale.detach().float().reshape(-1)
    if flat.numel() == 1:
        return flat.reshape(1, 1)
    if flat.numel() == rows:
        return flat.reshape(rows, 1)
    if scale.dim() == 2:
        block_rows, block_cols = _block(rows, int(scale.shape[0])), _block(cols, int(scale.shape[1]))
        if block_rows and block_cols:
            grid = scale.detach().float().repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
            return grid[:rows, :cols]
    return torch.full((1, 1), float(flat.max()), device=flat.device)


def _block(size: int, blocks: int) -> int:
    """The power-of-two block edge (128 in DeepSeek's and vLLM's block FP8) that cuts ``size`` into
    ``blocks`` blocks, the last one possibly short; 0 if there is none."""
    edge = 1
    while edge * blocks < size:
        edge *= 2
    return edge if -(-size // edge) == blocks else 0
