"""A run's inputs, checked before anything is read or written: the settings against the array (one clear line per
problem), the data loaded, held out, sharded and checked, and the number of steps."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

from onnxfuse.core.errors import ConfigError, DataError
from onnxfuse.core.weights import ArraySpec
from onnxfuse.recipe.data import BatchSampler, Dataset, check_finite, load_npz, make_dataset
from onnxfuse.recipe.losses import LABELS, LossSpec
from onnxfuse.recipe.settings import check_halving
from onnxfuse.recipe.runtimes import resolve_runtime
from onnxfuse.recipe.train_config import RunPlan, TrainConfig


def validate(config: TrainConfig, spec: ArraySpec, has_eval: bool) -> RunPlan:
    """The run's plan for the array (every value was checked when ``config`` was made; here what needs the array:
    B, the shared inputs, the runtime on the device), before anything is read or written: one clear line per
    problem."""
    plan = config.plan(spec.B, has_eval)
    if plan.data_order != "shared":
        shared = [i["name"] for i in spec.inputs if not i.get("per_model")]
        if shared:
            raise ConfigError(f"--data-order {plan.data_order} gives every model other samples, but graph input "
                              f"'{shared[0]}' is shared: fuse with --per-model-inputs {','.join(shared)}")
    return replace(plan, runtime=resolve_runtime(plan.runtime, plan.device))


def _load_arrays(data, spec: ArraySpec, what: str) -> tuple[dict, str]:
    """A .npz path, "sklearn:<name>", a dict of arrays or a torch Dataset -> (arrays, a name for messages)."""
    if data is None:
        raise ConfigError(f"no {what} data given (--data)")
    if isinstance(data, dict):
        return dict(data), what
    if isinstance(data, (str, os.PathLike)):
        text = os.fspath(data)
        if text.startswith("sklearn:"):
            from onnxfuse.recipe import datasets

            arrays = datasets.load_named(text)
            shapes = {i["name"]: i["shape"] for i in spec.inputs}
            return {k: datasets.reshape_for_input(v, shapes[k]) if k in shapes else v for k, v in arrays.items()}, text
        return load_npz(text), text
    try:
        import torch

        if isinstance(data, torch.utils.data.DataLoader):
            # onnxfuse batches itself (--batch-size, --seed), so that a resumed run draws the same batches: the
            # loader's dataset is what is used
            data = data.dataset
        if isinstance(data, torch.utils.data.Dataset):
            from onnxfuse.recipe import datasets

            return datasets.from_torch_dataset(data, [i["name"] for i in spec.inputs]), what
    except ImportError:  # pragma: no cover
        pass
    raise ConfigError(f"{what} data must be a .npz path, 'sklearn:<name>', a dict of arrays or a torch Dataset, "
                      f"got {type(data).__name__}")


def _datasets(data, eval_data, config: RunPlan, spec: ArraySpec, loss: LossSpec) -> tuple[Dataset, Dataset | None]:
    arrays, source = _load_arrays(data, spec, "training")
    eval_arrays, eval_source = (None, None) if eval_data is None else _load_arrays(eval_data, spec, "evaluation")
    if not config.allow_nonfinite_data:  # before any split or shard: indices as in the file
        dtypes = {i["name"]: i["dtype"] for i in spec.inputs}
        if loss.label_dtype is not None:
            dtypes[LABELS] = np.dtype(loss.label_dtype).name
        for a, src in ((arrays, source), (eval_arrays, eval_source)):
            if a is not None:
                check_finite(a, dtypes, src)
    per_model = {i["name"] for i in spec.inputs if i.get("per_model")}
    if config.data_order == "shards":
        from onnxfuse.recipe import datasets

        arrays = datasets.shard(arrays, spec.B, set())
        per_model_arrays = set(arrays)
    else:
        per_model_arrays = per_model | ({LABELS} if config.per_model_labels else set())
    if eval_arrays is None and config.eval_fraction > 0:
        from onnxfuse.recipe import datasets

        arrays, eval_arrays = datasets.split_holdout(arrays, config.eval_fraction, config.seed, per_model_arrays)
        eval_source = f"{source} (held-out {config.eval_fraction:g})"
    out_shape = spec.outputs[0]["shape"]
    loss.check_output(out_shape, spec.outputs[0]["name"])

    def build(a, src, sharded):
        inputs = [dict(i, per_model=i["name"] in per_model_arrays if sharded else i.get("per_model", False))
                  for i in spec.inputs]
        labels_pm = (LABELS in per_model_arrays) if sharded else loss.per_model_labels
        if config.data_order == "per-model" and not sharded:
            # shared arrays, indexed per model by the sampler: [n, ...] in, [B, N, ...] out
            inputs = [dict(i, per_model=False) for i in spec.inputs]
            labels_pm = False
        ds = make_dataset(a, inputs, loss.label_dtype, loss.label_shape(out_shape), source=src, B=spec.B,
                          per_model_labels=labels_pm)
        _check_labels(ds, loss, out_shape, src)
        return ds

    train = build(arrays, source, config.data_order == "shards")
    evaluation = None if eval_arrays is None else build(eval_arrays, eval_source, config.data_order == "shards")
    return train, evaluation


def _check_labels(ds: Dataset, loss: LossSpec, out_shape, source: str) -> None:
    K = loss.num_classes(out_shape)
    if K is None or LABELS not in ds.arrays:
        return
    labels = ds.arrays[LABELS]
    labels = labels[labels != loss.ignore_index]
    if labels.size and (labels.min() < 0 or labels.max() >= K):
        raise DataError(f"{source}: 'labels' must be class indices in [0, {K}) (or the ignore index "
                        f"{loss.ignore_index}) for the model's {K} classes, found {labels.min()}..{labels.max()}")


@dataclass
class Prepared:
    """A run's inputs, validated: nothing is written before this exists."""

    config: RunPlan
    loss: LossSpec
    train: Dataset
    eval: Dataset | None
    sampler: BatchSampler
    total: int


def prepare(spec: ArraySpec, config: TrainConfig | None, data, eval_data) -> Prepared:
    """Validate the settings against the array, load the data, and count the run's steps."""
    if config is None:
        raise ConfigError("no training configuration given")
    if len(spec.outputs) != 1:
        raise ConfigError(f"the array has {len(spec.outputs)} outputs; training needs exactly one")
    config = validate(config, spec, eval_data is not None)
    loss = config.loss_spec()
    train_ds, eval_ds = _datasets(data, eval_data, config, spec, loss)
    sampler = BatchSampler(len(train_ds), config.batch_size, config.shuffle, config.seed,
                           per_model=spec.B if config.data_order == "per-model" else None)
    total = config.steps if config.steps is not None else config.epochs * sampler.batches_per_epoch
    check_halving(config.halving, total)
    return Prepared(config, loss, train_ds, eval_ds, sampler, total)
