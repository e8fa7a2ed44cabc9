"""Per-site provider resolution: per_role[role] -> per_role[role_category] -> default -> Diffusers' process-wide
backend -> platform best.

Each accelerated pipeline owns one ``AttentionSelector``; ``attention_scope`` overrides it inside a ``with``
block. Where the active config leaves a role to "auto", a backend the user chose process-wide in Diffusers
(``diffusers_backend``) is honoured with the provider running the same kernel, or refused with a message.
Nothing is replaced globally, and every decision is kept for the report.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from .. import kernel_builds
from ..utils.logging import get_logger
from . import diffusers_backend
from .base import AttentionProvider, AttentionProviderError, AttentionRequest, KernelRefusal
from .registry import check_provider_name, get_provider, platform_preference

logger = get_logger(__name__)


class _FrozenMapping(Mapping):
    """A read-only mapping that, unlike ``MappingProxyType``, pickles and deep-copies."""

    def __init__(self, items: Mapping[str, str]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> str:
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(self._items)


def check_forms(default: object, per_role: object, where: str, one_everywhere: str) -> None:
    """``default`` is one provider name and ``per_role`` maps role or category names to provider names;
    else a TypeError naming the option (``where``: how the caller spells it, e.g. ``attention[{}]``) and
    the form expected (``one_everywhere``: how to give one provider to every site)."""
    example = "{'flux.single': 'sdpa', 'cross': 'auto'}"
    if not isinstance(default, str):
        raise TypeError(
            f"{where.format('default')} must be one provider name (a str, e.g. 'sdpa' or 'auto'), got "
            f"{default!r}."
        )
    option = where.format("per_role")
    if not isinstance(per_role, Mapping):
        raise TypeError(
            f"{option} must map role or category names to provider names, like {example}; got a "
            f"{type(per_role).__name__}: {per_role!r}. For one provider everywhere pass {one_everywhere}."
        )
    for role, name in per_role.items():
        if not isinstance(role, str) or not isinstance(name, str):
            raise TypeError(
                f"{option} maps each role or category (a str) to one provider name (a str), like {example}; "
                f"got {role!r}: {name!r}."
            )


@dataclass(frozen=True)
class AttentionConfig:
    """Which provider serves which attention site. ``"auto"`` means the best lossless provider available."""

    default: str = "auto"
    per_role: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_forms(self.default, self.per_role, "AttentionConfig.{}", "default='NAME'")
        check_provider_name(self.default, where="AttentionConfig.default")
        for role, name in self.per_role.items():
            check_provider_name(name, where=f"AttentionConfig.per_role[{role!r}]")
        object.__setattr__(self, "per_role", _FrozenMapping(self.per_role))
        # Hashed on every attention call (it keys the resolution cache): compute it once.
        object.__setattr__(self, "_hash", hash((self.default, tuple(sorted(self.per_role.items())))))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, AttentionConfig)
            and self.default == other.default
            and dict(self.per_role) == dict(other.per_role)
        )


@dataclass(frozen=True)
class Resolution:
    """The provider chosen for a request and why. ``fallbacks``: for an automatic choice, the other
    providers that can serve the request, in preference order, should the chosen kernel refuse a call's
    exact tensors (see ``AttentionProvider.refusal``). ``remedy``: for an explicit choice, what to change
    when its kernel refuses them (an explicit choice never falls back)."""

    provider: AttentionProvider
    reason: str
    fallbacks: tuple[str, ...] = ()
    remedy: str | None = None

    @property
    def name(self) -> str:
        return self.provider.name


_SCOPED_CONFIG: contextvars.ContextVar[AttentionConfig | None] = contextvars.ContextVar(
    "omni_accel_attention_scope", default=None
)


@contextlib.contextmanager
def attention_scope(
    config: AttentionConfig | None = None,
    *,
    default: str | None = None,
    per_role: Mapping[str, str] | None = None,
) -> Iterator[AttentionConfig]:
    """Overrides the attention choice of every accelerated model called inside the block."""
    if config is None:  # a falsy wrong value ("", []) is checked too, not taken for "not given"
        config = AttentionConfig(
            default="auto" if default is None else default, per_role={} if per_role is None else per_role
        )
    elif default is not None or per_role is not None:
        raise TypeError("attention_scope takes either a config or default/per_role, not both.")
    elif not isinstance(config, AttentionConfig):  # checked here: every call in the block would fail on it
        hint = (
            f" (one provider everywhere: attention_scope(default={config!r}))"
            if isinstance(config, str)
            else ""
        )
        raise TypeError(
            f"attention_scope's config must be an AttentionConfig, got {type(config).__name__} {config!r}; "
            f"or pass default='NAME' and/or per_role={{...}}{hint}."
        )
    token = _SCOPED_CONFIG.set(config)
    try:
        yield config
    finally:
        _SCOPED_CONFIG.reset(token)


def current_scope() -> AttentionConfig | None:
    """The config of the innermost ``attention_scope`` around this call, if any."""
    return _SCOPED_CONFIG.get()


_CHOOSE_ANOTHER = "Choose one of them for this role, or 'auto' (which falls back and records why)"


def _explicit(config: AttentionConfig, role: str, category: str) -> tuple[str, str] | None:
    """``(source, provider name)`` of the config's explicit choice for the role, or None for "auto"."""
    explicit = (
        (f"per_role[{role!r}]", config.per_role.get(role)),
        (f"per_role[{category!r}]", config.per_role.get(category)),
        ("default", config.default),
    )
    for source, name in explicit:
        if name is None:
            continue
        return None if name == "auto" else (source, name)
    return None


