"""The batches a run trains on, one interface (``BatchSource``) over two sources:

    ArrayBatches    arrays in memory (a .npz file, ``sklearn:<name>``, a dict, a materialized torch Dataset):
                    a :class:`Dataset` indexed by onnxfuse's own :class:`BatchSampler` (--batch-size, --shuffle,
                    --seed, --data-order)
    LoaderBatches   a torch ``DataLoader`` (``recipe/loader.py``): every step draws the loader's next batch, with
                    its own batch size, sampler, workers, collate and augmentation

The run loop, its verification, checkpoints and halving read a source only through these methods, so both train,
resume and shrink the same way."""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from onnxfuse.recipe.data import BatchSampler, Dataset

__all__ = ["BatchSource", "ArrayBatches", "array_batch", "same_position"]

Batch = dict  # graph input name (and "labels") -> numpy array or torch tensor, [N, ...] or per model [B, N, ...]


class BatchSource(Protocol):
    name: str  # what messages call the data
    batches_per_epoch: int | None  # None: not known (a loader over an iterable-style dataset)

    def draw(self, models: Sequence[int]) -> Batch:
        """The next step's batch for the models still in the array (``models``: their indices in the original
        array of ``B``): per-model arrays hold those models' rows only."""
        ...

    def peek(self, k: int) -> list[Batch]:
        """The next ``k`` batches for every model, without moving the position: the next ``k`` draws give them."""
        ...

    def samples(self, batch: Batch) -> int:
        """The samples per model in ``batch`` (a loader's last batch of an epoch may be partial)."""
        ...

    def state_dict(self) -> dict:
        """The position (and what decides the batches after it), as a checkpoint records it (JSON)."""
        ...

    def load_state_dict(self, state: dict) -> None: ...

    def keep(self, positions: Sequence[int]) -> None:
        """The array kept only the models at ``positions``: per-model streams follow."""
        ...


def same_position(a: dict, b: dict) -> bool:
    """Whether two recorded states of a source (``state_dict()``) are at the same batch: a sweep's halving
    re-fuses arrays that must be. A loader's generator states are not compared: each array drew from its own
    process's."""
    if "loader" in a and "loader" in b:
        return all(a["loader"][k] == b["loader"][k] for k in ("epoch", "batch", "ahead"))
    return a == b


def array_batch(ds: Dataset, idx: np.ndarray, models: Sequence[int] | None = None, B: int | None = None) -> Batch:
    """The arrays of ``ds`` at sample indices ``idx``: ``[N]`` indices (per-model arrays keep the rows of
    ``models`` only, when given and not all ``B``), or ``[B', N]`` per-model indices into shared arrays (the
    per-model data order: ``[B', N, ...]`` out)."""
    if idx.ndim == 2:
        return {k: v[idx] for k, v in ds.arrays.items()}
    if models is None or len(models) == B:
        return ds.batch(idx)
    rows = np.asarray(models)[:, None]  # per-model arrays: the surviving models' rows only
    return {k: (v[rows, idx[None, :]] if k in ds.per_model else v[idx]) for k, v in ds.arrays.items()}


class ArrayBatches:
    """Arrays in memory in batches of ``sampler``: each epoch a seeded permutation (or file order), the last
    partial batch skipped; the position is the sampler's (``BatchSampler.state_dict``, what checkpoints always
    recorded)."""

    def __init__(self, data: Dataset, sampler: BatchSampler, B: int, name: str = "data"):
        self.data, self.sampler, self.B, self.name = data, sampler, B, name

    @property
    def batches_per_epoch(self) -> int:
        return self.sampler.batches_per_epoch

    @property
    def streams(self) -> int | None:
        """B' index streams in the per-model data order (one per model still in the array), else None."""
        return self.sampler.per_model

    def draw(self, models: Sequence[int]) -> Batch:
        return array_batch(self.data, self.sampler.next(), models, self.B)

    def peek(self, k: int) -> list[Batch]:
        position = self.sampler.state_dict()
        batches = [array_batch(self.data, self.sampler.next()) for _ in range(k)]
        self.sampler.load_state_dict(position)
        return batches

    def samples(self, batch: Batch) -> int:
        return self.sampler.N

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def keep(self, positions: Sequence[int]) -> None:
        self.sampler.keep(list(positions))

