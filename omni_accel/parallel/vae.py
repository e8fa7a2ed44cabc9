"""Patch-parallel VAE: each rank decodes (or encodes) a band of rows, and the result is one rank's.

Under a parallel layout every rank ends the denoising loop with the same latents (and starts an img2img
call with the same image), so the VAE's work can be split instead of repeated; a call whose inputs differ
over the ranks (each rank's own latents) runs whole on each (``fingerprint``). Split by rows, a VAE's
layers each need only:

* a 3x3 convolution: one row from each neighbouring band (a halo exchanged with the neighbours), or the
  zero padding at the image's edge;
* a stride-2 downsampling convolution (padded at the bottom and right only): one row from the band below,
  given bands of an even number of rows at every level (the encoder's bands are multiples of its whole
  downsampling factor);
* a GroupNorm: its statistics over the whole image, from the bands' sums (two all-reduces: mean, then the
  squared deviations around it, in float32, or float64 for a float64 VAE), applied as PyTorch applies them;
* an attention over the positions: its input is gathered and it runs whole (a small part of the work);
* upsampling, per-position norms and elementwise steps: nothing.

Known here: Diffusers' 2-D ``Encoder``/``Decoder`` (``AutoencoderKL``: FLUX, SD3...) and its shared layers;
a model file teaches its own VAE's layers with ``register_row_split`` (Wan's video encoder and decoder:
models/wan.py).
The bands are gathered at the end of each call. With GroupNorms only the order of their float32 sums
differs from one rank (< 1.5e-6 relative in fp32, and no farther from a float64 run than one rank is).
Installed as the coder's instance ``forward`` for the duration of the accelerated pipeline;
``enable_tiling()`` and ``enable_slicing()`` keep working (each tile or sample is split the same way). A
hook on one of the coder's layers (layerwise casting, group offload, a user's) would be skipped by the
band-aware layers or see a band: such calls run whole (``RowSplit``).
"""

from __future__ import annotations

import copy
import functools
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..forward_hooks import InstanceForward, hooked_submodule
from ..utils.logging import get_logger
from .comm import all_gather_sizes
from .turns import turns

logger = get_logger(__name__)


def _rows(x: torch.Tensor) -> int:
    """The dim of the rows: 2 in images (N, C, H, W), 3 in videos (N, C, T, H, W)."""
    return x.ndim - 2


SAME_SIZE_CONVS = (((1, 1), (0, 0)), ((3, 3), (1, 1)))  # (kernel, padding) with stride 1


@dataclass(frozen=True)
class SplitLayer:
    """How the row split treats one layer class (by name): why an instance cannot be split (``reason``
    returns None when it can), its band-aware forward ``(module, bands, x, *args, **kwargs)`` (None: the
    layer works on its rows alone), and by how much it divides the rows (``downsamples``: 2 for a stride-2
    downsampling, whose own convolution the split then leaves to this layer; 1 for any other layer)."""

    reason: Callable[[nn.Module], str | None] = lambda module: None
    forward: Callable[..., torch.Tensor] | None = None
    downsamples: Callable[[nn.Module], int] = lambda module: 1


_CODERS = {"Encoder", "Decoder"}  # Diffusers' 2-D VAE halves; models register theirs (register_row_split)
_LAYERS: dict[str, SplitLayer] = {}  # filled below with Diffusers' shared layers, and by the models


# Whether a call of a coder (by class name) continues the sequence its last call began, on cached rows of that
# call (a video coder's frame chunks): it splits as that call did.
_CONTINUES: dict[str, Callable[[tuple, dict], bool]] = {}


def register_row_split(
    coders: tuple[str, ...],
    layers: dict[str, SplitLayer],
    continues: Callable[[tuple, dict], bool] | None = None,
) -> None:
    """Teaches the row split a model's VAE: the class names of its splittable encoders/decoders and how
    its own layer classes split (a model file calls this; ``parallel/`` names no model); ``continues``: whether
    a call of those coders, by its arguments, runs on rows cached by the calls before it."""
    _CODERS.update(coders)
    _LAYERS.update(layers)
    if continues is not None:
        _CONTINUES.update(dict.fromkeys(coders, continues))


