"""``AcceleratedTransformer`` (parallel layouts only, until they move onto native blocks): stands where the
Diffusers transformer stood and runs the legacy native module.

It is a Diffusers ``ModelMixin`` so pipelines keep treating it as their transformer: ``config``, ``dtype``,
``device``, ``cache_context``, ``save_pretrained`` (which writes the original Diffusers layout) and the
call signature are the original's. The original module is kept on the meta device (its weights now live in
the native module, so acceleration costs no extra memory) and is rebuilt exactly by ``to_diffusers``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from .parallel.cfg import CfgParallel
from .weights import export_weights


class AcceleratedTransformer(ModelMixin):
    def __init__(
        self,
        native: nn.Module,
        original: nn.Module,
        source_names: list[str],
        output_class: type,
        cfg: CfgParallel | None = None,
    ) -> None:
        super().__init__()
        self.native = native
        # Not registered as a submodule: it holds no weights (meta) and must not follow .to() or state_dict().
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_source_names", source_names)
        object.__setattr__(self, "_output_class", output_class)
        object.__setattr__(self, "_extra_buffers", _non_persistent_buffers(original))
        object.__setattr__(self, "cfg", cfg)
        object.__setattr__(self, "_arg_names", list(inspect.signature(native.forward).parameters))

    @property
    def config(self):
        return self._original.config

    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs: Any) -> Iterator[None]:
        """Pipelines mark their cond/uncond calls with this; CFG parallelism uses it to pair them."""
        if self.cfg is None:
            yield
            return
        previous, self.cfg.branch = self.cfg.branch, name
        try:
            yield
        finally:
            self.cfg.branch = previous

    def forward(self, *args: Any, return_dict: bool = True, **kwargs: Any):
        kwargs.update(zip(self._arg_names, args, strict=False))
        if self.cfg is None:
            sample = self.native(**kwargs)
        else:
            sample = self.cfg.run(self.native, kwargs, self.native.output_like)
        return self._output_class(sample=sample) if return_dict else (sample,)

    def to_diffusers(self) -> nn.Module:
        """A fresh Diffusers module with this model's current weights, on its current device and dtype."""
        module = copy.deepcopy(self._original)
        state = export_weights(self.native, self._source_names, self.native.weight_map)
        module.load_state_dict(state, strict=True, assign=True)
        for name, buffer in self._extra_buffers.items():
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner).register_buffer(leaf, buffer.to(self.device), persistent=False)
        return module.eval()

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        """Writes the original Diffusers layout, loadable by Diffusers without omni_accel."""
        self.to_diffusers().save_pretrained(save_directory, **kwargs)

    # Diffusers model methods whose effect the native model provides differently: say how, instead of
    # letting ModelMixin's versions silently find nothing to act on.
    def set_attention_backend(self, backend: str) -> None:
        raise NotImplementedError(
            "This transformer is accelerated by omni_accel: choose its attention kernel with "
            "omni_accel.accelerate(pipe, attention=...) or `with omni_accel.attention_scope(default=...)`."
        )

    def compile_repeated_blocks(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "This transformer is accelerated by omni_accel: compile its native blocks with "
            "omni_accel.accelerate(pipe, compile=True) (after omni_accel.restore(pipe) if already accelerated)."
        )

    def enable_parallelism(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "This transformer is accelerated by omni_accel: spread it over GPUs with "
            "omni_accel.accelerate(pipe, parallel=omni_accel.ParallelConfig(...)) under torchrun."
        )

    def extra_repr(self) -> str:
        return f"original={type(self._original).__name__}"


def _non_persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    persistent = set(module.state_dict())
    return {name: b for name, b in module.named_buffers() if name not in persistent}
