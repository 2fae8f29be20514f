"""The FP8 rounding bound that verifies what an online-quantized engine serves
(rlinfer_core.quantized, capability weights.quantized_reload), against torch's own E4M3 cast."""

from __future__ import annotations

import pytest
import torch

from rlinfer_core.quantized import E4M3_MAX, e4m3_rounding_bound, match_quantized, scale_grid


def quantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an engine's FP8 quantizer serves: E4M3 codes of weight / scale, times scale."""
    return (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def weights(seed: int, rows: int = 64, cols: int = 96, std: float = 0.02) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * std
    w[0, :8] = torch.tensor([0.0, 1e-9, -1e-7, 3e-6, 2.0**-20, 5 * std, -5 * std, 1e-4])  # subnormals, extremes
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("std", [1e-3, 0.02, 1.0])
def test_per_tensor_quantization_is_within_the_bound(std: float) -> None:
    sent = weights(0, std=std)
    scale = sent.float().abs().max() / E4M3_MAX
    served = quantize(sent, scale)
    match = match_quantized(sent, served, scale, output_rounding=0.0)
    assert match.ok and 0.5 < match.ratio <= 1.0  # round to nearest reaches half a step somewhere
    # read back through a bf16 kernel output: one more rounding, covered by the default term
    assert match_quantized(sent, served.to(torch.bfloat16), scale).ok


def test_per_row_scales_and_their_layouts() -> None:
    sent = weights(1)
    row_scale = sent.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX  # [rows, 1]
    served = quantize(sent, row_scale)
    for layout in (row_scale, row_scale.t().contiguous(), row_scale.reshape(-1)):  # SGLang keeps [1, rows]
        grid = scale_grid(layout, *sent.shape)
        assert grid.shape == (sent.shape[0], 1)
        assert match_quantized(sent, served, grid, output_rounding=0.0).ok


def test_block_scales() -> None:
    sent = weights(2, rows=200, cols=260)
    blocks = torch.rand(2, 3) / 100 + 1e-4  # 128 x 128 blocks over [200, 260]
    grid = scale_grid(blocks, 200, 260)
    assert grid.shape == (200, 260) and grid[127, 255] == blocks[0, 1] and grid[199, 259] == blocks[1, 2]
    assert match_quantized(sent, quantize(sent, grid), grid, output_rounding=0.0).ok


def test_an_unserved_update_or_a_wrong_scale_fails() -> None:
    old, new = weights(3), weights(4)
    scale = new.float().abs().max() / E4M3_MAX
    stale = quantize(old, old.float().abs().max() / E4M3_MAX)  # the engine still serves the old weights
    assert not match_quantized(new, stale, scale).ok
    off_by_one_step = quantize(new, scale) + 2 * e4m3_rounding_bound(new, scale).max()
    assert not match_quantized(new, off_by_one_step, scale).ok
    assert match_quantized(new, new, scale).ratio == 0.0


def test_the_bound_is_half_a_step() -> None:
    scale = torch.tensor(1.0)
    values = torch.tensor([1.0, 1.5, 300.0, 2.0**-6, 2.0**-8, 0.0])
    # E4M3 spacing: 2**-3 in [1, 2), 2**5 in [256, 448], 2**-9 below 2**-6
    expected = torch.tensor([2.0**-4, 2.0**-4, 2.0**4, 2.0**-10, 2.0**-10, 2.0**-10])
    assert torch.equal(e4m3_rounding_bound(values, scale), expected)