def supports(coder: nn.Module) -> str | None:
    """None when ``coder`` is a VAE encoder or decoder the row split knows, made only of layers it
    handles; else what is not."""
    kind = type(coder).__name__
    if kind not in _CODERS or not type(coder).__module__.startswith("diffusers."):
        return f"it is a {kind}, which the row split does not know"
    # The parts of a downsampling layer (its strided convolution...) are that layer's to handle.
    downsampling = {
        id(part)
        for layer in coder.modules()
        if _row_factor(layer) > 1
        for part in layer.modules()
        if part is not layer
    }
    for name, module in coder.named_modules():
        reason = _layer_reason(module, downsampling)
        if reason is not None:
            return f"{name}: {reason}"
    return None


def _row_factor(module: nn.Module) -> int:
    split = _LAYERS.get(type(module).__name__)
    return 1 if split is None else split.downsamples(module)


def _layer_reason(module: nn.Module, downsampling: set[int]) -> str | None:
    kind = type(module).__name__
    if kind in _LAYERS:
        return _LAYERS[kind].reason(module)
    if id(module) in downsampling:
        return None
    if isinstance(module, nn.Conv2d):
        shape = ((module.kernel_size, module.padding), module.stride, module.dilation, module.padding_mode)
        if shape[0] not in SAME_SIZE_CONVS or shape[1:] != ((1, 1), (1, 1), "zeros") or module.groups != 1:
            return f"a convolution the row split does not handle ({module})"
    elif isinstance(module, nn.Conv1d | nn.Conv3d | nn.ConvTranspose2d) or kind == "SpatialNorm":
        return f"a {kind}"
    return None


