"""Opt-in FP8 projections (``accelerate(pipe, quantize="fp8")``): lossy, about twice the GEMM throughput.

* Weights: float8 e4m3 with one scale per output channel, made from the bf16 parameter, which stays the
  source of truth. ``Fp8Weights`` keeps the copies and makes one again, in place, whenever a version
  counter of a parameter it came from moves (an in-place edit, ``.data`` included, a LoRA fuse), so that a
  CUDA graph replaying the copy reads the new values; a parameter replaced by another tensor (a
  ``load_state_dict(assign=True)``, a re-pack, ``.to()``) gets a new copy, the old one dropped (at the
  module's ``.to()`` itself: ``omni_accel.moves``).
* Activations: e4m3 with one scale per row (token), quantized from the bf16 values the unquantized path
  would have multiplied; on CUDA by the kernel that produces them where it can (``norm_modulate``, the
  GELU of an MLP, ``quantize_rows`` otherwise: one read of the activations).
* GEMM: ``torch._scaled_mm`` (cuBLASLt on CUDA, with fast accumulation), the bias added in its epilogue,
  the output in the activations' dtype. LoRA adapters that are not fused run in bf16 beside it, on the
  bf16 activations.
* Per-sample projections (the AdaLN modulation: a row or two, the whole weight read for them): the weight
  alone is quantized (``weight_only_linear``), the rows multiply it in their dtype, accumulated in float32.

A scale is ``amax * (1 / 448)`` of its row (``amax`` at least ``_AMAX_FLOOR``, so a zero row stays zero;
a product, as PyTorch computes a division by a scalar on CUDA) and a value ``x * (1 / scale)`` (one IEEE
division per row, a product per value: a division per value made the quantizing kernels compute-bound)
saturated to e4m3's range, rounded to nearest even.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..utils.kernels import HAS_TRITON, kernels_can_run
from ..utils.reason_counts import ReasonCounts
from ..utils.storage import contiguous_run
from ..utils.watched import Watcher, weight_version

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
_AMAX_FLOOR = 1e-12


@dataclass(frozen=True)
class Fp8Weight:
    """A projection's weight in e4m3: ``data`` ``[N, K]`` (row-major), ``scale`` ``[1, N]`` float32."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


@dataclass(frozen=True)
class Fp8Rows:
    """Activations quantized by rows: ``data`` ``[M, K]`` e4m3, ``scale`` ``[M, 1]`` float32, of a tensor
    of shape ``(*lead, K)`` and dtype ``dtype``."""

    data: torch.Tensor
    scale: torch.Tensor
    lead: tuple[int, ...]
    dtype: torch.dtype


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """``weight`` ``[N, K]`` in e4m3 with a scale per output channel (row)."""
    data, scale = quantize_rows_reference(weight.detach())
    return Fp8Weight(data, scale.reshape(1, -1))


def quantize_rows(x: torch.Tensor) -> Fp8Rows:
    """``x`` ``[..., K]`` quantized by rows (one kernel on CUDA)."""
    rows = x.reshape(-1, x.shape[-1])
    if kernels_can_run(rows) and rows.stride(-1) == 1:  # compiled, inductor fuses the reference instead
        data, scale = torch.ops.omni_accel.quantize_rows(rows)
    else:
        data, scale = quantize_rows_reference(rows)
    return Fp8Rows(data, scale, tuple(x.shape[:-1]), x.dtype)


def split_rows(rows: Fp8Rows, lengths: Sequence[int]) -> list[Fp8Rows]:
    """``rows`` of a ``[B, S, K]`` tensor split along ``S`` into parts of ``lengths`` (views for one sample;
    e4m3 copies, half a bf16 copy's bytes, for several)."""
    batch, seq = rows.lead
    data = rows.data.view(batch, seq, -1)
    scale = rows.scale.view(batch, seq, 1)
    parts, start = [], 0
    for length in lengths:
        part_data = data[:, start : start + length].reshape(batch * length, -1)
        part_scale = scale[:, start : start + length].reshape(batch * length, 1)
        if start % 4:  # cuBLASLt takes 16-byte aligned scales (Qwen-Image's text of 7 tokens: not)
            part_scale = part_scale.clone()
        parts.append(Fp8Rows(part_data, part_scale, (batch, length), rows.dtype))
        start += length
    return parts


