"""A run's inputs, checked before anything is written: the run's settings made for the array and its data, once
(``TrainConfig.for_array``: the runtime chosen, the metric best states are kept by, a DataLoader's batch size; one
clear line per problem), the data loaded, held out, sharded and checked (or a DataLoader opened and its first
batches checked), and the number of steps. What this returns (:class:`Prepared`) is all a run reads."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxfuse.core.errors import ConfigError, DataError, OnnxFuseError
from onnxfuse.core.weights import ArraySpec
from onnxfuse.recipe.batches import ArrayBatches, BatchSource
from onnxfuse.recipe.data import BatchSampler, Dataset, check_finite, load_npz, make_dataset, resolved_label_dtype
from onnxfuse.recipe.datasets import is_data_factory
from onnxfuse.recipe.losses import AS_GIVEN, LABELS, LossSpec, PythonLoss, python_loss
from onnxfuse.recipe.settings import check_halving
from onnxfuse.runtime.trainers import resolve_runtime
from onnxfuse.recipe.train_config import RunSettings, TrainConfig, as_train_config

if TYPE_CHECKING:  # torch is imported when a DataLoader is given
    from onnxfuse.recipe.loader import LoaderBatches


log = logging.getLogger("onnxfuse.train")


def _check_shared_inputs(config: TrainConfig, spec: ArraySpec) -> None:
    """A data order that gives every model other samples needs the graph's inputs per model."""
    if config.data_order != "shared":
        shared = [i["name"] for i in spec.inputs if not i.get("per_model")]
        if shared:
            raise ConfigError(f"--data-order {config.data_order} gives every model other samples, but graph input "
                              f"'{shared[0]}' is shared: fuse with --per-model-inputs {','.join(shared)}")


def _load_source(data, spec: ArraySpec, what: str) -> tuple[dict | Any, str]:
    """A .npz path, "sklearn:<name>", a data factory ("MODULE:FUNCTION"), a dict of arrays, a torch Dataset or a
    torch DataLoader -> (arrays, or the DataLoader as it is; a name for messages). A Dataset is read into memory
    once (its ``__getitem__`` runs once per sample: augmentation in it is drawn once); a DataLoader draws fresh
    batches every step (``recipe/loader.py``)."""
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
        if is_data_factory(text):
            made = _call_factory(text, what)
            arrays, name = _load_source(made, spec, what)
            return arrays, f"{name} from {text}"
        return load_npz(text), text
    try:
        import torch

        from onnxfuse.recipe.loader import is_loader

        if is_loader(data):
            return data, f"the {what} DataLoader ({type(data.dataset).__name__})"
        if isinstance(data, torch.utils.data.Dataset):
            from onnxfuse.recipe import datasets

            log.info("%s data: %s is read into memory once (%s samples; what its __getitem__ returns is fixed for "
                     "the run); a DataLoader over it draws fresh batches every step", what, type(data).__name__,
                     len(data) if hasattr(data, "__len__") else "?")
            return datasets.from_torch_dataset(data, [i["name"] for i in spec.inputs]), what
    except ImportError:  # pragma: no cover
        pass
    raise ConfigError(f"{what} data must be a .npz path, 'sklearn:<name>', MODULE:FUNCTION, a dict of arrays, a torch "
                      f"Dataset or a torch DataLoader, got {type(data).__name__}")


def _is_loader(source) -> bool:
    """Whether what ``_load_source`` gave is a DataLoader (else arrays, a dict, or no data)."""
    return source is not None and not isinstance(source, dict)


def _call_factory(text: str, what: str) -> Any:
    """What the data factory ``text`` (``MODULE:FUNCTION``) returns, called with no arguments."""
    from onnxfuse.exporters.torch_export import load_factory

    module = text.rpartition(":")[0]
    if module.endswith(".py") and not os.path.exists(module):
        raise ConfigError(f"{what} data factory file '{module}' does not exist")
    factory = load_factory(text)
    try:
        made = factory()
    except OnnxFuseError:
        raise
    except Exception as e:
        raise DataError(f"{what} data factory {text}() failed: {type(e).__name__}: {e}") from e
    import torch

    if not isinstance(made, (dict, torch.utils.data.DataLoader, torch.utils.data.Dataset)):
        raise ConfigError(f"{what} data factory {text}() returned {type(made).__name__}; it must return a torch "
                          "DataLoader, a torch Dataset or a dict of arrays")
    return made


