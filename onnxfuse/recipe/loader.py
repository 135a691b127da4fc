"""A torch ``DataLoader`` as a run's data (:class:`LoaderBatches`): every step trains on the loader's next batch,
drawn then, with the loader's own batch size, sampler, shuffle, workers, collate and augmentation; an epoch is
one ``iter(loader)``. Nothing is materialized.

A batch is what the loader yields: a tuple ``(x, y)`` (``(x1, x2, ..., y)`` for more graph inputs, in the
graph's input order; the label is left out for ``loss="model"``) or a dict by input name and ``labels``, as
``datasets.from_torch_dataset`` reads single samples. A per-model graph input (fused with ``per_model_inputs``),
and labels with ``per_model_labels``, is ``[N, B, ...]``: each sample holds every model's value, and the default
collate stacks samples on a new first axis; onnxfuse moves the model axis first (``[B, N, ...]``, the graph's).
Tensors are cast to the graph's dtypes where they are (no copy through numpy for the torch runtime).

Checks, one line each (``DataError``): the first batch as ``data.make_dataset`` checks arrays (names, shapes,
dtypes, integer labels; the caller adds its own, e.g. the label range), before anything is written; every
batch's shapes against the first batch's and, unless ``allow_nonfinite_data``, that its floating-point arrays are
finite (``torch.isfinite`` on the batch as the loader gives it, on the host: one pass over memory the collate has
just written, far cheaper than the collate).

Resume (``state_dict``/``load_state_dict``): the position is (epoch, batches trained on in it), plus batches
drawn ahead (a fresh run draws its verified first steps before training them). With it go the states of the
random number generators onnxfuse can see when the epoch began and at the checkpoint: torch's, numpy's and
Python's global ones, the loader's ``generator``, and any generator held by its sampler, batch sampler or dataset
(an attribute of theirs). A resumed run restores the epoch's start, makes the epoch's iterator, draws the batches
up to the position again (the skipped ones are loaded and thrown away: ``__getitem__`` runs for them), then
restores the generators to the checkpoint's states: the batches after the position are the uninterrupted run's,
shuffled or not, seeded or not, with workers or not, for augmentation that draws from those generators. Where
that cannot hold (``persistent_workers``: the workers' random state carries over from epoch to epoch), the run
resumes all the same and logs a warning that its data order differs. Randomness onnxfuse cannot see (a
generator held deeper inside the dataset) is not restored.
"""
from __future__ import annotations

import base64
import logging
import random
from collections import deque
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from onnxfuse.core.errors import ConfigError, DataError
from onnxfuse.recipe.data import check_finite, resolved_label_dtype
from onnxfuse.recipe.losses import AS_GIVEN, LABELS

__all__ = ["LoaderBatches", "is_loader", "loader_batch_size"]

log = logging.getLogger("onnxfuse.train")

Batch = dict


def is_loader(data: Any) -> bool:
    return isinstance(data, torch.utils.data.DataLoader)


def loader_batch_size(loader: torch.utils.data.DataLoader) -> int | None:
    """The loader's batch size: ``batch_size``, or its batch sampler's; None when it does not say."""
    if loader.batch_size is not None:
        return int(loader.batch_size)
    size = getattr(loader.batch_sampler, "batch_size", None)
    return int(size) if isinstance(size, (int, np.integer)) else None


