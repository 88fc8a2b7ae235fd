"""Policy specs: a routing policy's name with explicit parameters, ``"llm-d:prefix=6"``.

A spec is ``NAME`` or ``NAME:KEY=VALUE[:KEY=VALUE…]``; every parameter not named keeps the
policy's published default (see each policy's docstring in :mod:`.policies` for where the
default comes from). :class:`PolicyRegistry` is a read-only mapping from spec to constructor,
so code that looks a policy up by name (the fleet, the simulator) accepts a tuned variant
unchanged, while iterating it yields only the plain names. Specs are canonical
(:func:`format_spec` sorts keys and writes each value as ``repr(float(v))``), so equal
parameters give equal strings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from kvstrata.router.costs import CostProfile
from kvstrata.router.model import RoutingPolicy

Profiles = Callable[[str], CostProfile]
Builder = Callable[[Profiles, Mapping[str, float]], RoutingPolicy]


@dataclass(frozen=True, slots=True)
class PolicyKind:
    """How to build one policy from its parameters, and its published defaults."""

    build: Builder
    defaults: Mapping[str, float] = field(default_factory=dict)


def format_spec(name: str, params: Mapping[str, float] | None = None) -> str:
    """The canonical spec of ``name`` with ``params`` (sorted keys; no params: the name)."""
    if not params:
        return name
    return name + "".join(f":{key}={float(params[key])!r}" for key in sorted(params))


def parse_spec(spec: str) -> tuple[str, dict[str, float]]:
    """``(name, params)`` of a spec; raises ``KeyError`` when it is malformed."""
    name, *pairs = spec.split(":")
    params: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise KeyError(spec)
        try:
            params[key] = float(value)
        except ValueError as exc:
            raise KeyError(spec) from exc
    return name, params


class PolicyRegistry(Mapping[str, Callable[[Profiles], RoutingPolicy]]):
    """Spec → constructor; unknown names or parameters are missing keys."""

    def __init__(self, kinds: Mapping[str, PolicyKind]) -> None:
        self._kinds = dict(kinds)

    def __getitem__(self, spec: str) -> Callable[[Profiles], RoutingPolicy]:
        name, params = parse_spec(spec)
        kind = self._kinds[name]
        unknown = set(params) - set(kind.defaults)
        if unknown:
            raise KeyError(f"{spec}: unknown parameters {sorted(unknown)}")
        merged = {**kind.defaults, **params}
        return lambda profiles: kind.build(profiles, merged)

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds)

    def __len__(self) -> int:
        return len(self._kinds)

    def defaults(self, name: str) -> dict[str, float]:
        """The published default parameters of policy ``name`` (empty: it has none)."""
        return dict(self._kinds[name].defaults)