def _datasets(train: dict | None, source: str, evaluation: dict | None, eval_source: str | None,
              config: RunSettings, spec: ArraySpec, loss: LossSpec) -> tuple[Dataset | None, Dataset | None]:
    """The arrays of the training and evaluation data (None where a DataLoader gives them) as Datasets: checked
    for NaN and inf, sharded and held out as the settings say, and checked against the graph."""
    arrays, eval_arrays = train, evaluation
    if not config.allow_nonfinite_data:  # before any split or shard: indices as in the file
        dtypes = {i["name"]: i["dtype"] for i in spec.inputs}
        for a, src in ((arrays, source), (eval_arrays, eval_source)):
            if a is not None:
                labels = resolved_label_dtype(loss.label_dtype, a.get(LABELS))
                check_finite(a, {**dtypes, **({LABELS: labels} if labels else {})}, src)
    per_model = {i["name"] for i in spec.inputs if i.get("per_model")}
    if config.data_order == "shards" and arrays is not None:
        from onnxfuse.recipe import datasets

        arrays = datasets.shard(arrays, spec.B, set())
        per_model_arrays = set(arrays)
    else:
        per_model_arrays = per_model | ({LABELS} if config.per_model_labels else set())
    if eval_arrays is None and eval_source is None and config.eval_fraction > 0 and arrays is not None:
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

    sharded = config.data_order == "shards"
    return (None if arrays is None else build(arrays, source, sharded),
            None if eval_arrays is None else build(eval_arrays, eval_source, sharded))


def _loader_batches(loader, name: str, spec: ArraySpec, loss: LossSpec, tensors: bool,
                    check_nonfinite: bool) -> LoaderBatches:
    """A DataLoader as the run's batches (``recipe/loader.py``), its first batch checked as arrays are; ``tensors``:
    its batches stay torch tensors (the torch runtime's)."""
    from onnxfuse.recipe.loader import LoaderBatches

    out_shape = spec.outputs[0]["shape"]
    wanted = [dict(i) for i in spec.inputs]
    if loss.label_dtype is not None:  # AS_GIVEN (a Python loss): the loader's own, when its batches have labels
        wanted.append({"name": LABELS, "per_model": loss.per_model_labels,
                       "dtype": loss.label_dtype if loss.label_dtype == AS_GIVEN else np.dtype(loss.label_dtype).name})

    def check_first(arrays: dict[str, np.ndarray], where: str) -> None:
        ds = make_dataset(arrays, spec.inputs, loss.label_dtype, loss.label_shape(out_shape), source=where,
                          B=spec.B, per_model_labels=loss.per_model_labels)
        _check_labels(ds, loss, out_shape, where)

    return LoaderBatches(loader, wanted, spec.B, name, check_first, tensors=tensors, check_nonfinite=check_nonfinite)


def _loader_batch_size(train: LoaderBatches, config: TrainConfig) -> int | None:
    """The run's batch size when it is the training DataLoader's (None: the settings' is): a different one given is
    one line; none given, the loader's is the run's (and what its record says)."""
    N = train.batch_size if train.batch_size is not None else train.samples(train.peek(1)[0])
    if N == config.batch_size:
        return None
    if config.given("batch_size"):
        raise ConfigError(f"{train.name} has batch size {N} but the run's batch size (--batch-size, batch_size) is "
                          f"{config.batch_size}: a step trains on the loader's batches; set batch_size={N} "
                          f"(--batch-size {N}), or give the DataLoader batch_size={config.batch_size}")
    return N


def _loss(config: TrainConfig, runtime: str, given) -> LossSpec:
    """The run's loss: the settings', or ``given`` (a Python function, or a LossSpec) in its place."""
    if given is None:
        return config.loss_spec()
    loss = given if isinstance(given, LossSpec) else python_loss(given, config.loss_spec().per_model_labels)
    if isinstance(loss, PythonLoss) and runtime != "torch":
        raise ConfigError(f"the loss {loss.label} is a Python function, which only the torch runtime runs; train "
                          f"with runtime='torch' (--runtime torch), not {runtime}")
    return loss


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

    settings: RunSettings  # the run's settings, made once for this array, machine and data
    loss: LossSpec
    train: BatchSource  # the batches the steps train on
    eval: Dataset | LoaderBatches | None  # evaluation data; a DataLoader's is evaluated by one pass over it
    total: int


