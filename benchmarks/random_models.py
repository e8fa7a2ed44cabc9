"""Models with random weights for the benchmarks (no hub): configs of the released architectures, and the
randomizer every benchmark uses."""

from __future__ import annotations

import torch

WAN_14B = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40)


def randomized(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights in ``dtype``, keeping in float32 what Diffusers' from_pretrained keeps there."""
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    model.to(dtype)
    for name, module in model.named_modules():
        if any(keep in name.split(".") for keep in model._keep_in_fp32_modules or ()):
            module.float()
    return model.eval()
