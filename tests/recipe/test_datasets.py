"""Data sources: bundled scikit-learn sets, reshaping to a graph input, torch datasets, hold-out splits, shards."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from onnxfuse.core.errors import ConfigError, DataError
from onnxfuse.recipe.datasets import (NAMED_DATASETS, from_torch_dataset, load_named, reshape_for_input, shard,
                                      split_holdout)


@pytest.mark.parametrize("spec,shape,classes", [
    ("sklearn:digits", (1797, 1, 8, 8), 10),
    ("sklearn:iris", (150, 4), 3),
    ("sklearn:wine", (178, 13), 3),
    ("sklearn:breast_cancer", (569, 30), 2),
])
def test_named_datasets(spec, shape, classes):
    d = load_named(spec)
    assert set(d) == {"input", "labels"}
    assert d["input"].shape == shape and d["input"].dtype == np.float32
    assert d["labels"].shape == shape[:1] and d["labels"].dtype == np.int64
    assert sorted(np.unique(d["labels"])) == list(range(classes))
    if spec == "sklearn:digits":
        assert d["input"].min() == 0.0 and d["input"].max() == 1.0


@pytest.mark.parametrize("spec", list(NAMED_DATASETS))
def test_named_datasets_are_scikit_learns_bit_for_bit(spec):
    """load_named reads scikit-learn's bundled files itself (importing scikit-learn imports scipy: seconds in every
    sweep worker before its first step): the arrays its loaders give, bit for bit."""
    import sklearn.datasets

    bunch = getattr(sklearn.datasets, NAMED_DATASETS[spec][0])()
    x = np.ascontiguousarray((bunch.images / 16.0)[:, None] if spec == "sklearn:digits" else bunch.data, np.float32)
    d = load_named(spec)
    assert d["input"].shape == x.shape and d["input"].tobytes() == x.tobytes()
    assert np.array_equal(d["labels"], bunch.target)


def test_named_datasets_load_without_importing_scikit_learn():
    code = "import sys; from onnxfuse.recipe.datasets import load_named; load_named('sklearn:digits'); " \
           "print('sklearn' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False"], r.stdout + r.stderr


def test_unknown_named_dataset_lists_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        load_named("sklearn:mnist")
    assert "sklearn:mnist" in str(e.value) and all(n in str(e.value) for n in NAMED_DATASETS)


def test_reshape_for_input():
    x = np.arange(5 * 64, dtype=np.float32).reshape(5, 64)
    img = reshape_for_input(x, ["N", 1, 8, 8])
    assert img.shape == (5, 1, 8, 8) and np.array_equal(img.reshape(5, 64), x)
    assert reshape_for_input(img, [None, 64]).shape == (5, 64)
    assert reshape_for_input(img, [32, 1, 8, 8]) is img  # already right: no copy
    assert reshape_for_input(np.zeros((3, 5, 64)), ["N", 8, 8], per_model=True).shape == (3, 5, 8, 8)
    with pytest.raises(DataError) as e:
        reshape_for_input(x, ["N", 3, 8, 8])
    assert "[5, 64]" in str(e.value) and "['N', 3, 8, 8]" in str(e.value) and "\n" not in str(e.value)


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int, as_dict: bool = False):
        self.n, self.as_dict = n, as_dict

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x, y = torch.full((2, 3), float(i)), i % 4
        return {"input": x, "labels": torch.tensor(y)} if self.as_dict else (x, y)


@pytest.mark.parametrize("as_dict", [False, True])
def test_from_torch_dataset(as_dict):
    d = from_torch_dataset(_Pairs(7, as_dict))
    assert d["input"].shape == (7, 2, 3) and d["input"].dtype == np.float32
    assert d["labels"].dtype == np.int64 and list(d["labels"]) == [0, 1, 2, 3, 0, 1, 2]
    assert np.all(d["input"][5] == 5.0)


def test_from_torch_dataset_with_a_progress_bar(capsys):
    d = from_torch_dataset(torch.utils.data.TensorDataset(torch.zeros(10_001, 2), torch.arange(10_001)))
    assert d["input"].shape == (10_001, 2) and d["labels"][-1] == 10_000
    assert "reading dataset" in capsys.readouterr().err


def test_from_torch_dataset_bad_items():
    with pytest.raises(DataError) as e:
        from_torch_dataset([(1, 2, 3)], input_names=("input",))
    assert "has 3 parts" in str(e.value)


def test_split_holdout_is_seeded_and_disjoint():
    arrays = {"input": np.arange(100)[:, None] * np.ones((1, 3)), "labels": np.arange(100),
              "noise": np.arange(200).reshape(2, 100)}  # per model [B=2, n]
    train, held = split_holdout(arrays, 0.2, seed=3, per_model={"noise"})
    assert len(held["labels"]) == 20 and len(train["labels"]) == 80
    assert not set(held["labels"]) & set(train["labels"])
    assert sorted(np.concatenate([held["labels"], train["labels"]])) == list(range(100))
    assert np.array_equal(held["input"][:, 0], held["labels"])  # rows stay together
    assert held["noise"].shape == (2, 20) and np.array_equal(held["noise"][1], held["labels"] + 100)
    again, _ = split_holdout(arrays, 0.2, seed=3, per_model={"noise"})
    other, _ = split_holdout(arrays, 0.2, seed=4, per_model={"noise"})
    assert np.array_equal(again["labels"], train["labels"]) and not np.array_equal(other["labels"], train["labels"])
    with pytest.raises(ConfigError):
        split_holdout(arrays, 1.0, seed=0, per_model={"noise"})


def test_shard():
    arrays = {"input": np.arange(11)[:, None] * np.ones((1, 2)), "labels": np.arange(11),
              "noise": np.arange(33).reshape(3, 11)}
    s = shard(arrays, 3, per_model_keys={"noise"})
    assert s["input"].shape == (3, 3, 2) and s["labels"].shape == (3, 3)
    assert s["labels"].tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # the last 11 % 3 = 2 samples dropped
    assert s["noise"].tolist() == [[0, 1, 2], [14, 15, 16], [28, 29, 30]]  # model b's own row, shard b
    with pytest.raises(DataError) as e:
        shard(arrays, 12, per_model_keys={"noise"})
    assert "fewer than one per model" in str(e.value)
