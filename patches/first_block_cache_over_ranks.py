"""Diffusers' first-block cache decides on the whole sequence while a layout splits the tokens.

Target: ``diffusers.hooks.first_block_cache``: ``FBCHeadBlockHook._should_compute_remaining_blocks``, which
compares the first block's residual with the last computed step's by their mean absolute values. Why:
under ulysses, ring or a TP token split each rank holds a slice of the tokens, so the mean of its slice
would let the ranks decide differently (and then wait for each other forever) and differ from one GPU's
decision. While such a forward is in flight the two absolute sums are summed over the ranks that split the
tokens, and their ratio (the ratio of the means, whose common count cancels) is compared with the
threshold: every rank decides alike, on every token, as one GPU does up to float32 summation order. Outside
such a forward the original runs. ``apply`` also lists the cache's hook classes as ones that may run while
the tokens are split (``omni_accel.parallel.sequence_hooks.RANK_AWARE_HOOKS``).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.distributed as dist

from omni_accel.parallel.sequence_hooks import RANK_AWARE_HOOKS, token_groups

PACKAGE = "diffusers"
CHECKED_VERSIONS = ("0.42.0", "0.43.0")
_ORIGINAL = "_omni_accel_original_decision"


def _decision(original):
    @torch.compiler.disable
    def should_compute_remaining_blocks(self, hidden_states_residual: torch.Tensor) -> bool:
        previous = self.state_manager.get_state().head_block_residual
        groups = token_groups()
        if previous is None or groups is None:  # the first step, or no token split: Diffusers' own
            return original(self, hidden_states_residual)
        sums = torch.stack(
            [(hidden_states_residual - previous).abs().float().sum(), previous.abs().float().sum()]
        )
        for group in groups:
            dist.all_reduce(sums, group=group)
        return (sums[0] / sums[1]).item() > self.threshold

    return should_compute_remaining_blocks


def apply(module: ModuleType) -> None:
    head = module.FBCHeadBlockHook
    original = vars(head)["_should_compute_remaining_blocks"]
    setattr(head, _ORIGINAL, original)
    head._should_compute_remaining_blocks = _decision(original)
    RANK_AWARE_HOOKS.update((head, module.FBCBlockHook))


def revert(module: ModuleType) -> None:
    head = module.FBCHeadBlockHook
    head._should_compute_remaining_blocks = vars(head)[_ORIGINAL]
    delattr(head, _ORIGINAL)
    RANK_AWARE_HOOKS.difference_update((head, module.FBCBlockHook))
