"""ExactProjectionCache: reuse a projection's output when its input and weights are bit-for-bit the same.

Diffusion models project the same conditioning again and again: the text K/V of cross-attention at every
step, AdaLN modulation for a timestep schedule that repeats across requests with the same prompt, a
timestep embedding shared by both CFG branches. This cache stores the actual outputs and hands them back
only when reuse is provably exact:

* the conditioning tensor matches a stored one bit for bit (compared on the device as integers, so NaN
  payloads and signed zeros count, and no hash can collide);
* the projection name matches and the module's parameters and buffers are the very tensors, storage and
  version counters seen when the output was stored, and its LoRA layers have the same active, merged,
  disabled adapters and scales (an in-place edit, through ``.data`` too (see ``utils.watched``), a
  ``load_state_dict``, a dtype or device move, any adapter change each invalidate);
* the numerical settings at the ``project`` call are the same (autocast, matmul precision, TF32 and
  reduced-precision reduction flags);
* the returned tensor was not modified since (its version counter is checked before every hit).

A conditioning tensor is compared once per forward (``begin_forward``), however many projections read it.
The original computation runs whenever reuse cannot be proven: gradients enabled, compiling, any forward
hook on the module or its children or a global one, or weights without a version counter (inference-mode
tensors). ``describe`` counts these calls, and dropped outputs, by reason: under offload and layerwise
casting, whose hooks load or cast the weights anew at every call, nothing can be reused.

Cost: ``prepare`` compares the conditioning with every stored one of the same shape in one device
operation and reads the verdict back: one host synchronisation per prepared tensor. ``project`` does host-side checks only: no
synchronisation, no device work on a hit.

Admission: entries are admitted while they fit the byte budget and are never evicted to make room. A
denoising schedule is a cycle (step 1..N, then again for the next request); when the cycle does not fit,
LRU or FIFO evict each entry just before its reuse and hit nothing, while a frozen set keeps hitting on the
part that fits. Invalid entries are dropped as soon as they are seen, which frees room for new ones; and
those stored under weights that can never come back (freed, or written since: a dtype or device move, a
``load_state_dict``), whose conditioning may never be seen again (it is computed from those weights too),
are dropped with their conditioning at the projection's next miss (at the move itself where the module
moved: ``drop_moved``), so that they hold neither memory nor the budget that the new weights' outputs need.

Forwards from several threads at once (a server calling one pipeline, pipelines sharing the transformer)
share the stored outputs; each thread's forward compares its own conditioning, and the bookkeeping is
locked (never around ``compute``, which may be a collective).

Under tensor or sequence parallelism a projection may be a collective (a row-split linear, the split AdaLN
modulation): ``agree_over`` makes the ranks decide every hit together, so one rank's miss is every rank's.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..forward_hooks import global_hooks_active, has_hooks
from ..utils.module_settings import settings
from ..utils.precision import float32_precision
from ..utils.watched import Watcher, weight_version

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_PREPARED = 64

# Why a call computes without the cache (``bypass_reasons``), or a stored output was dropped (``stale``): said
# in ``describe``, since under offload or layerwise casting the cache cannot reuse anything.
GRADIENTS = "gradients enabled (the output must carry them)"
GLOBAL_HOOK = "a global forward hook (it must see the projection run)"
HOOKED = (
    "a hook on the projection's module or below it (sequential or leaf-level offload, layerwise casting, "
    "a user's hook) decides what it computes at each call"
)
INFERENCE_WEIGHTS = "its weights were made under inference mode (no version counter to check them by)"
UNPREPARED = "its conditioning could not be compared (made under inference mode, or written since compared)"
WEIGHTS_CHANGED = (
    "its module's weights or code changed since it was stored (offload loads the weights anew: group offload "
    "at each call, model offload at each request; layerwise casting casts them at each call; or an edit, "
    "load_state_dict, an adapter change): reuse needs the very tensors, unwritten"
)
NUMERICS_CHANGED = "the numerical settings changed since it was stored (autocast, matmul precision)"
OUTPUT_WRITTEN = "the output handed out was written in place since"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern as integers, so equality is bitwise (NaN == NaN, -0.0 != 0.0)."""
    t = t.detach()
    if t.is_floating_point() or t.is_complex():
        t = t.contiguous().view(_INT_VIEW[t.element_size()])
    return t


