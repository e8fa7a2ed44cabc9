"""Patch-parallel VAE: each rank decodes (or encodes) a band of rows, and the result is one rank's.

Under a parallel layout every rank ends the denoising loop with the same latents (and starts an img2img
call with the same image), so the VAE's work can be split instead of repeated. Diffusers' 2-D VAE
``Decoder`` and ``Encoder`` (``AutoencoderKL``: FLUX, SD3...) are convolutions, GroupNorms, one attention
and nearest-neighbour upsampling or strided downsampling. Split by rows, each needs only:

* a 3x3 convolution: one row from each neighbouring band (a halo exchanged with the neighbours), or the
  zero padding at the image's edge;
* a stride-2 downsampling convolution (padded at the bottom and right only): one row from the band below,
  given bands of an even number of rows at every level (the encoder's bands are multiples of its whole
  downsampling factor);
* a GroupNorm: its statistics over the whole image, from the bands' sums (two all-reduces: mean, then the
  squared deviations around it, the same two-pass arithmetic a single rank does, in float32);
* the mid-block attention: every position attends to every other, so its input is gathered and the
  attention runs whole (it is a small part of the decoder);
* upsampling and elementwise steps: nothing (each row's output depends on its own rows).

The bands are gathered at the end. The result differs from one rank's only by the order of float32
sums in the GroupNorm statistics (< 1.5e-6 relative in fp32, and no farther from a float64 run than one
rank is). Installed as the encoder's and decoder's instance ``forward`` for the duration of the
accelerated pipeline; ``enable_tiling()`` keeps working (each tile is split the same way).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .comm import all_gather_sizes

_ROWS = 2  # dim of the rows in NCHW
_UNSPLITTABLE = (nn.Conv1d, nn.Conv3d, nn.ConvTranspose2d)


def supports(coder: nn.Module) -> str | None:
    """None when ``coder`` is Diffusers' 2-D VAE ``Encoder`` or ``Decoder`` made only of layers the row
    split handles; else what is not (video VAEs work on frame chunks with cached state, and stay whole)."""
    from diffusers.models.autoencoders.vae import Decoder, Encoder
    from diffusers.models.downsampling import Downsample2D

    if type(coder) not in (Encoder, Decoder):
        return f"it is a {type(coder).__name__}, not the 2-D Encoder/Decoder the row split knows"
    downsampling = {id(m.conv) for m in coder.modules() if isinstance(m, Downsample2D)}
    for name, module in coder.named_modules():
        if isinstance(module, Downsample2D):
            conv = module.conv
            if module.norm is not None or not module.use_conv or module.padding != 0:
                return f"{name} is a Downsample2D the row split does not handle"
            if (conv.kernel_size, conv.stride, conv.padding, conv.groups) != ((3, 3), (2, 2), (0, 0), 1):
                return f"{name}.conv is a convolution the row split does not handle ({conv})"
        elif isinstance(module, nn.Conv2d) and id(module) not in downsampling:
            shape = (module.kernel_size, module.padding, module.stride, module.dilation, module.padding_mode)
            if shape not in (
                ((1, 1), (0, 0), (1, 1), (1, 1), "zeros"),
                ((3, 3), (1, 1), (1, 1), (1, 1), "zeros"),
            ):
                return f"{name} is a convolution the row split does not handle ({module})"
            if module.groups != 1:
                return f"{name} is a grouped convolution"
        elif isinstance(module, _UNSPLITTABLE) or type(module).__name__ == "SpatialNorm":
            return f"{name} is a {type(module).__name__}"
    return None


class RowSplit:
    """The encoder's or decoder's ``forward`` while installed: splits the rows over ``group``'s ranks, in
    bands of ``unit`` rows (the encoder's whole downsampling factor, so every level halves evenly)."""

    def __init__(self, coder: nn.Module, group: dist.ProcessGroup) -> None:
        self.coder = coder
        self.group = group
        self.unit = 2 ** sum(type(m).__name__ == "Downsample2D" for m in coder.modules())
        self.calls = 0

    def install(self) -> None:
        self.coder.forward = self

    def uninstall(self) -> None:
        if self.coder.__dict__.get("forward") is self:
            del self.coder.forward

    def __deepcopy__(self, memo: dict) -> RowSplit:
        return RowSplit(copy.deepcopy(self.coder, memo), self.group)

    def __reduce__(self):
        return _plain_forward, (self.coder,)  # a pickled VAE runs on one process

    @property
    def __wrapped__(self) -> Any:
        return type(self.coder).forward.__get__(self.coder)

    def __call__(self, sample: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        forward = self.__wrapped__
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        units, partial = divmod(sample.shape[_ROWS], self.unit)
        if sample.ndim != 4 or partial or units < world or torch.is_grad_enabled():
            return forward(sample, *args, **kwargs)
        sizes = [(units // world + (r < units % world)) * self.unit for r in range(world)]
        band = sample.narrow(_ROWS, sum(sizes[:rank]), sizes[rank])
        with _split_layers(self.coder, _Bands(self.group, rank, world)):
            out = forward(band.contiguous(), *args, **kwargs)
        self.calls += 1
        out_sizes = [size * out.shape[_ROWS] // sizes[rank] for size in sizes]  # up- or downsampled alike
        return all_gather_sizes(out, _ROWS, out_sizes, self.group)


def _plain_forward(coder: nn.Module) -> Any:
    return functools.partial(type(coder).forward, coder)


class _Bands:
    """The ranks holding consecutive row bands, in rank order."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    def with_halo(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with one row from each neighbouring band (zeros at the image's top and bottom)."""
        row = (*x.shape[:_ROWS], 1, *x.shape[_ROWS + 1 :])
        above, below = x.new_zeros(row), x.new_zeros(row)
        requests = []
        if self.rank > 0:
            peer = dist.get_global_rank(self.group, self.rank - 1)
            requests.append(dist.isend(x[:, :, :1].contiguous(), peer, group=self.group))
            requests.append(dist.irecv(above, peer, group=self.group))
        if self.rank < self.world - 1:
            peer = dist.get_global_rank(self.group, self.rank + 1)
            requests.append(dist.isend(x[:, :, -1:].contiguous(), peer, group=self.group))
            requests.append(dist.irecv(below, peer, group=self.group))
        for request in requests:
            request.wait()
        return torch.cat([above, x, below], dim=_ROWS)

    def with_row_below(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the first row of the band below (zeros under the image's last row)."""
        below = x.new_zeros((*x.shape[:_ROWS], 1, *x.shape[_ROWS + 1 :]))
        requests = []
        if self.rank > 0:
            peer = dist.get_global_rank(self.group, self.rank - 1)
            requests.append(dist.isend(x[:, :, :1].contiguous(), peer, group=self.group))
        if self.rank < self.world - 1:
            peer = dist.get_global_rank(self.group, self.rank + 1)
            requests.append(dist.irecv(below, peer, group=self.group))
        for request in requests:
            request.wait()
        return torch.cat([x, below], dim=_ROWS)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


def _conv(module: nn.Conv2d, bands: _Bands, x: torch.Tensor) -> torch.Tensor:
    """A 3x3 convolution (padding 1) of the band with its halo rows: the rows need no padding then."""
    return F.conv2d(bands.with_halo(x), module.weight, module.bias, 1, (0, 1))


def _downsample(module: nn.Module, bands: _Bands, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Diffusers' Downsample2D (pad one column right and one row below, 3x3 stride 2) of an even band:
    the row below is the next band's first."""
    x = F.pad(bands.with_row_below(x), (0, 1, 0, 0))
    return F.conv2d(x, module.conv.weight, module.conv.bias, stride=2)


def _group_norm(module: nn.GroupNorm, bands: _Bands, x: torch.Tensor) -> torch.Tensor:
    """GroupNorm with the statistics of the whole image (float32 mean, then the squared deviations around
    it), applied as PyTorch's kernel applies them: ``x * scale + shift`` per channel."""
    batch, channels, groups = x.shape[0], x.shape[1], module.num_groups
    grouped = x.reshape(batch, groups, -1).float()
    count = bands.sum(torch.tensor([float(grouped.shape[-1])], device=x.device))
    mean = bands.sum(grouped.sum(-1)) / count
    variance = bands.sum((grouped - mean[..., None]).pow(2).sum(-1)) / count
    per_channel = channels // groups
    scale = torch.rsqrt(variance + module.eps).repeat_interleave(per_channel, dim=1)
    mean = mean.repeat_interleave(per_channel, dim=1)
    if module.affine:
        scale = scale * module.weight.float()
    shift = -mean * scale + (module.bias.float() if module.affine else 0.0)
    return (x.float() * scale[:, :, None, None] + shift[:, :, None, None]).to(x.dtype)


def _whole_attention(module: nn.Module, bands: _Bands, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Runs the attention on the gathered image (with its own norm unsplit) and keeps this band."""
    counts = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(bands.world)]
    dist.all_gather(counts, torch.tensor([x.shape[_ROWS]], device=x.device), group=bands.group)
    sizes = [int(count) for count in counts]
    whole = all_gather_sizes(x, _ROWS, sizes, bands.group)
    with _unsplit(module):
        out = type(module).forward(module, whole, *args, **kwargs)
    return out.narrow(_ROWS, sum(sizes[: bands.rank]), sizes[bands.rank])


_UNSPLIT = "_omni_unsplit"


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
def _split_layers(coder: nn.Module, bands: _Bands) -> Iterator[None]:
    """For one call: the convolutions, downsamplings, GroupNorms and attention run band-aware."""
    patched = []
    for module in coder.modules():
        if isinstance(module, nn.Conv2d) and module.kernel_size == (3, 3) and module.stride == (1, 1):
            patched.append((module, functools.partial(_conv, module, bands)))
        elif type(module).__name__ == "Downsample2D":
            patched.append((module, functools.partial(_downsample, module, bands)))
        elif isinstance(module, nn.GroupNorm):
            patched.append((module, functools.partial(_group_norm, module, bands)))
        elif type(module).__name__ == "Attention":
            patched.append((module, functools.partial(_whole_attention, module, bands)))
    try:
        for module, forward in patched:
            module.forward = forward
        yield
    finally:
        for module, _ in patched:
            module.__dict__.pop("forward", None)
