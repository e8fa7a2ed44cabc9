"""``AccelConfig``: everything ``accelerate`` can be told, validated before anything is touched."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .attention.selection import AttentionConfig, check_forms
from .parallel.config import ParallelConfig

# The pipeline attributes that hold denoisers in Diffusers' pipelines (Wan 2.2 has two experts); the
# default skips an absent one, a name given explicitly must be there (see ``api.entry.denoiser_names``).
DEFAULT_COMPONENTS = ("transformer", "transformer_2", "transformer_ref")
# The lossy modes ``quantize`` takes (None: none).
QUANTIZATIONS = (None, "fp8")
# The exact projection cache's budget per transformer where the user names none.
DEFAULT_PROJECTION_CACHE_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class AccelConfig:
    """Every option of ``accelerate``.

    ``attention``: which provider serves which role. ``native``: swap in native transformers where one
    exists (False keeps Diffusers' modules and only routes their attention). ``projection_cache_bytes``:
    budget of the exact projection cache per transformer (0 turns it off); None (the default):
    ``DEFAULT_PROJECTION_CACHE_BYTES``, except on a native model whose cache was measured not to pay
    (``NativeModel.projection_cache_unpaid``; the report says why), where an explicit budget turns it on. ``parallel``: how the
    transformer spreads over the ranks of a torchrun launch (``"auto"``: chosen for the model, the number
    of ranks and the pipeline's first call; see ``omni_accel.parallel.auto``). ``compile``:
    ``torch.compile`` the repeated blocks (True, or a dict of ``torch.compile`` keyword arguments; False:
    never); None (the default) compiles those of a transformer without native blocks (the generic tier,
    ``omni_accel.models.generic``) where they run on CUDA, and leaves native blocks eager (their fused
    kernels are the fast path) except a model's whose blocks leave elementwise steps to the compiler
    (``NativeModel.compiled_by_default``). ``compile_in_background``: True compiles each block function in a thread while its calls run eagerly
    (see ``omni_accel.models.compiler``), so the first image need not wait; False (the default): the first
    call per input shape waits for the compile. Not the default because torch.compile restores process-wide
    state it saved when it started (torch's CPU and CUDA random state, the deterministic-algorithms flag, the
    default dtype, the matmul precision): what another thread set meanwhile (``torch.manual_seed`` before
    building a model or calling a pipeline without a generator) is silently undone. ``cuda_graphs``: capture each distinct transformer step as a CUDA graph and
    replay it (see ``omni_accel.cuda_graphs``); None (the default) turns it on for any accelerated
    transformer whose steps run on CUDA, on one GPU or under a parallel layout. ``vae_parallel``: under a parallel layout,
    split the VAE decode over the ranks by latent rows (None, the default: when the VAE's layers allow it).
    ``components``: the pipeline attributes treated as denoisers (Diffusers transformers or UNets; by
    default those of these names the pipeline holds: Wan 2.2's two experts, MiniMax-H3's ``ref2va`` model).
    ``quantize``: ``"fp8"`` runs the native blocks' projections as float8 e4m3 GEMMs (lossy, opt-in; see
    ``omni_accel.layers.fp8``); None (the default) keeps every computation lossless."""

    attention: AttentionConfig = field(default_factory=AttentionConfig)
    native: bool = True
    projection_cache_bytes: int | None = None
    parallel: ParallelConfig | str | None = None
    compile: bool | Mapping[str, Any] | None = None
    compile_in_background: bool = False
    cuda_graphs: bool | None = None
    vae_parallel: bool | None = None
    components: tuple[str, ...] = DEFAULT_COMPONENTS
    quantize: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.attention, AttentionConfig):
            object.__setattr__(self, "attention", _attention_config(self.attention))
        if not isinstance(self.native, bool):
            raise TypeError(f"native must be True or False, got {self.native!r}.")
        budget = self.projection_cache_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise TypeError(f"projection_cache_bytes must be an int or None, got {budget!r}.")
        if budget is not None and budget < 0:
            raise ValueError(
                f"projection_cache_bytes must be >= 0 (0 turns it off), got {self.projection_cache_bytes}."
            )
        if self.compile is not None and not isinstance(self.compile, bool | Mapping):
            raise TypeError(
                f"compile must be None (auto), True/False or a dict of torch.compile arguments, got {self.compile!r}."
            )
        if isinstance(self.compile, Mapping):
            _check_compile_arguments(self.compile)
        if not isinstance(self.compile_in_background, bool):
            raise TypeError(
                f"compile_in_background must be True or False, got {self.compile_in_background!r}."
            )
        if self.compile_in_background and self.compile is False:
            raise ValueError(
                "compile_in_background=True asks for a compile that compile=False turns off; pass one of them."
            )
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be True, False or None (auto), got {self.cuda_graphs!r}.")
        if self.vae_parallel is not None and not isinstance(self.vae_parallel, bool):
            raise TypeError(f"vae_parallel must be True, False or None (auto), got {self.vae_parallel!r}.")
        if self.parallel not in (None, "auto") and not isinstance(self.parallel, ParallelConfig):
            raise TypeError(
                f"parallel must be an omni_accel.ParallelConfig or 'auto', got {self.parallel!r}."
            )
        components = self.components
        iterable = isinstance(components, Iterable) and not isinstance(components, str)
        names = tuple(components) if iterable else None
        if names is None or not all(isinstance(c, str) for c in names):
            raise TypeError(f"components must be a tuple of attribute names, got {components!r}.")
        object.__setattr__(self, "components", names)
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:  # the report listed the component twice, the second as moved to where it was
            raise ValueError(f"components names {repeated} more than once; name each denoiser once.")
        if not self.components:
            raise ValueError(
                f"components=() names no denoiser, so accelerate would do nothing; name the pipeline's "
                f"transformers (the default {list(DEFAULT_COMPONENTS)} takes those it holds)."
            )
        if self.quantize not in QUANTIZATIONS:
            raise ValueError(
                f"quantize must be one of {sorted(q for q in QUANTIZATIONS if q)} or None (lossless), got "
                f"{self.quantize!r}."
            )

    @property
    def projection_cache_budget(self) -> int:
        """The cache's budget in bytes: the one given, else ``DEFAULT_PROJECTION_CACHE_BYTES`` (a model whose
        cache does not pay turns a default budget down itself, see ``projection_cache_bytes``)."""
        budget = self.projection_cache_bytes
        return DEFAULT_PROJECTION_CACHE_BYTES if budget is None else budget

    @property
    def compile_asked(self) -> bool:
        """``compile`` is True or a dict of ``torch.compile`` arguments (not None, the automatic choice)."""
        return self.compile is True or isinstance(self.compile, Mapping)

    def with_overrides(self, **overrides: Any) -> AccelConfig:
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"accelerate() got unknown option(s) {unknown}; valid options: {sorted(names)}.")
        return dataclasses.replace(self, **overrides)


def _attention_config(value: Any) -> AttentionConfig:
    """Accepts a provider name for every site, or a mapping with ``default`` / ``per_role``; checks their
    forms here, so that a wrong one names the option rather than failing inside AttentionConfig."""
    if isinstance(value, str):
        return AttentionConfig(default=value)
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"default", "per_role"})
        if unknown:
            raise TypeError(f"attention options {unknown} are unknown; use 'default' and 'per_role'.")
        default, per_role = value.get("default", "auto"), value.get("per_role", {})
        check_forms(default, per_role, "attention['{}']", "attention='NAME'")
        return AttentionConfig(default=default, per_role=per_role)
    raise TypeError(
        f"attention must be an AttentionConfig, a provider name or a mapping, got {type(value).__name__}."
    )


def _check_compile_arguments(arguments: Mapping[str, Any]) -> None:
    """Raises at ``accelerate`` what ``torch.compile`` would raise at the first call for ``arguments`` (an
    unknown keyword, mode, backend or inductor option): making the wrapper checks them and compiles nothing.
    ``disable=True`` is refused too: it compiles nothing, where the report would say the blocks compiled."""
    if arguments.get("disable"):
        raise ValueError(
            f"compile={dict(arguments)!r} asks to compile with torch.compile's disable=True, which compiles "
            "nothing; pass compile=False to run the blocks uncompiled, or leave disable out."
        )
    try:
        torch.compile(_identity, **arguments)
    except Exception as exc:
        raise ValueError(
            f"compile={dict(arguments)!r} is not what torch.compile takes: {type(exc).__name__}: {exc}. Pass "
            "torch.compile's keyword arguments (mode, fullgraph, dynamic, backend, options), or compile=True."
        ) from exc


def _identity(x: Any) -> Any:
    return x