def _usable(request: AttentionRequest) -> list[str]:
    """The lossless providers, in ``auto``'s order, that can serve ``request``."""
    preference, _ = platform_preference(request)
    return [n for n in preference if not get_provider(n).reasons_against(request)]


def resolve(
    config: AttentionConfig,
    role: str,
    category: str,
    request: AttentionRequest,
    diffusers_choice: str | None = None,
) -> Resolution:
    """The provider for ``request``: the config's explicit choice for the role, else the provider running
    ``diffusers_choice`` (Diffusers' process-wide backend, ``diffusers_backend.explicit_choice()``), else
    the best lossless one. A choice that cannot serve the request raises, naming why and what would."""
    explicit = _explicit(config, role, category)
    if explicit is not None:
        source, name = explicit
        provider = get_provider(name)
        reasons = provider.reasons_against(request)
        if reasons:
            raise AttentionProviderError(
                f"Attention provider {name!r}, chosen by {source} for role {role!r}, cannot serve this call "
                f"({request.describe()}): {'; '.join(reasons)}. Choose a provider that can "
                f"(here: {', '.join(map(repr, _usable(request)))}) or 'auto'."
            )
        return Resolution(provider, f"{source} = {name!r}", remedy=_CHOOSE_ANOTHER)
    if diffusers_choice is not None:
        return _resolve_diffusers(diffusers_choice, role, request)

    skipped = []
    preference, waits = platform_preference(request)
    for index, name in enumerate(preference):
        provider = get_provider(name)
        reasons = provider.reasons_against(request)
        if not reasons:
            note = f"; skipped {'; '.join(skipped)}" if skipped else ""
            note += f" ({waits})" if waits else ""
            rest = tuple(n for n in preference[index + 1 :] if not get_provider(n).reasons_against(request))
            return Resolution(provider, f"auto: best lossless provider for {request.device_type}{note}", rest)
        skipped.append(f"{name} ({', '.join(reasons)})")
    raise AttentionProviderError(
        f"No attention provider can serve {request.describe()}: {'; '.join(skipped)}."
    )


def _resolve_diffusers(choice: str, role: str, request: AttentionRequest) -> Resolution:
    chosen = diffusers_backend.describe(choice)
    name = diffusers_backend.provider_for(choice)
    if name is None:
        raise AttentionProviderError(
            f"{diffusers_backend.no_provider(choice)}, but attention role {role!r} ({request.describe()}) runs "
            f"in omni_accel's own blocks here, which cannot run it. {diffusers_backend.how_to_change(choice)}."
        )
    provider = get_provider(name)
    reasons = provider.reasons_against(request)
    if reasons:
        raise AttentionProviderError(
            f"{chosen} runs provider {name!r}, which cannot serve attention role {role!r} "
            f"({request.describe()}): {'; '.join(reasons)}. {diffusers_backend.how_to_change(choice)}."
        )
    return Resolution(provider, chosen, remedy=diffusers_backend.how_to_change(choice))


# The categories every model may be given choices for: one config may serve pipelines with and without them.
CATEGORIES = frozenset({"self", "cross"})