def quantize_rows_reference(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = rows.float()
    scale = values.abs().amax(dim=-1, keepdim=True).clamp_min(_AMAX_FLOOR) * (1 / E4M3_MAX)
    data = (values * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return data, scale


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the e4m3 GEMM (``x`` quantized here unless it already is)."""
    rows = x if isinstance(x, Fp8Rows) else quantize_rows(x)
    out = torch._scaled_mm(
        rows.data,
        weight.data.t(),
        scale_a=rows.scale,
        scale_b=weight.scale,
        bias=bias,
        out_dtype=rows.dtype,
        use_fast_accum=rows.data.is_cuda,
    )
    return out.reshape(*rows.lead, out.shape[-1])


def weight_only_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the e4m3 weight dequantized and ``x`` as it is: a product of a few
    rows takes as long as its weight's read, which e4m3 halves. On CUDA our GEMV kernel (compiled code
    included: inductor would dequantize the whole weight first), else the float32 reference."""
    rows = x.reshape(-1, x.shape[-1])
    if kernels_can_run(rows, when_compiling=True) and gemv_kernels.serves(rows, weight.data, weight.scale):
        out = torch.ops.omni_accel.few_rows_linear(rows, weight.data, weight.scale, bias)
    else:
        out = dequantized_linear(rows, weight.data, weight.scale, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def dequantized_linear(
    x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` of ``x`` and the e4m3 weight ``data`` times its ``scale`` per output channel, in float32
    (the reference of ``weight_only_linear``; it dequantizes the whole weight per call)."""
    dequantized = data.float() * scale.reshape(-1, 1)
    return F.linear(x.float(), dequantized, None if bias is None else bias.float()).to(x.dtype)


def fp8_reason(weight: torch.Tensor) -> str | None:
    """Why ``weight`` (a projection's ``[N, K]``) keeps its bf16 GEMM under ``quantize="fp8"``, or None."""
    if weight.ndim != 2:
        return f"a weight of {weight.ndim} dims"
    if weight.is_cuda and (weight.shape[0] % 16 or weight.shape[1] % 16):
        return f"a weight of {tuple(weight.shape)} (cuBLASLt's FP8 GEMM takes multiples of 16)"
    return None


@dataclass
class _Entry:
    fp8: Fp8Weight
    sources: tuple[weakref.ref, ...]
    versions: tuple[int, ...]


class Fp8Weights:
    """The e4m3 copies of one accelerated transformer's projection weights (see the module docstring).

    A copy is keyed by the (maybe packed) weight it was made from, and remembers the parameters behind it
    (``sources``) with their version counters; those parameters are watched (``utils.watched``) so that a
    write through ``.data`` counts. ``refresh``, as each forward begins, re-makes stale copies in place (a
    CUDA graph replays them) and forgets those of weights that moved (offload, ``load_state_dict(assign=
    True)``), whose new memory gets copies of its own; ``drop`` forgets those nothing reads any more.

    CUDA graphs are keyed on the weights' addresses, not the copies': a copy forgotten and made again
    elsewhere would leave a graph reading the old one's freed memory. So ``generation`` advances at every
    copy forgotten, and graphs key their steps on it (``CompiledSteps.begin_step``)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}
        # every entry's sources and their versions in one flat pair of lists (None: to be made again)
        self._snapshot: tuple[list[weakref.ref], list[int]] | None = None
        self._watcher = Watcher()
        self._lock = threading.Lock()
        self.quantized = 0  # copies made, in place or new
        self.generation = 0  # advances whenever a copy is forgotten (its memory freed)
        self.declined = ReasonCounts()  # projections whose GEMM stays bf16, by reason (calls)
        # the generic tier's linears (``layers.fp8_linears``): how many, and those that compute as Diffusers'
        # do, by reason (as each last decided)
        self.linears = 0
        self.kept: Counter = Counter()

    def __deepcopy__(self, memo: dict) -> Fp8Weights:
        return _decided(self.linears, dict(self.kept))  # the copies belong to the original's weights

    def __reduce__(self):
        return _decided, (self.linears, dict(self.kept))

    def keep(self, was: str | None, now: str | None) -> None:
        """A linear that computed as Diffusers' does for the reason ``was`` (None: in FP8) now does for
        ``now``."""
        with self._lock:
            if was is not None:
                self.kept[was] -= 1
                if self.kept[was] <= 0:
                    del self.kept[was]
            if now is not None:
                self.kept[now] += 1

    @property
    def copies(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return sum(entry.fp8.nbytes for entry in self._entries.values())

    def of(self, weight: torch.Tensor, sources: Sequence[torch.Tensor]) -> Fp8Weight:
        """The e4m3 copy of ``weight`` (made of the parameters ``sources``), made or re-made if stale."""
        key = _key(weight)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not _same_sources(entry, sources):
                if entry is not None:
                    self._forget(key)
                for source in sources:
                    self._watcher.watch(source)
                entry = self._entries[key] = _Entry(
                    _plain_quantized(weight),
                    tuple(weakref.ref(s) for s in sources),
                    tuple(weight_version(s) for s in sources),
                )
                self.quantized += 1
                self._snapshot = None
            elif entry.versions != tuple(weight_version(s) for s in sources):
                self._requantize(entry, weight)
            return entry.fp8

    def refresh(self) -> None:
        """Re-makes in place every copy whose parameters were written since, and forgets copies whose
        parameters are gone or were replaced (their weights live elsewhere now)."""
        with self._lock:
            if self._unchanged():
                return
            self._snapshot = None
            for key, entry in list(self._entries.items()):
                sources = [ref() for ref in entry.sources]
                if all(s is not None for s in sources) and entry.versions == tuple(
                    weight_version(s) for s in sources
                ):
                    continue
                weight = _in_place(key, sources)
                if weight is None:
                    self._forget(key)
                else:
                    self._requantize(entry, weight)

    def drop_moved(self) -> None:
        """Forgets the copies whose weights moved (the module moved to another dtype or device:
        ``omni_accel.moves``) now rather than at the next forward, so that a model moved off its GPU leaves
        no copy there. Copies of weights written in place are re-made at the next forward, as ever."""
        with self._lock:
            if self._unchanged():
                return
            for key, entry in list(self._entries.items()):
                if _in_place(key, [ref() for ref in entry.sources]) is None:
                    self._forget(key)

    def drop(self, parameters: Iterable[torch.Tensor]) -> None:
        """Forgets the copies made of any of ``parameters``: their block or linear computes as Diffusers'
        does now (hooks on it such as layerwise casting or offload, a custom processor, autograd...), so
        nothing reads them, and ``refresh`` would re-make them for nothing at each write. A call that runs
        in FP8 again makes them again."""
        with self._lock:
            if not self._entries:
                return
            ids = {id(parameter) for parameter in parameters}
            for key, entry in list(self._entries.items()):
                if any(id(ref()) in ids for ref in entry.sources):
                    self._forget(key)

    def release(self) -> None:
        """Drops every copy and stops watching the parameters (``restore``)."""
        with self._lock:
            self.generation += bool(self._entries)
            self._entries.clear()
            self._snapshot = None
            self._watcher.release()

    def _forget(self, key: tuple) -> None:
        del self._entries[key]
        self.generation += 1
        self._snapshot = None

    def _requantize(self, entry: _Entry, weight: torch.Tensor) -> None:
        fresh = _plain_quantized(weight)
        entry.fp8.data.copy_(fresh.data)
        entry.fp8.scale.copy_(fresh.scale)
        entry.versions = tuple(weight_version(ref()) for ref in entry.sources)
        self.quantized += 1
        self._snapshot = None

    def _unchanged(self) -> bool:
        """Whether every parameter behind a copy is alive at the version its copy was made from. Before each
        CUDA graph replay, on the host (about 900 parameters in FLUX.1-dev): one comprehension over a flat
        list rather than a check per copy."""
        if self._snapshot is None:
            entries = list(self._entries.values())
            refs = [ref for entry in entries for ref in entry.sources]
            self._snapshot = (refs, [version for entry in entries for version in entry.versions])
        refs, versions = self._snapshot
        try:
            return [weight_version(ref()) for ref in refs] == versions
        except AttributeError:  # a parameter is gone: its reference gives None
            return False


def _decided(linears: int, kept: dict[str, int]) -> Fp8Weights:
    """A store without copies (those belong to the original's weights) that knows what its linears decided:
    the deep or unpickled copy of one."""
    store = Fp8Weights()
    store.linears, store.kept = linears, Counter(kept)
    return store


def _plain_quantized(weight: torch.Tensor) -> Fp8Weight:
    """``quantize_weight(weight)`` as tensors with a version counter, even under inference mode: a copy made
    in a call there is re-made in place by a later call outside it."""
    with torch.inference_mode(False):
        return quantize_weight(weight)


def _in_place(key: tuple, sources: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The weight that the parameters ``sources`` make, where the copy keyed ``key`` was made of it; None
    where one is gone, or they moved."""
    if any(source is None for source in sources):
        return None
    weight = contiguous_run(sources)
    return weight if weight is not None and _key(weight) == key else None


def _key(weight: torch.Tensor) -> tuple:
    return (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight.device)


def _same_sources(entry: _Entry, sources: Sequence[torch.Tensor]) -> bool:
    return len(entry.sources) == len(sources) and all(
        ref() is source for ref, source in zip(entry.sources, sources, strict=True)
    )


if HAS_TRITON:
    from . import (
        fp8_kernels,  # noqa: F401  (registers the custom ops)
        gemv_kernels,
    )