class RowSplit(InstanceForward):
    """The encoder's or decoder's ``forward`` while installed: splits the rows over ``group``'s ranks, in
    bands of ``unit`` rows (the encoder's whole downsampling factor, so every level halves evenly). A hook
    registered on the coder after ``install`` wraps it; ``uninstall`` then steps aside (``enabled``).

    A call runs whole where a split would change what a hook sees or does: a hook on the coder installed
    before us (``inner``), or any hook on its layers (Diffusers' layerwise casting and group offload, a
    user's ``ModelHook`` or torch hook), which the band-aware layers would skip or see a band of; and where
    it cannot split (too few rows, gradients on, a layer the split does not handle put in since). The ranks
    agree on it: where one runs a call whole, they all do. ``whole`` counts those calls by reason, ``calls`` the
    split ones (``describe`` says both)."""

    def __init__(self, coder: nn.Module, group: dist.ProcessGroup, unit: int | None = None) -> None:
        super().__init__(coder)
        self._group = _Shared(group)
        self.unit = math.prod(_row_factor(m) for m in coder.modules()) if unit is None else unit
        self.calls = 0
        self.whole: Counter[str] = Counter()
        # This thread's last call that started a sequence of cached calls (``register_row_split``'s
        # ``continues``): ``first`` holds why it ran whole (None: split), which the sequence's calls follow.
        self._sequence = _PerThread()

    def __deepcopy__(self, memo: dict) -> RowSplit:
        # The coder's copy is still empty here (its copy is what holds ours): its unit is ours.
        twin = RowSplit(copy.deepcopy(self.module, memo), self.group, self.unit)
        twin.inner, twin.enabled = copy.deepcopy(self.inner, memo), self.enabled
        return twin

    def __reduce__(self):
        return _plain_forward, (self.module, self.inner)  # a pickled VAE runs on one process

    @property
    def group(self) -> dist.ProcessGroup:
        return self._group.value

    def _hooked(self) -> str | None:
        """Why a hook rules the split out, or None."""
        if self.inner is not None:
            return "a hook wrapped its forward before accelerate"
        hooked = hooked_submodule(self.module)
        return None if hooked is None else f"{hooked} has a forward hook"

    def _runs_whole(self, sample: torch.Tensor, world: int) -> str | None:
        """Why this call cannot split over ``world`` ranks, or None."""
        if sample.ndim not in (4, 5):
            return f"a {sample.ndim}-D input: the split takes images and videos"
        height = sample.shape[_rows(sample)]
        if height % self.unit or height < world * self.unit:
            if self.unit == 1:
                return f"{height} rows: the split takes one row or more per rank, {world} in all"
            return (
                f"{height} rows: the split takes a multiple of {self.unit} rows, {self.unit} or more per rank"
            )
        if torch.is_grad_enabled():
            return "gradients on: the split runs under no_grad or inference_mode only"
        hooked = self._hooked()
        if hooked is not None:
            return hooked
        # A layer put in or changed since accelerate (a 5x5 convolution) would run on a band alone.
        return supports(self.module)

    def _unreached(self, device: torch.device) -> str | None:
        """Why the group's collectives cannot run on ``device`` (a VAE moved to the CPU under NCCL), or None."""
        backends = dist.get_backend_config(self.group)  # "cuda:nccl", "cpu:gloo,cuda:gloo"...
        if device.type in {entry.split(":")[0] for entry in backends.split(",")}:
            return None
        return f"its input is on {device.type}, where the layout's collectives ({backends}) do not run"

    def _agreed(self, reason: str | None, inputs: list[torch.Tensor]) -> str | None:
        """``reason``, or one for every rank where another rank runs the call whole: a hook on one rank's VAE
        only (a logger on rank 0) would leave the other ranks waiting for its halo rows; or where the ranks'
        ``inputs`` differ (each rank's own latents or images, a seed per rank): a split would mix their rows,
        so each rank runs its own whole, as plain Diffusers does. One all-reduce decides both."""
        sums = fingerprint(inputs)
        verdict = torch.cat([sums.new_tensor([int(reason is not None)]), sums, -sums])
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=self.group)
        whole, highest, lowest = verdict[0].item(), verdict[1:3].tolist(), (-verdict[3:]).tolist()
        if reason is None and highest != lowest:
            return DIFFERENT_INPUTS
        if reason is None and whole:
            return "another rank runs it whole (a hook or a layer on that rank's VAE only): every rank does"
        return reason

    def _whole_reason(self, sample: torch.Tensor, args: tuple, kwargs: dict, world: int) -> str | None:
        """Why this call runs whole on every rank, or None where it splits: the ranks agree on it, and a call
        on rows cached by the calls before it (``register_row_split``'s ``continues``) follows the first."""
        rule = _CONTINUES.get(type(self.module).__name__)
        continues = rule is not None and rule(args, kwargs)
        first = getattr(self._sequence, "first", None) if continues else None
        # A call continuing a sequence that ran whole on every rank runs whole too.
        if first is not None and first[0] is not None:
            return first[0]
        unreached = self._unreached(sample.device)
        if unreached is not None:  # no collective can run: every rank whose VAE is there runs it whole
            return unreached
        inputs = [sample, *(x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor))]
        reason = self._agreed(self._runs_whole(sample, world), inputs)
        if first is not None and reason == DIFFERENT_INPUTS:
            raise RuntimeError(
                f"The ranks' inputs to pipe.vae's {type(self.module).__name__} differ from a later chunk on, after "
                "its first chunk was split over the ranks by rows (each rank caches its band's frames for the next "
                "chunk, so it cannot run whole now). Give every rank the same latents or images, or accelerate "
                "with vae_parallel=False to run each rank's own whole."
            )
        if not continues:
            self._sequence.first = (reason,)
        return reason

    def describe(self, name: str) -> list[str]:
        """What the split did so far (``name``: the VAE's attribute holding the coder)."""
        lines = [f"vae {name}: {self.calls} calls split over the ranks by rows"]
        lines += [
            f"vae {name}: {count} calls ran whole on every rank ({why})"
            for why, count in sorted(self.whole.items())
        ]
        return lines

    def __call__(self, sample: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        forward = self._forward()
        if not self.enabled:
            return forward(sample, *args, **kwargs)
        # One at a time with the process's other calls that communicate (a transformer forward, a split call
        # of another thread), in the order every rank takes them (``turns``): the layers are band-aware for
        # the call in flight only.
        with turns().turn([sample, args, kwargs], vae=True):
            return self._call(forward, sample, args, kwargs)

    def _call(self, forward: Callable, sample: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        reason = self._whole_reason(sample, args, kwargs, world)
        if reason is not None:
            if not self.whole[reason]:
                logger.info("VAE %s runs whole on every rank: %s", type(self.module).__name__, reason)
            self.whole[reason] += 1
            return forward(sample, *args, **kwargs)
        rows = _rows(sample)
        units = sample.shape[rows] // self.unit
        sizes = [(units // world + (r < units % world)) * self.unit for r in range(world)]
        band = sample.narrow(rows, sum(sizes[:rank]), sizes[rank])
        with _split_layers(self.module, Bands(self.group, rank, world)):
            out = forward(band.contiguous(), *args, **kwargs)
        self.calls += 1
        out_sizes = [size * out.shape[rows] // sizes[rank] for size in sizes]  # up- or downsampled alike
        return all_gather_sizes(out, rows, out_sizes, self.group)


DIFFERENT_INPUTS = (
    "the ranks' inputs differ (each rank's own latents or images): each rank runs its own whole, as plain "
    "Diffusers does"
)
# How a float's bits read as an integer of its size, and the multiplier that spreads the positions' weights
# (2**64 / the golden ratio, as an int64, or its 32-bit counterpart).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GOLDEN = {torch.int32: -1640531527, torch.int64: -7046029254386353131}


def fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two int64 sums of the tensors' bits, plain (with their shapes) and weighted by position: integer sums
    (wrapping), so equal inputs give equal sums on every rank whatever the order of summation, and different
    inputs, but by a tiny chance, different ones. One pass over the inputs, one buffer of positions' weights
    (32-bit for inputs of 32 bits or fewer), nothing sent anywhere."""
    sums = torch.zeros(2, dtype=torch.int64, device=tensors[0].device)
    for x in tensors:
        bits = x.detach().view(_BITS[x.element_size()]).reshape(-1)
        if x.element_size() < 4:
            bits = bits.to(torch.int32)
        weights = torch.arange(1, bits.numel() + 1, dtype=bits.dtype, device=x.device).mul_(
            _GOLDEN[bits.dtype]
        )
        shape = hash((tuple(x.shape), x.element_size(), x.is_floating_point()))  # the same in every process
        weighted = weights.mul_(bits).sum(dtype=torch.int64)
        sums = sums * 31 + torch.stack([bits.sum(dtype=torch.int64) + shape, weighted])
    return sums


class _Shared:
    """A value that copies share: a process group cannot be copied, and a Diffusers hook registered over
    us copies our attributes into its wrapper (``functools.update_wrapper``), which a deep copy copies."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict) -> _Shared:
        return self


class _PerThread(threading.local):
    """Per-thread values; a copy (a hook's wrapper copies our attributes, which a deep copy copies) starts
    empty."""

    def __deepcopy__(self, memo: dict) -> _PerThread:
        return _PerThread()


def _plain_forward(coder: nn.Module, inner: Callable | None = None) -> Any:
    return inner if inner is not None else functools.partial(type(coder).forward, coder)


class Bands:
    """The ranks holding consecutive row bands, in rank order."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    def with_halo(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with one row from each neighbouring band (zeros at the image's top and bottom)."""
        dim = _rows(x)
        above, below = self._exchange(x, send_up=True, send_down=True)
        return torch.cat([above, x, below], dim=dim)

    def with_row_below(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the first row of the band below (zeros under the image's last row)."""
        _, below = self._exchange(x, send_up=True, send_down=False)
        return torch.cat([x, below], dim=_rows(x))

    def _exchange(self, x: torch.Tensor, send_up: bool, send_down: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Sends this band's first row up and/or its last row down; returns the rows received from above
        and below (zeros at the image's edges). One batched call, so NCCL pairs every send with its
        receive instead of deadlocking on two sends."""
        dim = _rows(x)
        row = (*x.shape[:dim], 1, *x.shape[dim + 1 :])
        above, below = x.new_zeros(row), x.new_zeros(row)
        up, down = self.rank - 1, self.rank + 1
        ops = []
        if self.rank > 0:
            if send_up:
                ops.append(self._op(dist.isend, x.narrow(dim, 0, 1).contiguous(), up))
            if send_down:
                ops.append(self._op(dist.irecv, above, up))
        if self.rank < self.world - 1:
            if send_down:
                ops.append(self._op(dist.isend, x.narrow(dim, -1, 1).contiguous(), down))
            if send_up:
                ops.append(self._op(dist.irecv, below, down))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return above, below

    def _op(self, kind, tensor: torch.Tensor, peer: int) -> dist.P2POp:
        return dist.P2POp(kind, tensor, dist.get_global_rank(self.group, peer), group=self.group)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


def _conv(module: nn.Conv2d, bands: Bands, x: torch.Tensor) -> torch.Tensor:
    """A 3x3 convolution (padding 1) of the band with its halo rows: the rows need no padding then."""
    return F.conv2d(bands.with_halo(x), module.weight, module.bias, 1, (0, 1))


def _downsample(module: nn.Module, bands: Bands, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Diffusers' Downsample2D (pad one column right and one row below, 3x3 stride 2) of an even band:
    the row below is the next band's first."""
    x = F.pad(bands.with_row_below(x), (0, 1, 0, 0))
    return F.conv2d(x, module.conv.weight, module.conv.bias, stride=2)


def _group_norm(module: nn.GroupNorm, bands: Bands, x: torch.Tensor) -> torch.Tensor:
    """GroupNorm with the statistics of the whole image (the mean, then the squared deviations around it),
    applied as PyTorch's kernel applies them: ``x * scale + shift`` per channel, in float32, or in float64
    for a float64 VAE (as PyTorch computes it: float32 statistics would cost a float64 run its precision)."""
    batch, channels, groups = x.shape[0], x.shape[1], module.num_groups
    dtype = torch.promote_types(x.dtype, torch.float32)
    grouped = x.reshape(batch, groups, -1).to(dtype)
    count = bands.sum(torch.tensor([float(grouped.shape[-1])], dtype=dtype, device=x.device))
    mean = bands.sum(grouped.sum(-1)) / count
    variance = bands.sum((grouped - mean[..., None]).pow(2).sum(-1)) / count
    per_channel = channels // groups
    scale = torch.rsqrt(variance + module.eps).repeat_interleave(per_channel, dim=1)
    mean = mean.repeat_interleave(per_channel, dim=1)
    if module.affine:
        scale = scale * module.weight.to(dtype)
    shift = -mean * scale + (module.bias.to(dtype) if module.affine else 0.0)
    return (x.to(dtype) * scale[:, :, None, None] + shift[:, :, None, None]).to(x.dtype)


def whole_attention(module: nn.Module, bands: Bands, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Runs the attention on the gathered image (with its own norm unsplit) and keeps this band."""
    counts = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(bands.world)]
    rows = _rows(x)
    dist.all_gather(counts, torch.tensor([x.shape[rows]], device=x.device), group=bands.group)
    sizes = [int(count) for count in counts]
    whole = all_gather_sizes(x, rows, sizes, bands.group)
    with _unsplit(module):
        out = type(module).forward(module, whole, *args, **kwargs)
    return out.narrow(rows, sum(sizes[: bands.rank]), sizes[bands.rank])


def _downsample_reason(module: nn.Module) -> str | None:
    conv = module.conv
    if module.norm is not None or not module.use_conv or module.padding != 0:
        return "a Downsample2D the row split does not handle"
    if (conv.kernel_size, conv.stride, conv.padding, conv.groups) != ((3, 3), (2, 2), (0, 0), 1):
        return f"a downsampling convolution the row split does not handle ({conv})"
    return None


register_row_split(
    (),
    {
        "Downsample2D": SplitLayer(_downsample_reason, _downsample, downsamples=lambda module: 2),
        "Attention": SplitLayer(forward=whole_attention),
    },
)


@contextmanager
def _unsplit(module: nn.Module) -> Iterator[None]:
    """Inside the gathered attention its own layers (its GroupNorm) see the whole image."""
    replaced = [(m, m.__dict__.pop("forward")) for m in module.modules() if "forward" in m.__dict__]
    try:
        yield
    finally:
        for m, forward in replaced:
            m.forward = forward


@contextmanager
def _split_layers(coder: nn.Module, bands: Bands) -> Iterator[None]:
    """For one call: the convolutions, downsamplings, GroupNorms and attention run band-aware."""
    patched = []
    for module in coder.modules():
        split = _LAYERS.get(type(module).__name__)
        if split is not None:
            if split.forward is not None:
                patched.append((module, functools.partial(split.forward, module, bands)))
        elif isinstance(module, nn.Conv2d) and module.kernel_size == (3, 3) and module.stride == (1, 1):
            patched.append((module, functools.partial(_conv, module, bands)))
        elif isinstance(module, nn.GroupNorm):
            patched.append((module, functools.partial(_group_norm, module, bands)))
    try:
        for module, forward in patched:
            module.forward = forward
        yield
    finally:
        for module, _ in patched:
            module.__dict__.pop("forward", None)
