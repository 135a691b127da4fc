"""Zoo graphs for the placement benchmarks: exported single models, fused arrays and ORT training graphs, each
built into a profiled PlacementGraph."""
from __future__ import annotations

import inspect
import os
import warnings

import numpy as np
import torch

from onnxfuse import fuse_models, save_array
from onnxfuse.exporters import export_module
from onnxfuse.exporters.zoo import ZOO
from onnxfuse.placement import build_graph, example_feeds, find_array, shard_array
from onnxfuse.placement.profile import profile_graph, profile_graphs


def zoo_module(name: str, seed: int = 0) -> torch.nn.Module:
    factory = ZOO[name].factory
    kwargs = {"dropout": 0.0} if "dropout" in inspect.signature(factory).parameters else {}
    torch.manual_seed(seed)
    return factory(**kwargs)


def example_input(name: str, n: int = 8) -> torch.Tensor:
    e = ZOO[name]
    shape = (n,) + tuple(e.input_shape[1:])
    gen = torch.Generator().manual_seed(0)
    if e.input_dtype == "int64":
        return torch.randint(0, e.input_high, shape, generator=gen)
    return torch.randn(shape, generator=gen)


def export_zoo_model(name: str, folder: str, seed: int = 0) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}_{seed}.onnx")
    export_module(zoo_module(name, seed), path, example_inputs=(example_input(name),))
    return path


def zoo_feeds(name: str, graph, batch: int, B: int | None = None) -> dict[str, np.ndarray]:
    """Inputs of the right kind: real token ids for language models, random images otherwise."""
    feeds = example_feeds(graph.model)
    if ZOO[name].input_dtype == "int64" and "input" in feeds:
        rng = np.random.default_rng(0)
        feeds["input"] = rng.integers(0, ZOO[name].input_high, feeds["input"].shape).astype(np.int64)
    return feeds


def profiled_model(name: str, folder: str, batch: int):
    """(graph, feeds) of one exported zoo model, profiled on one CPU thread."""
    path = export_zoo_model(name, folder)
    g = build_graph(path, label=name, batch_size=batch)
    feeds = zoo_feeds(name, g, batch)
    return profile_graph(g, feeds), feeds


def profiled_array(name: str, B: int, folder: str, batch: int, devices):
    """(graph, feeds, shard sharding) of a fused array of B zoo models, sub-arrays profiled."""
    paths = [export_zoo_model(name, os.path.join(folder, "jobs"), seed) for seed in range(B)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_array(fuse_models(paths), os.path.join(folder, "array"), overwrite=True)
    fused = os.path.join(folder, "array", "fused.onnx")
    g = build_graph(fused, label=f"{name} x{B}", batch_size=batch)
    feeds = zoo_feeds(name, g, batch)
    sharding = shard_array(find_array(fused), devices, lambda m, label, b0, b1: build_graph(m, label=label,
                                                                                        batch_size=batch))
    subs = sharding.distinct_graphs()
    profile_graphs([g] + subs, [feeds] * (1 + len(subs)))  # in alternation: the same machine states
    sharding.share_profiles()
    return g, feeds, sharding


def profiled_training_graph(name: str, B: int, folder: str, batch: int):
    """(graph, feeds) of the onnxruntime training graph (forward, loss, backward, AdamW update) of a fused array."""
    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.runtime.ort.artifacts import build_artifacts
    from onnxfuse.recipe.losses import get_loss

    paths = [export_zoo_model(name, os.path.join(folder, "jobs"), seed) for seed in range(B)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fa = fuse_models(paths)
    art_dir = os.path.join(folder, "artifacts")
    os.makedirs(art_dir, exist_ok=True)
    loss = get_loss("cross-entropy", class_axis=-1) if ZOO[name].task == "lm" else get_loss("cross-entropy")
    art = build_artifacts(fa.model, fa.spec, loss, make_optimizer("adamw", B, lr=1e-3), art_dir)
    g = build_graph(art.training_model, label=f"{name} x{B} train", batch_size=batch)
    feeds = zoo_feeds(name, g, batch)
    feeds["optim.hyper"] = np.abs(feeds["optim.hyper"]) * 1e-3  # small positive coefficients
    return profile_graph(g, feeds), feeds