def _numerics(device_type: str) -> tuple:
    """Every global setting that can change a projection's result, captured at each call."""
    return (
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None,
        float32_precision(),
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", None),
    )


def _adapter_state(module: nn.Module) -> tuple:
    """What decides a LoRA layer's effective weight besides its tensors (peft's layer attributes)."""
    return (
        tuple(module.active_adapters),
        module.disable_adapters,
        tuple(module.merged_adapters),
        tuple(sorted(module.scaling.items())),
        tuple(sorted(getattr(module, "lora_variant", {}))),
    )


class _Alive:
    """A tensor of a module's state: equal to another only while both name the very same tensor, alive. An
    id and an address alone could be those of a freed tensor, reused by a new one with other values
    (parameters replaced twice, ``load_state_dict(assign=True)``)."""

    __slots__ = ("ref",)
    __hash__ = None  # states are compared, never keyed on

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ref = weakref.ref(tensor)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Alive) and (tensor := self.ref()) is not None and tensor is other.ref()


def _module_state(module: nn.Module, watched: Watcher | None = None) -> tuple | None:
    """Identity, storage and version of every parameter and buffer, each submodule's class, forward and
    settings, and the state of every adapter layer; None if a tensor has no version counter. With
    ``watched``, parameters start counting ``.data`` use."""
    state = []
    for t in (*module.parameters(), *module.buffers()):
        if t.is_inference():
            return None
        if watched is not None:
            watched.watch(t)
        state.append((_Alive(t), t.data_ptr(), weight_version(t), t.dtype, t.device, t.shape))
    for m in module.modules():  # and the code: a class forward patched, a submodule replaced, an eps set
        state.append((type(m), type(m).forward, m.__dict__.get("forward"), settings(m)))
        if hasattr(m, "lora_A") and hasattr(m, "scaling"):
            state.append(_adapter_state(m))
    return tuple(state)


def _outlived(module_state: tuple) -> bool:
    """Whether ``module_state`` can never be its module's again: one of its tensors was freed, or written
    since (version counters and ``.data`` uses only grow). A replaced tensor still alive may be put back."""
    for record in module_state:
        if isinstance(record[0], _Alive):
            tensor = record[0].ref()
            if tensor is None or weight_version(tensor) != record[2]:
                return True
    return False


@dataclass
class _Entry:
    output: torch.Tensor
    output_version: int
    module_state: tuple
    numerics: tuple
    nbytes: int

    def stale_reason(self, module_state: tuple, numerics: tuple) -> str | None:
        """Why the output cannot be reused with the module's ``module_state`` under ``numerics``; None if it
        can (output untouched, module and settings unchanged)."""
        if self.output._version != self.output_version:
            return OUTPUT_WRITTEN
        if module_state != self.module_state:
            return WEIGHTS_CHANGED
        return NUMERICS_CHANGED if numerics != self.numerics else None


@dataclass
class _Prepared:
    tensor: weakref.ref
    version: int
    cond_id: int | None  # None: not stored (over budget), so nothing under it can be stored either
    reuse: bool  # held before this call: its stored outputs may be returned


def _prepared_key(conditioning: torch.Tensor) -> tuple[int, int]:
    return threading.get_ident(), id(conditioning)


