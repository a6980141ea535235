"""BF16 tensors that exercise every corner of the compression format (shared with the kernel tests)."""

from __future__ import annotations

import torch


def _special_values() -> torch.Tensor:
    values = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -3e-39, 9e-41, 3.0e38, -1.0]
    bits = torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)
    signalling = torch.tensor([0x7F81, -0x7F, 0x0001, -0x8000], dtype=torch.int16).view(torch.bfloat16)  # odd NaN, -NaN, tiny denormal, -0
    return torch.cat([bits, signalling]).repeat(40)


def _many_exponents(escape_everywhere: bool) -> torch.Tensor:
    """More than 16 distinct exponents: in every group (all escape), or confined to a few groups."""
    generator = torch.Generator().manual_seed(3)
    if escape_everywhere:
        return torch.exp2(torch.randint(-60, 60, (4096,), generator=generator).float()).to(torch.bfloat16)
    values = torch.randn(4096, generator=generator) * 0.02
    values[100:140] = torch.exp2(torch.arange(-70, -30).float())   # 40 rare exponents inside groups 1 and 2
    return values.to(torch.bfloat16)


def cases() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def normal(*shape, std):
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    return {
        "normal-0.02": normal(96, 200, std=0.02),
        "normal-1.0": normal(128, 130, std=1.0),
        "all-zero": torch.zeros(4000, dtype=torch.bfloat16),
        "one-value": torch.full((33, 77), -2.5, dtype=torch.bfloat16),
        "inf-nan-denormal": _special_values(),
        "escapes-everywhere": _many_exponents(True),
        "escapes-some": _many_exponents(False),
        "short-rows": normal(100, 7, std=0.05),          # rows far shorter than a 64-element group
        "odd-shape": normal(3, 5, 67, std=0.3),           # 1005 elements: not a multiple of group or chunk
        "tiny": normal(13, std=0.1),
        "one-element": normal(1, std=1.0),
    }