class AttentionSelector:
    """Resolves and remembers the provider of each (role, request); one per accelerated model.
    ``sites``: the model's name and the role and category names of its attention sites, once known
    (``know_sites``): what a ``per_role`` key must name."""

    def __init__(
        self,
        config: AttentionConfig | None = None,
        sites: tuple[str, frozenset[str], frozenset[str]] | None = None,
    ) -> None:
        self.config = config or AttentionConfig()
        self.sites: tuple[str, frozenset[str], frozenset[str]] | None = None
        if sites is not None:
            self.know_sites(*sites)
        self._cache: dict[tuple, Resolution] = {}
        # The ids of the cached resolutions that served a call (one whose kernel refused every call did not).
        self._served: set[int] = set()
        self._refused: dict[tuple, Resolution] = {}  # who served calls whose resolved kernel refused them
        self.unrouted: dict[tuple[str, str], int] = {}
        self.served_without_mask: dict[str, int] = {}  # role -> calls whose key-padding mask was dropped

    def __reduce__(self):
        # Unpickled, a selector is a new one with the same config and sites (its decisions are per process).
        return AttentionSelector, (self.config, self.sites)

    def know_sites(self, model: str, roles: Iterable[str], categories: Iterable[str]) -> None:
        """Records the roles and categories of ``model``'s attention sites, against which the ``per_role``
        keys of an ``attention_scope`` are checked at its first call inside one."""
        self.sites = (model, frozenset(roles), frozenset(categories))
        _WITH_SITES.add(self)

    def resolve(self, role: str, category: str, request: AttentionRequest) -> Resolution:
        """The provider for ``request`` (cached per config, Diffusers' choice, role and request), for a
        caller that then calls it: the decision is reported."""
        _, found = self._resolve(role, category, request)
        self._served.add(id(found))
        return found

    def _resolve(
        self, role: str, category: str, request: AttentionRequest, follows_backend: bool = True
    ) -> tuple[tuple, Resolution]:
        config = _SCOPED_CONFIG.get() or self.config
        choice = diffusers_backend.explicit_choice() if follows_backend else None
        key = (config, role, category, request, choice, kernel_builds.generation())
        found = self._cache.get(key)
        if found is None:
            if config is not self.config and self.sites is not None:
                _check_scope_roles(config)
            found = self._cache[key] = resolve(config, role, category, request, choice)
            log = logger.warning if "skipped" in found.reason else logger.debug
            log("attention %s [%s] -> %s (%s)", role, request.describe(), found.name, found.reason)
        return key, found

    def attend(
        self,
        role: str,
        category: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
        return_lse: bool = False,
        follows_backend: bool = True,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention over BSHD tensors through the provider resolved for the call. Where that provider's
        kernel refuses these exact tensors (what a request cannot tell: cuDNN under deterministic
        algorithms, or over one token; the provider raises ``KernelRefusal`` before launching anything), an
        automatic choice serves them with the next provider that takes them and records why; an explicit
        one raises, naming what would serve. ``follows_backend``: False for a call site whose Diffusers code
        never reads Diffusers' process-wide backend (a processor calling torch's SDPA itself)."""
        request = AttentionRequest.for_call(query, key, has_mask=attn_mask is not None, needs_lse=return_lse)
        cache_key, found = self._resolve(role, category, request, follows_backend)
        try:
            out = found.provider.forward(
                query, key, value, attn_mask=attn_mask, scale=scale, return_lse=return_lse
            )
        except KernelRefusal as refused:
            tensors = (query, key, value, attn_mask)
            instead = self._instead(found, cache_key, request, refused.reason, tensors).provider
            return instead.forward(query, key, value, attn_mask=attn_mask, scale=scale, return_lse=return_lse)
        self._served.add(id(found))  # an int's hash: the key's would hash the request again
        return out

    def _instead(
        self,
        found: Resolution,
        cache_key: tuple,
        request: AttentionRequest,
        refusal: str,
        tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    ) -> Resolution:
        """The provider serving a call whose resolved kernel refused its tensors (``refusal``)."""
        role = cache_key[1]
        for name in found.fallbacks:
            provider = get_provider(name)
            if provider.refusal(*tensors) is None:
                key = (*cache_key, refusal)
                instead = self._refused.get(key)
                if instead is None or instead.provider is not provider:
                    reason = f"{found.reason}; {found.name} refused {refusal}"
                    instead = self._refused[key] = Resolution(provider, reason)
                    logger.warning("attention %s [%s] -> %s (%s)", role, request.describe(), name, reason)
                return instead
        if found.remedy is None:  # automatic, and every other candidate refused too
            raise AttentionProviderError(
                f"No attention provider can serve role {role!r} ({request.describe()}): {found.name} refused "
                f"{refusal}, and so did {', '.join(found.fallbacks) or 'every other provider'}."
            )
        can = [n for n in _usable(request) if get_provider(n).refusal(*tensors) is None]
        raise AttentionProviderError(
            f"Attention provider {found.name!r} ({found.reason}) cannot serve role {role!r} here: it refused "
            f"{refusal}. Providers that can serve these tensors: {', '.join(map(repr, can)) or 'none'}. "
            f"{found.remedy}."
        )

    def unserved_reason(self, role: str, category: str) -> str | None:
        """Why Diffusers' own code must run this role's attention (``diffusers_backend.unserved_reason``),
        or None: also None where the active config names a provider for the role, which takes precedence
        over Diffusers' process-wide choice."""
        reason = diffusers_backend.unserved_reason()
        if reason is None or _explicit(_SCOPED_CONFIG.get() or self.config, role, category) is not None:
            return None
        return reason

    def note_unrouted(self, role: str, reason: str) -> None:
        """Counts a call left to Diffusers' own kernel, so the report can say which and why."""
        count = self.unrouted[(role, reason)] = self.unrouted.get((role, reason), 0) + 1
        if count == 1:
            logger.warning("attention %s runs Diffusers' own kernel: %s", role, reason)

    def note_served_without_mask(self, role: str) -> None:
        """Counts a call whose key-padding mask was served by dropping the padded keys."""
        self.served_without_mask[role] = self.served_without_mask.get(role, 0) + 1

    def decisions(self) -> list[tuple[str, str, str, str]]:
        """(role, request, provider, reason) for every distinct call seen so far; choices made under an
        ``attention_scope`` say so."""
        rows = set()
        served = [(key, found) for key, found in self._cache.items() if id(found) in self._served]
        for (config, role, _, request, *_), found in (*served, *self._refused.items()):
            reason = found.reason if config == self.config else f"attention_scope: {found.reason}"
            rows.add((role, request.describe(), found.name, reason))
        return sorted(rows)


