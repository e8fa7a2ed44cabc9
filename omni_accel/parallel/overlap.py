"""``Overlap``: what one attention call runs beside its exchanges, and where its output goes.

Under a layout that splits the sequence, attention's exchanges leave the compute units idle unless work
that does not depend on the attention runs meanwhile (a FLUX single block's MLP GEMM and its GELU). One
object carries that schedule from the block to the exchange that runs it, instead of optional arguments
threaded through every layer between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .copies import copy_rows_
from .placement import Placement


@dataclass(frozen=True)
class Overlap:
    """``beside()``: work that does not depend on the attention, run while its exchanges travel.
    ``then(beside's result)``: work on that result that does not depend on the attention either, run once
    the kernel has run, while the outputs travel back. ``out``: where the output goes (``[B, tokens, heads,
    Dv]``, maybe columns of a wider tensor), written there by the exchange itself where it can.
    ``placement``: q, k and v are where the layout's ``input_placement`` asked them to be written. The
    default overlaps nothing."""

    beside: Callable[[], object] | None = None
    then: Callable[[object], object] | None = None
    out: torch.Tensor | None = None
    placement: Placement | None = None

    def run_beside(self) -> object:
        """``beside()``'s result, None without it."""
        return None if self.beside is None else self.beside()

    def finish(self, o: torch.Tensor, done: object) -> tuple[torch.Tensor, object]:
        """Attention's output ``o`` written into ``out`` (if given), and ``then``'s result on ``done``
        (``beside``'s), where nothing travels back beside ``then``."""
        if self.out is not None:
            copy_rows_(self.out, o)
        return (o if self.out is None else self.out), (done if self.then is None else self.then(done))


NOTHING = Overlap()