def prepare(spec: ArraySpec, config: TrainConfig | None, data, eval_data, resuming: bool = False,
            loss=None) -> Prepared:
    """The run's settings made for the array (the runtime chosen on the device, once), the data loaded (or opened)
    and checked, and the run's steps counted. A DataLoader's first batches (those a fresh run verifies) are drawn
    and checked here; ``resuming``: not here, the resumed position's are (``LoaderBatches.load_state_dict``).
    ``loss``: a Python function (``PythonLoss``) instead of the settings' loss, for the torch runtime."""
    config = as_train_config(config)  # a dict or a path is refused in one line, not an AttributeError later
    if len(spec.outputs) != 1:
        raise ConfigError(f"the array has {len(spec.outputs)} outputs; training needs exactly one")
    _check_shared_inputs(config, spec)
    runtime = resolve_runtime(config.runtime, config.device, config.precision, config.compile, then="train with")
    loss = _loss(config, runtime, loss)
    train, source = _load_source(data, spec, "training")
    evaluation, eval_source = (None, None) if eval_data is None else _load_source(eval_data, spec, "evaluation")
    loader = next((name for d, name in ((train, source), (evaluation, eval_source)) if _is_loader(d)), None)
    if loader is not None and config.data_order != "shared":
        raise ConfigError(f"{loader}: --data-order {config.data_order} gives every model other samples, but a "
                          "DataLoader gives every model the same batches; use --data-order shared (data_order: "
                          "shared), or give the data as arrays")
    if _is_loader(train) and config.eval_fraction > 0:
        raise ConfigError(f"--eval-fraction holds out part of arrays, but {source} cannot be split; give evaluation "
                          "data instead (eval_data=, --eval-data: a DataLoader or arrays)")
    opened = {what: _loader_batches(d, name, spec, loss, runtime == "torch", not config.allow_nonfinite_data)
              for what, d, name in (("train", train, source), ("eval", evaluation, eval_source)) if _is_loader(d)}
    if "eval" in opened:
        opened["eval"].check()
    settings = config.for_array(spec.B, eval_data is not None, runtime,
                                _loader_batch_size(opened["train"], config) if "train" in opened else None)
    if settings.keep_best == "eval_accuracy" and not loss.classification:
        name = loss.label if isinstance(loss, PythonLoss) else loss.name
        raise ConfigError(f"--keep-best eval_accuracy: the loss {name} has no accuracy (cross-entropy and nll have "
                          "one); keep the best states by eval_loss")
    return _counted(spec, settings, loss, train, source, evaluation, eval_source, opened, resuming)


def _counted(spec: ArraySpec, settings: RunSettings, loss: LossSpec, train, source: str, evaluation,
             eval_source: str | None, opened: dict[str, LoaderBatches], resuming: bool) -> Prepared:
    """The run's batches and evaluation data from the sources loaded (``opened``: those that are DataLoaders, as
    the run's batches), and its number of steps."""
    train_ds, eval_ds = _datasets(None if "train" in opened else train, source,
                                  None if "eval" in opened else evaluation, eval_source, settings, spec, loss)
    if "eval" in opened:
        eval_ds = opened["eval"]
    if "train" in opened:
        batches = opened["train"]
        per_epoch = batches.batches_per_epoch
        if settings.steps is None and per_epoch is None:
            raise ConfigError(f"{source} has no length (an iterable-style dataset), so --epochs cannot say how many "
                              "steps to train: give --steps (steps=...) instead")
    else:
        sampler = BatchSampler(len(train_ds), settings.batch_size, settings.shuffle, settings.seed,
                               per_model=spec.B if settings.data_order == "per-model" else None)
        batches = ArrayBatches(train_ds, sampler, spec.B, source)
        per_epoch = sampler.batches_per_epoch
    total = settings.steps if settings.steps is not None else settings.epochs * per_epoch
    check_halving(settings.halving, total)
    log.debug("data: %s (%s), %s; %d steps of %d samples per model (%s), data order %s", source,
              "a DataLoader" if "train" in opened else f"{len(train_ds)} samples",
              f"eval {eval_source}" if eval_source else "no eval data" if eval_ds is None else "eval held out",
              total, settings.batch_size, f"{settings.epochs} epochs" if settings.steps is None else "--steps",
              settings.data_order)
    if "train" in opened and not resuming:  # the verified first steps' batches, drawn and checked now
        batches.peek(max(1, min(settings.verify_steps, total)))
    return Prepared(settings, loss, batches, eval_ds, total)