# ---------------------------------------------------------------------------------- random number generators
_GLOBAL = ("torch", "numpy", "random")  # the process's global generators, named
_RNG_TYPES = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _bytes(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def _encode(v: Any) -> Any:
    """A numpy bit generator's state (nested dicts of ints and arrays) as JSON."""
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    if isinstance(v, np.ndarray):
        return {"ndarray": _b64(v.tobytes()), "dtype": v.dtype.str, "shape": list(v.shape)}
    return v


def _decode(v: Any) -> Any:
    if isinstance(v, dict) and "ndarray" in v:
        return np.frombuffer(_bytes(v["ndarray"]), dtype=v["dtype"]).reshape(v["shape"]).copy()
    if isinstance(v, dict):
        return {k: _decode(x) for k, x in v.items()}
    return v


def _mt(state: tuple) -> dict:  # numpy's legacy MT19937 state tuple
    _, keys, pos, has_gauss, gauss = state
    return {"keys": _b64(np.asarray(keys, np.uint32).tobytes()), "pos": int(pos), "has_gauss": int(has_gauss),
            "gauss": float(gauss)}


def _unmt(d: dict) -> tuple:
    return "MT19937", np.frombuffer(_bytes(d["keys"]), np.uint32).copy(), d["pos"], d["has_gauss"], d["gauss"]


def _py(state: tuple) -> dict:  # random.Random's (version, 625 words, gauss_next)
    version, words, gauss = state
    return {"version": version, "words": _b64(np.asarray(words, np.uint32).tobytes()), "gauss": gauss}


def _unpy(d: dict) -> tuple:
    return d["version"], tuple(int(w) for w in np.frombuffer(_bytes(d["words"]), np.uint32)), d["gauss"]


def _get_state(rng: Any) -> Any:
    if rng == "torch":
        return _b64(torch.get_rng_state().numpy().tobytes())
    if rng == "numpy":
        return _mt(np.random.get_state())
    if rng == "random":
        return _py(random.getstate())
    if isinstance(rng, torch.Generator):
        return _b64(rng.get_state().numpy().tobytes())
    if isinstance(rng, np.random.RandomState):
        return _mt(rng.get_state())
    if isinstance(rng, np.random.Generator):
        return _encode(rng.bit_generator.state)
    return _py(rng.getstate())


def _set_state(rng: Any, state: Any) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(_bytes(text)), dtype=torch.uint8)

    if rng == "torch":
        torch.set_rng_state(tensor(state))
    elif rng == "numpy":
        np.random.set_state(_unmt(state))
    elif rng == "random":
        random.setstate(_unpy(state))
    elif isinstance(rng, torch.Generator):
        rng.set_state(tensor(state))
    elif isinstance(rng, np.random.RandomState):
        rng.set_state(_unmt(state))
    elif isinstance(rng, np.random.Generator):
        rng.bit_generator.state = _decode(state)
    else:
        rng.setstate(_unpy(state))


def _generators(loader: torch.utils.data.DataLoader) -> list[Any]:
    """The generators that decide the loader's batches that onnxfuse can see (see the module docstring)."""
    found: list[Any] = list(_GLOBAL) + ([loader.generator] if loader.generator is not None else [])
    owners = (loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None), loader.dataset,
              getattr(loader.dataset, "dataset", None))  # a Subset's dataset
    for owner in owners:
        for v in (vars(owner).values() if hasattr(owner, "__dict__") else ()):
            if isinstance(v, _RNG_TYPES) and not any(v is f for f in found):
                found.append(v)
    return found


