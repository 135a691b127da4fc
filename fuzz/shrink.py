"""Shrink a failing model: remove layers (and models from the array) while it still fails the same way."""
from __future__ import annotations

from typing import Callable

from .grammar import ModelSpec, render
from .harness import Outcome

__all__ = ["shrink"]


def shrink(spec: ModelSpec, outcome: Outcome, check: Callable[[ModelSpec, tuple], Outcome],
           max_checks: int = 60) -> tuple[ModelSpec, Outcome]:
    """The smallest spec found that still fails at the same stage with the same status (greedy: drop one layer
    at a time, last first, until no single removal keeps the failure; then the smallest B that still fails)."""
    def same(o: Outcome) -> bool:
        return o.status == outcome.status and o.stage == outcome.stage

    best, best_out, checks = _without_skipped(spec), outcome, 0
    Bs = (best_out.B,) if best_out.B else (1, 2, 3)
    changed = True
    while changed and checks < max_checks:
        changed = False
        for k in reversed(range(len(best.layers))):
            trial = _without_skipped(best.replace(layers=best.layers[:k] + best.layers[k + 1:]))
            o = check(trial, Bs)
            checks += 1
            if same(o):
                best, best_out, changed = trial, o, True
                break
    for B in range(1, best_out.B):
        o = check(best, (B,))
        if same(o):
            best_out = o
            break
    return best, best_out


def _without_skipped(spec: ModelSpec) -> ModelSpec:
    """The same model without the layers that do not apply to the shapes they meet (render leaves them out)."""
    source = render(spec).source
    k = 0
    while k < len(spec.layers):
        trial = spec.replace(layers=spec.layers[:k] + spec.layers[k + 1:])
        if render(trial).source == source:
            spec = trial
        else:
            k += 1
    return spec
