"""peft merges a LoRA adapter into a tensor-parallel linear as this rank's slice of the delta.

Target: ``peft.tuners.lora.layer.Linear.get_delta_weight``. Why: ``fuse_lora``/``unfuse_lora`` (peft's
``merge``/``unmerge``) add the full ``B @ A * scale`` to the base weight, which under tensor parallelism
holds this rank's slice only. For a linear split by ``parallel.tensor`` the delta is cut the way its weight
was (the full delta is computed, then sliced, so the merged values are bit for bit those of one rank);
every other linear gets peft's own result, and so does one whose adapter was split with it (the generic
tier's ``AdaptersSplit``: its delta is this rank's slice already).
"""

from __future__ import annotations

import functools
from types import ModuleType

from . import ours

PACKAGE = "peft"
CHECKED_VERSIONS = ("0.21.0", "0.22.0")
_ORIGINAL = "_omni_accel_original_get_delta_weight"


def apply(module: ModuleType) -> None:
    linear = module.Linear
    original = linear.get_delta_weight

    @functools.wraps(original)
    def get_delta_weight(self, adapter):
        delta = original(self, adapter)
        shard = getattr(self.get_base_layer(), "omni_tp", None)
        if shard is None or delta.shape == self.get_base_layer().weight.shape:
            return delta
        return shard.take(delta, shard.dim).contiguous()

    setattr(linear, _ORIGINAL, original)
    linear.get_delta_weight = ours(get_delta_weight, original)


def revert(module: ModuleType) -> None:
    linear = module.Linear
    linear.get_delta_weight = getattr(linear, _ORIGINAL)
    delattr(linear, _ORIGINAL)