# -------------------------------------------------------------------------------------------------- the source
class LoaderBatches:
    """The batches of ``loader`` for an array of ``B`` models (see the module docstring).

    ``wanted``: what a batch must hold, in order: each graph input (``name``, ``dtype``, ``per_model``) and then
    ``labels`` when the loss takes them. ``check_first(arrays, where)`` checks the first batch, as numpy arrays
    with the model axis first (``data.make_dataset``'s checks, and the caller's); ``tensors``: hand the runtime
    torch tensors (the torch runtime) rather than numpy arrays."""

    def __init__(self, loader: torch.utils.data.DataLoader, wanted: Sequence[dict], B: int, name: str,
                 check_first: Callable[[dict[str, np.ndarray], str], None], tensors: bool,
                 check_nonfinite: bool = True):
        if loader.batch_sampler is None:
            raise ConfigError(f"{name} has batch_size=None (it yields single samples): give it a batch size, "
                              "e.g. DataLoader(dataset, batch_size=32)")
        self.loader, self.B, self.name, self.tensors = loader, B, name, tensors
        self.wanted = [dict(w) for w in wanted]
        self.check_first, self.check_nonfinite = check_first, check_nonfinite
        self.batch_size = loader_batch_size(loader)
        self.generators = _generators(loader)
        self._it: Iterator | None = None
        self._epoch, self._index = -1, 0  # the epoch of _it and the batches drawn from it
        self._starts: dict[int, list] = {}  # epoch -> the generators' states when its iterator was made
        self._ahead: deque[tuple[int, int, Batch]] = deque()  # drawn (peek), not trained on yet
        self._shapes: dict[str, tuple] | None = None  # the first batch's shapes, less the sample axis
        self._drawn = 0
        self.position = (0, 0)  # (epoch, batches of it trained on)

    # ---- what the run reads
    @property
    def batches_per_epoch(self) -> int | None:
        try:
            return len(self.loader)
        except TypeError:  # an iterable-style dataset without __len__
            return None

    def identity(self) -> str:
        """What the data hash reads of a loader: its contents are not read (that would load the data set), so a
        resumed run is refused only when the dataset's class or length, the batch size, the sampler's class or
        drop_last changed."""
        ds = self.loader.dataset
        try:
            n = str(len(ds))
        except TypeError:
            n = "iterable"
        sampler = self.loader.batch_sampler
        inner = getattr(sampler, "sampler", sampler)
        return (f"DataLoader:{type(ds).__module__}.{type(ds).__qualname__}:{n}:{self.batch_size}:"
                f"{type(sampler).__qualname__}:{type(inner).__qualname__}:{self.loader.drop_last}")

    def draw(self, models: Sequence[int]) -> Batch:
        epoch, index, batch = self._ahead.popleft() if self._ahead else self._fetch()
        self.position = (epoch, index)
        self._starts = {e: s for e, s in self._starts.items() if e >= epoch}
        return self._select(batch, models)

    def peek(self, k: int) -> list[Batch]:
        while len(self._ahead) < k:
            self._ahead.append(self._fetch())
        return [b for _, _, b in list(self._ahead)[:k]]

    def samples(self, batch: Batch) -> int:
        first = self.wanted[0]
        return int(batch[first["name"]].shape[1 if first.get("per_model") else 0])

    def keep(self, positions: Sequence[int]) -> None:
        pass  # every model draws the same batches: draw(models) takes the survivors' rows of per-model arrays

    def each(self, models: Sequence[int]) -> Iterator[Batch]:
        """One pass over the loader (a fresh iterator, the position untouched): evaluation."""
        self._drawn = 0
        for raw in self.loader:
            yield self._select(self._convert(raw), models)

    def check(self) -> None:
        """Check the loader's first batch (drawn from an iterator of its own, then dropped): evaluation data,
        before anything is written."""
        self._convert(next(iter(self.loader), None))

    # ---- position
    def state_dict(self) -> dict:
        epoch, index = self.position
        return {"loader": {"epoch": epoch, "batch": index, "ahead": len(self._ahead),
                           "start": self._starts.get(epoch), "now": self._capture()}}

    def load_state_dict(self, state: dict) -> None:
        st = state["loader"]
        self._it, self._ahead, self._starts = None, deque(), {}
        epoch, index = st["epoch"], st["batch"]
        restored = st["start"] is not None and self._restore(st["start"])
        self._epoch = epoch - 1
        for _ in range(index):  # the batches trained on before the checkpoint: drawn again and dropped
            raw = self._next_raw()[2]
            if self._shapes is None:  # the first one checked, as a fresh run checks its first
                self._convert(raw)
        for _ in range(st["ahead"]):
            self._ahead.append(self._fetch())
        self.position = (epoch, index)
        restored = self._restore(st["now"]) and (restored or st["start"] is None)
        why = self._inexact(epoch) or (None if restored else "the generators it draws from are not those it recorded")
        if why:
            log.warning("%s: the data order after this resume differs from an uninterrupted run's: %s", self.name,
                        why)

    def _inexact(self, epoch: int) -> str | None:
        if self.loader.num_workers > 0 and self.loader.persistent_workers and epoch > 0:
            return ("its persistent_workers carry their random state from epoch to epoch, which a resumed run "
                    "cannot restore (persistent_workers=False resumes exactly)")
        return None

    def _capture(self) -> list:
        return [_get_state(g) for g in self.generators]

    def _restore(self, states: list) -> bool:
        if len(states) != len(self.generators):
            return False
        for g, s in zip(self.generators, states):
            _set_state(g, s)
        return True

    # ---- drawing
    def _next_raw(self) -> tuple[int, int, Any]:
        if self._it is None:
            self._new_epoch()
        try:
            raw = next(self._it)
        except StopIteration:
            if self._index == 0:
                raise self._empty() from None
            self._new_epoch()
            try:
                raw = next(self._it)
            except StopIteration:
                raise self._empty() from None
        self._index += 1
        return self._epoch, self._index, raw

    def _new_epoch(self) -> None:
        self._epoch += 1
        self._starts[self._epoch] = self._capture()
        self._it, self._index = iter(self.loader), 0

    def _empty(self) -> DataError:
        return DataError(f"{self.name} gives no batch (an empty dataset, or drop_last=True with fewer samples than "
                         "one batch); give it data")

    def _fetch(self) -> tuple[int, int, Batch]:
        epoch, index, raw = self._next_raw()
        return epoch, index, self._convert(raw)

    def _select(self, batch: Batch, models: Sequence[int]) -> Batch:
        """Per-model arrays restricted to ``models`` (the array shrank)."""
        if len(models) == self.B:
            return batch
        rows = list(models)
        return {k: (v[rows] if self._per_model(k) else v) for k, v in batch.items()}

    def _per_model(self, name: str) -> bool:
        return any(w["name"] == name and w.get("per_model") for w in self.wanted)

    def _convert(self, raw: Any) -> Batch:
        """A batch as the loader gives it -> the graph's arrays (model axis first, the graph's dtypes), checked."""
        self._drawn += 1
        where = f"{self.name}, batch {self._drawn}"
        if raw is None:
            raise self._empty()
        parts = self._parts(raw, where)
        out, first = {}, {}
        for w in self.wanted:
            name = w["name"]
            if name not in parts and w.get("dtype") == AS_GIVEN:
                continue  # a Python loss's labels: optional
            if name not in parts:
                have = ", ".join(sorted(parts)) or "nothing"
                what = "the loss needs it" if name == LABELS else "a graph input"
                raise DataError(f"{where} has no array '{name}' ({what}); it holds: {have}")
            t = self._tensor(parts[name], name, where)
            if w.get("per_model"):
                if t.ndim < 2 or t.shape[1] != self.B:
                    raise DataError(f"{where}: '{name}' is per model, so a batch of it is [N, B={self.B}, ...] "
                                    f"(every sample with a leading model axis of {self.B}); it has shape "
                                    f"{list(t.shape)}")
                t = t.movedim(1, 0)
            if self._shapes is None:
                first[name] = t.detach().cpu().numpy()
            out[name] = t
        if self._shapes is None:
            self.check_first(first, where)
            self._shapes = {n: self._body(n, t.shape) for n, t in out.items()}
        self._check_shapes(out, where)
        for w in self.wanted:
            if w["name"] not in out:
                continue
            name, dtype = w["name"], np.dtype(resolved_label_dtype(w["dtype"], out[w["name"]]))
            raw_value = out[name]
            t = raw_value.to(getattr(torch, dtype.name))
            if self.check_nonfinite and dtype.kind == "f" and not bool(torch.isfinite(t).all()):
                check_finite({name: raw_value.detach().cpu().numpy()}, {name: dtype.name}, where)
                raise DataError(f"{where}: '{name}' is not finite as {dtype.name}: every model would diverge on it; "
                                "clean the data, or pass --allow-nonfinite-data")
            out[name] = t.contiguous() if self.tensors else np.ascontiguousarray(t.detach().cpu().numpy())
        return out

    def _parts(self, raw: Any, where: str) -> dict[str, Any]:
        if isinstance(raw, dict):
            return {str(k): v for k, v in raw.items()}
        items = list(raw) if isinstance(raw, (tuple, list)) else [raw]
        inputs = [w["name"] for w in self.wanted if w["name"] != LABELS]
        if len(items) not in (len(inputs), len(inputs) + 1):
            raise DataError(f"{where} has {len(items)} parts but the graph's inputs {inputs} take {len(inputs)} "
                            "and an optional label: yield (x, y) tuples ((x1, ..., y) in the graph's input order) or "
                            "dicts by input name and 'labels'")
        names = inputs + ([LABELS] if len(items) == len(inputs) + 1 else [])
        return dict(zip(names, items))

    @staticmethod
    def _tensor(v: Any, name: str, where: str) -> torch.Tensor:
        if isinstance(v, torch.Tensor):
            return v
        try:
            return torch.as_tensor(np.asarray(v))
        except (TypeError, ValueError, RuntimeError) as e:
            raise DataError(f"{where}: '{name}' is a {type(v).__name__} that is not an array of numbers ({e}); "
                            "yield tensors or numpy arrays") from None

    def _body(self, name: str, shape) -> tuple:
        """A shape less its sample axis (axis 1 of per-model arrays)."""
        shape = tuple(int(d) for d in shape)
        axis = 1 if self._per_model(name) else 0
        return shape[:axis] + shape[axis + 1:]

    def _check_shapes(self, out: Batch, where: str) -> None:
        sizes = {}
        for name, t in out.items():
            body, first = self._body(name, t.shape), self._shapes[name]
            if body != first:
                axis = 1 if self._per_model(name) else 0
                want = list(first[:axis]) + ["N"] + list(first[axis:])
                raise DataError(f"{where}: '{name}' has shape {list(t.shape)} but the first batch's is {want}: "
                                "every batch needs the same sample shape")
            sizes[name] = int(t.shape[1 if self._per_model(name) else 0])
        if len(set(sizes.values())) > 1:
            raise DataError(f"{where}: its arrays have different numbers of samples {sizes}; every array needs one "
                            "row per sample")
