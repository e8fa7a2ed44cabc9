"""HunyuanVideo 1.5 without native blocks: its joint attention given the key mask its dense mask expands.

Diffusers' processor of this model's blocks expands the text padding into a dense ``[B, 1, S, S]`` mask in
every block (a valid query and a valid key), 1.25 G booleans a block at 480p and 81 frames, and only a
masked kernel takes such a mask. Every valid query attends over exactly the valid keys either way, and a
query with no valid key comes out zero (SDPA's convention, which Diffusers' output carries), so the
``[B, 1, 1, S]`` key mask with the padded queries' rows zeroed is the same function. Built once per forward
and handed to every block as one tensor (a forward pre-hook on each block), it lets the routing drop the
padded keys from the second block on (``attention/key_padding.py``): an unmasked kernel then serves.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers import transformer_hunyuan_video15 as diffusers_module
from torch import nn

from ..forward_hooks import OurHook
from ..utils.versions import version_of

_MASK_ARGUMENT = 3  # the block's forward(hidden_states, encoder_hidden_states, temb, attention_mask, ...)


class KeyMaskJointAttention:
    """The joint (video + text) attention of a HunyuanVideo 1.5 block over a ``[B, 1, 1, S]`` key mask.

    Takes the ``[B, L_text]`` text mask as Diffusers' processor does too (a direct call of the module)."""

    # Diffusers' ``set_attention_backend`` sets these on processors that have them, as on its own
    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        query = attn.norm_q(attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)))
        key = attn.norm_k(attn.to_k(hidden_states).unflatten(2, (attn.heads, -1)))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        if encoder_hidden_states is not None:
            text_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            text_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            text_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            if attn.norm_added_q is not None:
                text_query = attn.norm_added_q(text_query)
            if attn.norm_added_k is not None:
                text_key = attn.norm_added_k(text_key)
            query = torch.cat([query, text_query], dim=1)
            key = torch.cat([key, text_key], dim=1)
            value = torch.cat([value, text_value], dim=1)

        batch, tokens = query.shape[:2]
        mask = None if attention_mask is None else key_mask(attention_mask, tokens)
        out = diffusers_module.dispatch_attention_fn(  # looked up per call: the routing patches this name
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)
        # A padded query has no valid key: its row is zero, as under the dense mask. Only text rows can be
        # padded (``key_mask`` keeps every video token), so only they are multiplied.
        if encoder_hidden_states is None:
            return out if mask is None else out * mask.reshape(batch, tokens, 1)
        text_tokens = encoder_hidden_states.shape[1]
        hidden_states, encoder_hidden_states = out[:, :-text_tokens], out[:, -text_tokens:]
        if mask is not None:
            encoder_hidden_states = encoder_hidden_states * mask[..., -text_tokens:].reshape(
                batch, text_tokens, 1
            )
        if getattr(attn, "to_out", None) is not None:
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if getattr(attn, "to_add_out", None) is not None:
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


def key_mask(mask: torch.Tensor, tokens: int) -> torch.Tensor:
    """The ``[B, 1, 1, tokens]`` boolean key mask of a block: ``mask`` as it is where it is one already,
    else the ``[B, L_text]`` text mask with every video token (those before the text) kept."""
    if mask.ndim == 4:
        return mask
    kept = mask.new_ones(mask.shape[0], tokens - mask.shape[1], dtype=torch.bool)
    return torch.cat([kept, mask.bool()], dim=1).reshape(mask.shape[0], 1, 1, tokens)


class _OneMaskPerForward(OurHook):
    """Gives every block of a forward the same key-mask tensor, built from the text mask the model passes
    to each (the same tensor, unchanged, for all of them): kept per thread, for the last text mask seen."""

    def __init__(self) -> None:
        self._last = threading.local()

    def __deepcopy__(self, memo: dict) -> _OneMaskPerForward:
        return _OneMaskPerForward()  # a copied model's forwards pass their own masks

    def __reduce__(self):
        return _OneMaskPerForward, ()

    def __call__(self, block: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        in_args = len(args) > _MASK_ARGUMENT
        text_mask = args[_MASK_ARGUMENT] if in_args else kwargs.get("attention_mask")
        hidden_states = args[0] if args else kwargs.get("hidden_states")
        text = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
        if text_mask is None or text_mask.ndim != 2 or hidden_states is None or text is None:
            return None
        tokens = hidden_states.shape[1] + text.shape[1]
        key = (version_of(text_mask), tokens)
        last = getattr(self._last, "entry", None)
        if last is None or last[0]() is not text_mask or last[1] != key:
            last = (weakref.ref(text_mask), key, key_mask(text_mask, tokens))
            self._last.entry = last
        if in_args:
            return (*args[:_MASK_ARGUMENT], last[2], *args[_MASK_ARGUMENT + 1 :]), kwargs
        return args, {**kwargs, "attention_mask": last[2]}


def adapt(transformer: nn.Module) -> tuple[str, list[Callable[[], None]]]:
    """Gives ``transformer``'s blocks our joint attention and one key mask per forward; returns what
    ``describe`` says of it and the undos."""
    undo: list[Callable[[], None]] = []
    one_mask = _OneMaskPerForward()
    blocks = 0
    for block in transformer.modules():
        if not isinstance(block, diffusers_module.HunyuanVideo15TransformerBlock):
            continue
        if not isinstance(block.attn.processor, diffusers_module.HunyuanVideo15AttnProcessor2_0):
            continue  # a processor the user chose: theirs runs
        blocks += 1
        original = block.attn.processor
        attention = KeyMaskJointAttention()
        attention._attention_backend = original._attention_backend
        attention._parallel_config = original._parallel_config
        block.attn.processor = attention
        handle = block.register_forward_pre_hook(one_mask, with_kwargs=True)
        undo.append(lambda block=block, original=original, handle=handle: _undo(block, original, handle))
    note = (
        f"{blocks} transformer blocks attend over a key mask built once per forward instead of the dense "
        "[S, S] mask Diffusers' processor expands in every block (the same function)"
    )
    return note, undo


def _undo(block: nn.Module, original: Any, handle: torch.utils.hooks.RemovableHandle) -> None:
    """Gives the block Diffusers' processor back, with the backend and context-parallel config set on ours
    since (``set_attention_backend``, ``reset_attention_backend`` while accelerated), as Diffusers' would have
    them; a processor the user set since stays."""
    handle.remove()
    ours = block.attn.processor
    if not isinstance(ours, KeyMaskJointAttention):
        return
    for setting in ("_attention_backend", "_parallel_config"):
        if getattr(original, setting) is not getattr(ours, setting):
            setattr(original, setting, getattr(ours, setting))
    block.attn.processor = original