class ExactProjectionCache:
    """See the module docstring. One instance per model; ``max_bytes=0`` disables it at no cost."""

    def __init__(self, max_bytes: int = 256 * 1024**2) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
            raise TypeError(f"max_bytes must be an int number of bytes, got {max_bytes!r}.")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0 disables the cache), got {max_bytes}.")
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.bypasses = 0
        self.bypass_reasons: Counter[str] = Counter()
        self.stale: Counter[str] = Counter()  # stored outputs dropped, by why
        self._conds: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
        self._entries: dict[tuple[int, str], _Entry] = {}
        self._keys: dict[str, set[tuple[int, str]]] = {}  # each projection's entries
        self._stored_under: dict[str, tuple] = {}  # the module state each projection last stored under
        self._cond_entries: Counter[int] = Counter()  # entries per stored conditioning
        self._cond_buckets: dict[int, tuple] = {}  # each stored conditioning's bucket key
        # (thread, id of the tensor) -> its comparison: each thread's forward compares its own conditioning
        self._prepared: dict[tuple[int, int], _Prepared] = {}
        self._lock = threading.RLock()
        self._next_id = 0
        self._bytes = 0
        self._watched = Watcher()
        self._group: dist.ProcessGroup | None = None

    def __deepcopy__(self, memo: dict) -> ExactProjectionCache:
        # Stored outputs belong to the original model's weights: a copy starts empty. Under a layout it
        # decides with the same ranks, over the same group (a deep copy shares the process groups).
        twin = ExactProjectionCache(self.max_bytes)
        twin.agree_over(self._group)
        return twin

    def __reduce__(self):
        return ExactProjectionCache, (self.max_bytes,)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def clear(self) -> None:
        """Drops every stored conditioning and output (counters are kept) and stops watching parameters."""
        with self._lock:
            self._watched.release()
            self._conds.clear()
            self._entries.clear()
            self._keys.clear()
            self._stored_under.clear()
            self._cond_entries.clear()
            self._cond_buckets.clear()
            self._prepared.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "bypasses": self.bypasses,
            "stale": sum(self.stale.values()),
            "entries": len(self._entries),
            "bytes_used": self._bytes,
            "max_bytes": self.max_bytes,
        }

    @staticmethod
    def _must_bypass() -> bool:
        return torch.is_grad_enabled() or torch.compiler.is_dynamo_compiling()

    def prepare(self, conditioning: torch.Tensor) -> None:
        """Matches ``conditioning`` against the stored ones (one host sync)."""
        if not self.enabled or self._must_bypass() or conditioning.is_inference():
            return
        bits = _bits(conditioning)
        bucket_key = (tuple(bits.shape), bits.dtype, bits.device)
        with self._lock:  # matched and admitted at once: two threads' equal or new tensors get one id each
            bucket = self._conds.get(bucket_key, [])
            local = self._match(bits, bucket)
            cond_id = self._admit_conditioning(bucket_key, bits) if local is None else bucket[local][0]
            if len(self._prepared) >= _MAX_PREPARED:
                self._prepared.pop(next(iter(self._prepared)))
            self._prepared[_prepared_key(conditioning)] = _Prepared(
                weakref.ref(conditioning), conditioning._version, cond_id, reuse=local is not None
            )

    def begin_forward(self) -> None:
        """A forward of the model begins: each conditioning tensor is compared again at its first
        ``ensure_prepared``. A tensor that comes back may have been written where its version counter
        cannot see (through ``.data``, or a NumPy array sharing its memory) since an earlier forward. Only this
        thread's: another thread's forward in flight keeps its own."""
        thread = threading.get_ident()
        with self._lock:
            for key in [key for key in self._prepared if key[0] == thread]:
                del self._prepared[key]

    def ensure_prepared(self, conditioning: torch.Tensor) -> None:
        """``prepare`` unless this very tensor, unmodified, was already prepared in this forward (see
        ``begin_forward``; a host-side check), so a tensor fed to many projections costs one comparison."""
        prepared = self._prepared.get(_prepared_key(conditioning))
        if (
            prepared is None
            or prepared.tensor() is not conditioning
            or prepared.version != conditioning._version
        ):
            self.prepare(conditioning)
        elif not prepared.reuse and prepared.cond_id is not None:
            prepared.reuse = True  # stored when first seen (a miss then): reusable from now on

    def _match(self, bits: torch.Tensor, bucket: list[tuple[int, torch.Tensor]]) -> int | None:
        """Index of the stored conditioning equal to ``bits``, or None."""
        if not bucket:
            return None
        stored = torch.stack([b for _, b in bucket])
        equal = (stored == bits.unsqueeze(0)).flatten(1).all(dim=1)
        index = int(torch.where(equal.any(), equal.int().argmax(), -1).item())
        return None if index < 0 else index

    def _admit_conditioning(self, bucket_key: tuple, bits: torch.Tensor) -> int | None:
        nbytes = bits.numel() * bits.element_size()
        if self._bytes + nbytes > self.max_bytes:
            return None
        cond_id = self._next_id
        self._next_id += 1
        self._conds.setdefault(bucket_key, []).append((cond_id, bits.clone()))
        self._cond_buckets[cond_id] = bucket_key
        self._bytes += nbytes
        return cond_id

    def agree_over(self, group: dist.ProcessGroup | None) -> None:
        """Under a parallel layout whose projections are collectives (a row-split linear's all-reduce, the
        split modulation's all-gather): every ``project`` call then decides with all ranks of ``group``
        together, hitting only where every rank would, so a miss on one rank (its entry invalidated, its
        budget full, a hook on its module) has every rank compute instead of some waiting in a collective
        the others skip. ``group`` must take CPU tensors (gloo): the verdict is host data, agreed without
        touching a device stream. None: each rank decides alone."""
        self._group = group

    def project(
        self, name: str, module: nn.Module, conditioning: torch.Tensor, compute: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """``compute()``'s result, reused when provably identical. ``compute`` must depend only on
        ``conditioning``, ``module``'s weights and fixed preprocessing."""
        if (
            not self.enabled or torch.compiler.is_dynamo_compiling()
        ):  # a traced graph must not depend on cache state
            return compute()
        prepared = self._prepared.get(_prepared_key(conditioning))
        bypass = self._bypass_reason(module, conditioning, prepared)
        entry = key = numerics = None
        with self._lock:
            module_state = None if bypass else _module_state(module, self._watched)
            if module_state is not None:
                numerics = _numerics(conditioning.device.type)
                key = (prepared.cond_id, name)
                entry = self._entries.get(key)
                stale = entry.stale_reason(module_state, numerics) if entry is not None else None
                if stale is not None:
                    self.stale[stale] += 1
                    self._drop(key)
                    entry = None
        if self._agreed(entry is not None and prepared.reuse):  # a collective: outside the lock
            with self._lock:
                self.hits += 1
            return entry.output
        with self._lock:
            if module_state is None:
                self.bypasses += 1
                self.bypass_reasons[bypass or INFERENCE_WEIGHTS] += 1
            else:
                if entry is not None:  # valid, but not yet reusable here or not on every rank: computed again
                    self._drop(key)
                self.misses += 1
                self._drop_outlived(name, module_state)
        if module_state is None:
            return compute()
        output = self._lookup_precomputed(name, module, conditioning)
        if output is None:
            output = compute()
        if prepared.cond_id is not None:
            with self._lock:
                self._admit_entry(key, output, module, module_state, numerics)
        return output

    def _bypass_reason(
        self, module: nn.Module, conditioning: torch.Tensor, prepared: _Prepared | None
    ) -> str | None:
        """Why this call computes without the cache, short of reading the module's state; None: it may not."""
        if self._must_bypass():
            return GRADIENTS
        if (
            prepared is None
            or prepared.tensor() is not conditioning
            or prepared.version != conditioning._version
        ):
            return UNPREPARED
        if global_hooks_active():
            return GLOBAL_HOOK
        return HOOKED if has_hooks(module) else None

    def _agreed(self, hit: bool) -> bool:
        """``hit`` on every rank of the agreement group (this rank's ``hit`` without one)."""
        if self._group is None:
            return hit
        verdict = torch.tensor([int(hit)], dtype=torch.int32)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=self._group)
        return bool(verdict.item())

    def _admit_entry(
        self,
        key: tuple[int, str],
        output: torch.Tensor,
        module: nn.Module,
        module_state: tuple,
        numerics: tuple,
    ) -> None:
        nbytes = output.numel() * output.element_size()
        # an output made under inference mode has no version counter to check a later use against
        if self._bytes + nbytes > self.max_bytes or output.is_inference():
            return
        entry = _Entry(output.detach(), output._version, module_state, numerics, nbytes)
        self._entries[key] = entry
        self._keys.setdefault(key[1], set()).add(key)
        self._stored_under[key[1]] = module_state
        self._cond_entries[key[0]] += 1
        self._bytes += nbytes

    def _drop(self, key: tuple[int, str]) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:  # another thread's call dropped it first
            return
        self._bytes -= entry.nbytes
        self._keys[key[1]].discard(key)
        self._cond_entries[key[0]] -= 1

    def drop_moved(self) -> None:
        """The module moved (``Module.to`` another dtype or device, ``omni_accel.moves``): drops every output
        stored under weights that can never come back, and the conditionings left with none, now rather than
        at each projection's next miss, so that a model moved off its GPU leaves nothing there."""
        with self._lock:
            self._drop_moved()

    def _drop_moved(self) -> None:
        for name, stored_under in list(self._stored_under.items()):
            if _outlived(stored_under):
                self._drop_outlived_entries(name)
                kept = [self._entries[key].module_state for key in self._keys[name]]
                if kept:
                    self._stored_under[name] = kept[-1]
                else:
                    del self._stored_under[name]

    def _drop_outlived(self, name: str, module_state: tuple) -> None:
        """A miss of projection ``name`` under ``module_state``: if the state it last stored under can never
        come back, drops its entries stored under such states, and the conditionings left with no entry
        (unless compared in this forward). Their conditioning, computed from the old weights too, may never
        be seen again, and would otherwise keep them, and the budget they take, for good. One check of a
        few tensors per miss; a scan of the projection's entries only once its weights changed."""
        stored_under = self._stored_under.get(name)
        if stored_under is None or not _outlived(stored_under):
            return
        self._drop_outlived_entries(name)
        self._stored_under[name] = module_state

    def _drop_outlived_entries(self, name: str) -> None:
        """Drops the entries of projection ``name`` stored under states that can never come back, and the
        conditionings they leave with no entry (unless compared in this forward)."""
        emptied = set()
        for key in [k for k in self._keys[name] if _outlived(self._entries[k].module_state)]:
            self._drop(key)
            self.stale[WEIGHTS_CHANGED] += 1
            if not self._cond_entries[key[0]]:
                emptied.add(key[0])
        emptied -= {p.cond_id for p in self._prepared.values() if p.tensor() is not None}
        for cond_id in emptied:
            del self._cond_entries[cond_id]
            bucket_key = self._cond_buckets.pop(cond_id)
            bucket = self._conds[bucket_key]
            (index,) = [i for i, (stored_id, _) in enumerate(bucket) if stored_id == cond_id]
            _, bits = bucket.pop(index)
            self._bytes -= bits.numel() * bits.element_size()
            if not bucket:
                del self._conds[bucket_key]

    def _lookup_precomputed(
        self, name: str, module: nn.Module, conditioning: torch.Tensor
    ) -> torch.Tensor | None:
        """Extension point for validated offline results; consulted on a runtime miss.

        An override returns the exact output ``compute()`` would give, or None. Artifact validation and
        weight binding are the override's job."""
        return None