# The selectors of the accelerated models alive (those whose sites are known): an ``attention_scope`` covers
# every one called inside it, so its ``per_role`` keys may name the roles of any of them.
_WITH_SITES: weakref.WeakSet[AttentionSelector] = weakref.WeakSet()


def unknown_roles(per_role: Iterable[str], selectors: Iterable[AttentionSelector]) -> list[str]:
    """The keys of ``per_role`` that name no role or category of the sites of ``selectors``' models."""
    known = set(CATEGORIES)
    for selector in selectors:
        if selector.sites is not None:
            known |= selector.sites[1] | selector.sites[2]
    return sorted(set(per_role) - known)


def sites_listing(selectors: Iterable[AttentionSelector]) -> str:
    """``model: roles [...], categories [...]`` for each distinct model of ``selectors``, for an error."""
    rows = {
        f"{model}: roles {sorted(roles)}, categories {sorted(categories)}"
        for model, roles, categories in (s.sites for s in selectors if s.sites is not None)
    }
    return "; ".join(sorted(rows)) or "none (no attention site of the pipeline runs through omni_accel)"


def _check_scope_roles(config: AttentionConfig) -> None:
    """An ``attention_scope`` whose ``per_role`` names a role no accelerated model has (a typo) would change
    nothing: raised at its first call inside the block, before any attention runs under it."""
    selectors = list(_WITH_SITES)
    unknown = unknown_roles(config.per_role, selectors)
    if unknown:
        raise ValueError(
            f"attention_scope's per_role names {unknown}, which no accelerated model has, so it would change "
            f"nothing. The accelerated models' attention sites: {sites_listing(selectors)}. Use one of those "
            f"roles or categories (the categories {sorted(CATEGORIES)} fit every model; describe(pipe) shows the "
            "role of each site), or leave the key out."
        )


_DEFAULT_SELECTOR = AttentionSelector()


def default_selector() -> AttentionSelector:
    """Used by layers that were built outside ``accelerate`` (e.g. directly in a test)."""
    return _DEFAULT_SELECTOR
