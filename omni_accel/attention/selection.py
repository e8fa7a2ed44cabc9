"""Per-site provider resolution: per_role[role] -> per_role[role_category] -> default -> platform best.

Each accelerated pipeline owns one ``AttentionSelector``; ``attention_scope`` overrides it inside a ``with``
block. Nothing is replaced globally, and every decision is kept for the report.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from ..utils.logging import get_logger
from .base import AttentionProvider, AttentionProviderError, AttentionRequest
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


@dataclass(frozen=True)
class AttentionConfig:
    """Which provider serves which attention site. ``"auto"`` means the best lossless provider available."""

    default: str = "auto"
    per_role: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
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
    provider: AttentionProvider
    reason: str

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
    if config is None:
        config = AttentionConfig(default=default or "auto", per_role=per_role or {})
    elif default is not None or per_role is not None:
        raise TypeError("attention_scope takes either a config or default/per_role, not both.")
    token = _SCOPED_CONFIG.set(config)
    try:
        yield config
    finally:
        _SCOPED_CONFIG.reset(token)


def current_scope() -> AttentionConfig | None:
    """The config of the innermost ``attention_scope`` around this call, if any."""
    return _SCOPED_CONFIG.get()


def resolve(config: AttentionConfig, role: str, category: str, request: AttentionRequest) -> Resolution:
    explicit = (
        (f"per_role[{role!r}]", config.per_role.get(role)),
        (f"per_role[{category!r}]", config.per_role.get(category)),
        ("default", config.default),
    )
    for source, name in explicit:
        if name is None:
            continue
        if name == "auto":
            break
        provider = get_provider(name)
        reasons = provider.reasons_against(request)
        if reasons:
            usable = [
                n
                for n in platform_preference(request.device_type, request.has_mask, request.kv_len)
                if not get_provider(n).reasons_against(request)
            ]
            raise AttentionProviderError(
                f"Attention provider {name!r}, chosen by {source} for role {role!r}, cannot serve this call "
                f"({request.describe()}): {'; '.join(reasons)}. Choose a provider that can "
                f"(here: {', '.join(map(repr, usable))}) or 'auto'."
            )
        return Resolution(provider, f"{source} = {name!r}")

    skipped = []
    for name in platform_preference(request.device_type, request.has_mask, request.kv_len):
        provider = get_provider(name)
        reasons = provider.reasons_against(request)
        if not reasons:
            note = f"; skipped {'; '.join(skipped)}" if skipped else ""
            return Resolution(provider, f"auto: best lossless provider for {request.device_type}{note}")
        skipped.append(f"{name} ({', '.join(reasons)})")
    raise AttentionProviderError(
        f"No attention provider can serve {request.describe()}: {'; '.join(skipped)}."
    )


_ALL_SELECTORS: list[weakref.ref] = []


class AttentionSelector:
    """Resolves and remembers the provider of each (role, request); one per accelerated model."""

    def __init__(self, config: AttentionConfig | None = None) -> None:
        self.config = config or AttentionConfig()
        self._cache: dict[tuple, Resolution] = {}
        self.unrouted: dict[tuple[str, str], int] = {}
        self.served_without_mask: dict[str, int] = {}  # role -> calls whose key-padding mask was dropped
        # A number compiled graphs can carry to find this selector (see layers.attention).
        self.index = len(_ALL_SELECTORS)
        _ALL_SELECTORS.append(weakref.ref(self))

    def __reduce__(self):
        # Unpickled, a selector is a new one with the same config (its number and decisions are per process).
        return AttentionSelector, (self.config,)

    def resolve(self, role: str, category: str, request: AttentionRequest) -> Resolution:
        config = _SCOPED_CONFIG.get() or self.config
        key = (config, role, category, request)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = resolve(config, role, category, request)
            log = logger.warning if "skipped" in found.reason else logger.debug
            log("attention %s [%s] -> %s (%s)", role, request.describe(), found.name, found.reason)
        return found

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
        for (config, role, _, request), found in self._cache.items():
            reason = found.reason if config == self.config else f"attention_scope: {found.reason}"
            rows.add((role, request.describe(), found.name, reason))
        return sorted(rows)


def selector_by_index(index: int) -> AttentionSelector:
    selector = _ALL_SELECTORS[index]()
    if selector is None:
        raise RuntimeError("The accelerated model this compiled graph belonged to no longer exists.")
    return selector


_DEFAULT_SELECTOR = AttentionSelector()


def default_selector() -> AttentionSelector:
    """Used by layers that were built outside ``accelerate`` (e.g. directly in a test)."""
    return _DEFAULT_SELECTOR
