"""One registry class for the op catalogs: the fusion rules (``core.rules.RULES``, ``@rule``), the standard forms of
onnxfuse's own ops (``core.standard.STANDARD_FORMS``, ``@standard_form``), ONNX Runtime's legalization rewrites
(``runtime.ort.legalize.REWRITES``, ``@rewrite``) and the torch kernels (``runtime.torch.kernels.OPS``, ``@op``).

A :class:`Registry` maps (domain, op type) to one entry; the default domain is ``""`` (``"ai.onnx"`` is the same
domain, :func:`op_key`). ``registry.register(*op_types)`` decorates the one function that handles those op types;
a second registration of an op type fails naming both functions, before anything is registered. Lookup is by key
(it is a mapping) or by node (:meth:`Registry.lookup`); :meth:`Registry.names` lists the op types.

    KERNELS = Registry("torch kernel")

    @KERNELS.register("Relu", "LeakyRelu")
    def relu(spec): ...

    KERNELS.lookup(node)        # the entry for node's (domain, op type), or None
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any, Generic, TypeVar

import onnx

__all__ = ["Registry", "op_key", "op_names"]

T = TypeVar("T")
Key = tuple[str, str]


def op_key(node: onnx.NodeProto) -> Key:
    """(domain, op type) of ``node``, the default domain as ``""`` (whether the node says ``""`` or ``"ai.onnx"``)."""
    return ("" if node.domain == "ai.onnx" else node.domain, node.op_type)


def op_names(keys: Iterable[Key]) -> list[str]:
    """The op types of (domain, op type) keys (a table's), sorted (``domain::op`` outside the default domain)."""
    return sorted(op if not domain else f"{domain}::{op}" for domain, op in keys)


def _origin(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class Registry(MutableMapping[Key, T], Generic[T]):
    """(domain, op type) -> one entry of kind ``kind`` ("fusion rule", "legalization rewrite", "torch kernel": it
    names the entries in errors). Setting a key that is taken fails (deleting one is allowed: a test may take an
    entry out for a while, and ``monkeypatch.delitem`` puts it back)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[Key, T] = {}
        self._origins: dict[Key, str] = {}  # key -> the function that registered it, for the duplicate error
        self._removed: dict[Key, tuple[T, str]] = {}  # deleted entries, so that putting one back keeps its origin

    def register(self, *op_types: str, domain: str = "",
                 entry: Callable[[Callable, str], T] | None = None) -> Callable[[Callable], Callable]:
        """A decorator that registers the decorated function for every op type of ``op_types`` in ``domain``;
        ``entry(fn, op_type)`` makes the entry (default: the function itself). Returns the function unchanged."""

        def register(fn: Callable) -> Callable:
            entries = {op: (fn if entry is None else entry(fn, op)) for op in op_types}
            for op in entries:
                self._refuse_taken((domain, op), _origin(fn))
            for op, value in entries.items():
                self._entries[(domain, op)] = value
                self._origins[(domain, op)] = _origin(fn)
            return fn

        return register

    def _refuse_taken(self, key: Key, origin: str) -> None:
        if key in self._entries:
            name = key[1] if not key[0] else f"{key[0]}::{key[1]}"
            raise ValueError(f"two {self.kind}s for op type {name!r}: {self._origins[key]} and {origin}; "
                             f"remove one of them (each op type has one {self.kind})")

    def lookup(self, node: onnx.NodeProto) -> T | None:
        """The entry for ``node``'s domain and op type, or None."""
        return self._entries.get(op_key(node))

    def names(self) -> list[str]:
        """The registered op types, sorted (``domain::op`` outside the default domain)."""
        return op_names(self._entries)

    # ---- the mapping
    def __getitem__(self, key: Key) -> T:
        return self._entries[key]

    def get(self, key: Key, default: Any = None) -> Any:
        return self._entries.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __setitem__(self, key: Key, value: T) -> None:
        removed = self._removed.pop(key, None)
        origin = removed[1] if removed is not None and removed[0] is value else _origin(value)
        self._refuse_taken(key, origin)
        self._entries[key] = value
        self._origins[key] = origin

    def __delitem__(self, key: Key) -> None:
        self._removed[key] = (self._entries.pop(key), self._origins.pop(key))

    def __iter__(self) -> Iterator[Key]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self)} op types)"
