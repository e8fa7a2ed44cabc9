"""Where attention's inputs are written, so that a layout's exchange needs no copy of its own.

A block's q/k kernel (``layers.qkv_norm_rope``) writes every head of q, k and v once anyway; told where each
head belongs (a ring's own K/V block, or under Ulysses each head group in the buffer of the rank that attends
over it, a peer's included) it writes there, and the exchange that would have packed and sent the heads is
done. Attention is then told so (``placement=``) and takes them from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Copy = tuple[torch.Tensor, torch.Tensor]
"""``(dst, src)``: a copy the layout makes once the pieces are written."""
HeadPieces = tuple[tuple[int, torch.Tensor], ...]
"""``(first head, destination)`` pairs covering a tensor's heads in order, each destination a
``[B, tokens, heads, D]`` view (maybe of a peer's memory) for the heads from ``first head`` on."""


@dataclass(frozen=True)
class Placement:
    """Where q, k and v of ``[B, tokens, heads, D]`` go (``q`` None: anywhere, a fresh tensor), the
    tensors attention is then called with (``attend_on``; its q None: the q written), and the copies the
    layout makes once they are written (``sends``: pieces staged for the copy engine). Under Ulysses in
    head stages those two are the first stage's, and ``later`` holds the other stages' pairs of them."""

    q: HeadPieces | None
    k: HeadPieces
    v: HeadPieces
    attend_on: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]
    sends: tuple[Copy, ...] = ()
    later: tuple[tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[Copy, ...]], ...] = ()

    def all_sends(self) -> list[tuple[Copy, ...]]:
        """Each stage's copies, in order."""
        return [self.sends, *(copies for _, copies in self.later)]

    def pieces(self, q: torch.Tensor) -> list[HeadPieces]:
        """The pieces of q, k and v, with ``q`` (the fresh tensor) where q may go anywhere."""
        return [((0, q),) if self.q is None else self.q, self.k, self.v]

    def written(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What attention takes once the pieces are written (``q``: the fresh tensor, if any)."""
        attend_q, k, v = self.attend_on
        return (q if attend_q is None else attend_q), k, v

    def place(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies ``[B, tokens, heads, D]`` tensors written elsewhere into their places (where no kernel
        wrote them there); returns ``written``."""
        for pieces, t in zip(self.pieces(q), (q, k, v), strict=True):
            for first, dst in pieces:
                if dst is not t:
                    dst.copy_(t.narrow(2, first, dst.shape[2]))
        return self.written(q)
