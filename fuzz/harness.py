"""Differential check of one generated model: fused by onnxfuse and trained by one of its runtimes (``ort``:
onnxruntime-training, ``torch``: PyTorch autograd) or in a user's own torch loop (``loop``: ``FusedArray`` and
``onnxfuse.optim``, torch's loss per model), against torch.

For each B: B instances of the model with different weights are exported, fused, and compared with torch on each
model alone: the forward pass (train mode), a few SGD-momentum steps (every split tensor) and a few AdamW steps
(what the split model computes, after ``load_state_dict(strict=True)``), with per-model learning rates. The bounds
are the zoo test's: forward and SGD parameters < 1e-4, BatchNorm statistics < 1e-5 (norm-wise relative, with an
absolute floor for tensors near 0), AdamW outputs < 1e-3.

A result beyond a bound counts as a failure only when it is also beyond 3x the training's own sensitivity to float
rounding, measured on torch alone: the same model trained in float64, and from weights nudged by 1e-7. A ReLU input
or a max within rounding of a tie may send a gradient elsewhere in any two float32 programs; such a case is reported
as ``sensitive``, not as a bug. So is a trained result that is within 3x as far from the float64 training as torch's
float32 runs are (``_from_exact``: AdamW on a gradient that is only rounding noise, e.g. a bias before a
BatchNorm, where ONNX Runtime's summation order draws noise independent of torch's).

Where a result is beyond a bound and beyond 3x that sensitivity, a second reference decides: the model trained (or
run) alone by plain ONNX Runtime from its own export, with torch.optim's maths in numpy (``ort_reference.py``, no
onnxfuse code). ONNX Runtime's kernels are not torch's (its LayerNormalization computes the variance less
precisely); when the fused result equals ORT alone, the case is ``runtime``, not a bug of the fusion.

On the ``torch`` runtime the forward stage runs the fused graph as the runtime does (``OnnxModule``, train mode)
instead of ONNX Runtime's inference session; its kernels are torch's, so there is no second reference: a result
beyond a bound and beyond 3x the sensitivity is a failure.

``precision`` bf16 / fp16 (the torch runtime; bf16 also ``loop``, the forward under the user's torch.autocast):
the forward stage is float32's; the training stages compare each fused model with the model trained alone under
``torch.autocast`` (+ its own ``torch.amp.GradScaler`` for fp16) as a ratio (``STEP1_RATIO``, ``DRIFT_RATIO``),
and fp16's loss scales and skipped steps exactly. Beyond a bound, a model whose own bf16 / fp16 training moves as
far (within 3x) when its weights are nudged by 1e-7 is ``sensitive``.

Outcomes: ``pass``; ``fail`` (onnxfuse computed something else, or crashed with an internal error); ``sensitive``;
``runtime``; ``refused`` (onnxfuse stopped with one of its own clear errors, e.g. an op ONNX Runtime cannot train);
``invalid`` (torch itself could not run or export the generated model: a grammar problem, not onnxfuse's).
"""
from __future__ import annotations

import copy
import os
import re
import tempfile
import traceback
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from .grammar import BATCH, ModelSpec, Rendered, render
from .native import native_output_to

__all__ = ["Outcome", "check_model", "check_source", "check_precision_runtime", "module_class", "rel_err", "RUNTIMES",
           "REDUCED_RUNTIMES", "STEP1_RATIO", "DRIFT_RATIO"]

# onnxfuse/recipe/runtimes.py's RUNTIMES, named here without importing a runtime, and ``loop``: the user's own torch
# loop on the array as a module (``FusedArray``, ``onnxfuse.optim``, a torch loss per model, ``backward``)
RUNTIMES = ("ort", "torch", "loop")
STEPS = 3
FORWARD_TOL, SGD_TOL, STAT_TOL, ADAMW_TOL = 1e-4, 1e-4, 1e-5, 1e-3
# mixed precision (``precision`` bf16 / fp16): ||fused - alone|| / ||alone - alone in fp32|| over every weight and
# buffer, the fused model's distance to the model alone under torch.autocast as a fraction of what reduced precision
# moves that model; at step 1 (SGD: the gradient) and after STEPS steps. At step 1 both programs cast the same
# weights and inputs, which is most of what reduced precision moves: a correct fused step is far below 1, an op run
# in another precision than torch runs it gives ~1 (STEP1_RATIO halfway). After STEPS steps the weights differ in
# float32's last bits, so their casts and the ops' roundings (another accumulation order, another LSTM kernel) are
# the fused program's own, independent of torch's: two programs with independent errors of equal size are sqrt(2)
# times as far apart as each is from float32 (errors add in quadrature). AdamW makes that limit real on a tensor
# whose gradient is near 0, where a rounding flips the sign of a whole step (fuzz seed 50: attention's q/k/v
# weights on an AVX2 CPU, 1.16). A defect moves a model by its steps, 10-100x further. tests/runtime/torch/test_precision.py
# bounds its cases by the same two.
STEP1_RATIO, DRIFT_RATIO = 0.5, 2 ** 0.5
# the runtimes a reduced precision is checked on, by precision: the torch runtime's step, and a user's own loop
# under torch.autocast (bf16; fp16 needs a loss scale per model: train_step's)
REDUCED_RUNTIMES = {"bf16": ("torch", "loop"), "fp16": ("torch",)}


@dataclass
class Outcome:
    status: str  # pass | fail | sensitive | runtime | refused | invalid
    stage: str = ""  # export | fuse | forward | train-sgd | train-adamw | split
    message: str = ""
    B: int = 0
    fused_fraction: float = 1.0
    details: dict = field(default_factory=dict)

    @property
    def cause(self) -> str:
        """A label that groups failures with the same mechanism: stage, and the message without its numbers and
        names."""
        msg = re.sub(r"'[^']*'", "'…'", self.message)
        msg = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "#", msg)
        return f"{self.stage}: {msg[:160]}"


def rel_err(a, e) -> float:
    a, e = np.asarray(a, np.float64).ravel(), np.asarray(e, np.float64).ravel()
    d = np.linalg.norm(e)
    return float(np.linalg.norm(a - e) / d) if d > 0 else float(np.linalg.norm(a - e))


def _beyond(a, r, tol) -> float:
    """How far ``a`` is from ``r`` in units of the bound (> 1: beyond it): norm-wise relative error over ``tol``,
    with an absolute floor of 1e-6 per element's root for tensors near 0."""
    a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
    if a.shape != r.shape:
        return np.inf
    if not np.isfinite(a).all() or not np.isfinite(r).all():
        return 0.0 if np.array_equal(np.isfinite(a), np.isfinite(r)) and np.allclose(
            a[np.isfinite(a)], r[np.isfinite(r)], rtol=tol) else np.inf
    return float(np.linalg.norm(a - r) / (tol * np.linalg.norm(r) + 1e-6 * np.sqrt(r.size)))


def module_class(source: str):
    """The ``FuzzNet`` class defined by ``source``."""
    ns: dict = {}
    exec(compile(source, "<fuzz model>", "exec"), ns)
    return ns["FuzzNet"]


class _Case:
    """The torch side of one model: B instances, inputs, targets, and torch training."""

    def __init__(self, r: Rendered, seed: int, per_model_inputs: bool, B: int):
        self.r, self.B, self.per_model_inputs = r, B, per_model_inputs
        cls = module_class(r.source)
        self.mods = []
        gen = torch.Generator().manual_seed(seed)
        for b in range(B):
            torch.manual_seed(1000 * seed + b)
            m = cls()
            with torch.no_grad():  # distinct weights everywhere (norm layers start at ones/zeros in every seed)
                for name, t in list(m.named_parameters()) + list(m.named_buffers()):
                    if not t.dtype.is_floating_point:
                        continue
                    if name.endswith("running_var"):
                        t.uniform_(0.5, 1.5, generator=gen)
                    else:
                        t.mul_(1 + 0.1 * torch.randn(t.shape, generator=gen)).add_(
                            0.02 * torch.randn(t.shape, generator=gen))
            self.mods.append(m.train())
        self.gen = gen

    def inputs(self, n: int = BATCH) -> torch.Tensor:
        """One batch; [B, n, ...] (one slice per model) when the array takes per-model inputs."""
        lead = (self.B, n) if self.per_model_inputs else (n,)
        if self.r.input_kind == "tokens":
            return torch.randint(0, self.r.vocab, lead + self.r.input_shape, generator=self.gen)
        return torch.randn(lead + self.r.input_shape, generator=self.gen)

    def targets(self, n: int = BATCH) -> torch.Tensor:
        if self.r.loss == "cross-entropy":
            shape = (n,) if self.r.class_axis == 1 else (n,) + self.r.output_shape[:-1]
            return torch.randint(0, self.r.num_classes, shape, generator=self.gen)
        return 0.5 * torch.randn((n,) + self.r.output_shape, generator=self.gen)

    def model_input(self, x: torch.Tensor, b: int) -> torch.Tensor:
        return x[b] if self.per_model_inputs else x

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.r.loss == "mse":
            # targets as given (float32), but float64 for the float64 reference; not to a reduced precision:
            # torch.autocast runs mse_loss in float32 on float32 targets
            return torch.nn.functional.mse_loss(out, y.double() if out.dtype == torch.float64 else y)
        if self.r.class_axis == -1:
            return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        return torch.nn.functional.cross_entropy(out, y)

    def train_torch(self, mod, kind, lr, batches, dtype=torch.float32):
        opt = _torch_optimizer(kind, mod.parameters(), lr)
        losses = []
        for x, y in batches:
            if dtype != torch.float32:
                x = x.to(dtype) if x.dtype.is_floating_point else x
            opt.zero_grad()
            loss = self.loss(mod.train()(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses


    def train_autocast(self, mod, kind, lr, batches, precision, init_scale: float = 2.0 ** 16) -> dict:
        """``mod`` trained by plain torch in ``precision``: the forward and the loss under torch.autocast (+ a
        GradScaler for fp16, from ``init_scale``), torch.optim; fp32: none. Each step's state_dict, losses, scales
        and skipped steps."""
        from onnxfuse.runtime.torch.precision import DTYPES

        opt = _torch_optimizer(kind, mod.parameters(), lr)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if precision == "fp16" else None
        seen = {"states": [], "losses": [], "scales": [], "skipped": []}
        for x, y in batches:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=DTYPES.get(precision, torch.bfloat16), enabled=precision != "fp32"):
                loss = self.loss(mod.train()(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                before = scaler.get_scale()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                seen["scales"].append(scaler.get_scale())
                seen["skipped"].append(scaler.get_scale() < before)  # a backoff is a skipped step
            seen["losses"].append(float(loss.detach()))
            seen["states"].append(copy.deepcopy(mod.state_dict()))
        return seen


# per-model learning rates and the shared hyper-parameters (torch's keywords) of the two optimizers checked
LRS = {"sgd": [1e-2, 3e-3, 5e-3], "adamw": [1e-3, 3e-4, 5e-4]}
HYPER = {"sgd": {"momentum": 0.9, "weight_decay": 1e-4}, "adamw": {"weight_decay": 1e-2, "eps": 1e-6}}


def _torch_optimizer(kind, params, lr):
    cls = torch.optim.SGD if kind == "sgd" else torch.optim.AdamW
    return cls(params, lr=lr, **HYPER[kind])


def check_model(spec: ModelSpec, Bs=(1, 2, 3), optimizers=("sgd", "adamw"), workdir: str | None = None,
                runtime: str = "ort", strategy: str = "default", compile: str = "off",
                precision: str = "fp32") -> Outcome:
    """Check generated model ``spec`` at each B in ``Bs`` on ``runtime``, fused with ``strategy`` (``default`` or a
    form, ``onnxfuse.core.passes.FORMS``), trained in ``precision``; the first outcome that is not a pass, else a
    pass."""
    return check_source(render(spec), spec.seed, spec.per_model_inputs, Bs, optimizers, workdir, runtime, strategy,
                        compile, precision)


def check_source(r: Rendered, seed: int = 0, per_model_inputs: bool = False, Bs=(1, 2, 3),
                 optimizers=("sgd", "adamw"), workdir: str | None = None, runtime: str = "ort",
                 strategy: str = "default", compile: str = "off", precision: str = "fp32") -> Outcome:
    """Check the model whose source ``r.source`` defines ``FuzzNet`` (any module, written by hand or rendered).
    ``compile``: the torch runtime's ``compile`` (``on``: the whole step captured by torch.compile);
    ``precision``: fp32, or bf16 / fp16 on a runtime of :data:`REDUCED_RUNTIMES`."""
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime '{runtime}'; choose one of: {', '.join(RUNTIMES)}")
    check_precision_runtime(precision, runtime)
    with tempfile.TemporaryDirectory(dir=workdir, prefix="fuzz-") as tmp:
        try:
            case = _Case(r, seed, per_model_inputs, max(Bs))
            paths = _export(case, tmp)
        except _Invalid as e:
            return Outcome("invalid", "export", str(e))
        last = Outcome("pass")
        for B in Bs:
            out = _check_B(case, paths, B, optimizers, os.path.join(tmp, f"B{B}"), runtime, strategy, compile,
                           precision)
            out.B = B
            if out.status in ("fail", "refused"):
                return out
            if out.status != "pass" or last.status == "pass":  # a note (sensitive, runtime) is kept; go on
                last = out
        return last


class _Invalid(Exception):
    pass


def check_precision_runtime(precision: str, runtime: str) -> None:
    """A ValueError (one line) when ``runtime`` is not checked in ``precision``."""
    from onnxfuse.recipe.runtimes import PRECISIONS

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision '{precision}'; choose one of: {', '.join(PRECISIONS)}")
    if precision != "fp32" and runtime not in REDUCED_RUNTIMES[precision]:
        raise ValueError(f"precision {precision} is checked on runtime(s) {', '.join(REDUCED_RUNTIMES[precision])}, "
                         f"not {runtime}" + (" (fp16 needs a loss scale per model: train_step's)"
                                             if runtime == "loop" else ""))


def _export(case: _Case, tmp: str) -> list[str]:
    from onnxfuse.exporters import export_module

    x = case.inputs()
    paths = []
    for b, m in enumerate(case.mods):
        xb = case.model_input(x, b)
        try:
            with torch.no_grad():
                out = copy.deepcopy(m)(xb)
            if tuple(out.shape[1:]) != case.r.output_shape or not torch.isfinite(out).all():
                raise _Invalid(f"torch output {tuple(out.shape)} is not {case.r.output_shape} or not finite")
            path = os.path.join(tmp, f"model_{b}.onnx")
            with native_output_to(1):  # torch's exporter prints its IR graph when it fails
                export_module(copy.deepcopy(m), path, example_inputs=(xb,), opset=case.r.opset)
        except _Invalid:
            raise
        except Exception as e:
            raise _Invalid(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
        paths.append(path)
    return paths


def _fail_from(stage: str, e: Exception) -> Outcome:
    from onnxfuse.core.errors import OnnxFuseError

    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    internal = "internal error" in first
    if isinstance(e, OnnxFuseError) and not internal:
        return Outcome("refused", stage, f"{type(e).__name__}: {first}")
    return Outcome("fail", stage, f"{type(e).__name__}: {first}",
                   details={"traceback": traceback.format_exc(limit=-6)})


def _check_B(case: _Case, paths: list[str], B: int, optimizers, folder: str, runtime: str,
             strategy: str = "default", compile: str = "off", precision: str = "fp32") -> Outcome:
    from onnxfuse import fuse_models

    os.makedirs(folder, exist_ok=True)
    per_model = ("input",) if case.per_model_inputs else ()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fa = fuse_models(paths[:B], per_model_inputs=per_model, strategy=strategy)
    except Exception as e:
        return _fail_from("fuse", e)
    frac = fa.spec.summary.get("fused_fraction", 1.0)
    sub = _Sub(case, B, paths)
    stages = [("forward", lambda: _forward(sub, fa, runtime))]
    train = _train if precision == "fp32" else (
        lambda *a: _train_reduced(*a, precision=precision))
    stages += [(f"train-{k}", (lambda k=k: train(sub, fa, k, folder, runtime, compile))) for k in optimizers]
    note = Outcome("pass", fused_fraction=frac)
    for stage, fn in stages:
        try:
            res = fn()
        except Exception as e:
            out = _fail_from(stage, e)
            out.fused_fraction = frac
            return out
        if res is not None:
            res.stage, res.fused_fraction = stage, frac
            if res.status in ("fail", "refused"):
                return res
            note = res  # sensitive or runtime: not a bug, and the later stages are still checked
    return note


class _Sub:
    """The first B models of a case (inputs sliced to B models), and their exported files."""

    def __init__(self, case: _Case, B: int, paths: list[str]):
        self.case, self.B, self.paths = case, B, paths[:B]
        self.mods = case.mods[:B]

    def inputs(self):
        x = self.case.inputs()
        return x[: self.B] if self.case.per_model_inputs else x


def _run_onnx(model, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # see README: ConvBN fusion
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x})[0]


def _run_fused(fa, x: np.ndarray, runtime: str) -> np.ndarray:
    """The fused graph's train-mode forward as ``runtime`` computes it."""
    if runtime == "ort":  # the torch runtime's own nodes (a batched recurrence) as the ort runtime runs them
        from onnxfuse.core.standard import standard_onnx

        return _run_onnx(standard_onnx(fa.model), x)
    with torch.no_grad():
        if runtime == "loop":
            from onnxfuse.runtime.torch.array_module import FusedArray

            return FusedArray(fa).train()(torch.from_numpy(x)).numpy()
        from onnxfuse.runtime.torch.program import OnnxModule

        return OnnxModule.from_array(fa.model, fa.spec).train()(input=torch.from_numpy(x))[0].numpy()


def _forward(sub: _Sub, fa, runtime: str) -> Outcome | None:
    x = sub.inputs()
    fused = _run_fused(fa, x.numpy(), runtime)
    worst = (0.0, -1)
    for b, m in enumerate(sub.mods):
        xb = sub.case.model_input(x, b)
        with torch.no_grad():
            ref = copy.deepcopy(m).train()(xb).numpy()
        beyond = _beyond(fused[b], ref, FORWARD_TOL)
        if beyond > worst[0]:
            worst = (beyond, b)
    if worst[0] <= 1:
        return None
    b = worst[1]
    xb = sub.case.model_input(x, b)
    with torch.no_grad():
        ref32 = copy.deepcopy(sub.mods[b]).train()(xb).numpy()
        ref64 = copy.deepcopy(sub.mods[b]).double().train()(xb.double() if xb.dtype.is_floating_point else xb).numpy()
        # rounding-sized changes of the weights and the input (1e-7 relative): an ill-conditioned model (a LayerNorm
        # over two nearly equal values) amplifies any two libraries' last-bit differences as much as these
        nudged = _nudged(sub.mods[b])
        g = torch.Generator().manual_seed(11)
        xn = xb * (1 + 1e-7 * torch.randn(xb.shape, generator=g)) if xb.dtype.is_floating_point else xb
        refn = nudged.train()(xn).numpy()
    sensitivity = max(_beyond(ref32, ref64, FORWARD_TOL), _beyond(ref32, refn, FORWARD_TOL))
    err = rel_err(fused[b], ref32) if fused[b].shape == ref32.shape else np.inf
    status = "sensitive" if worst[0] <= 3 * max(sensitivity, 1e-9) else "fail"
    if status == "fail" and runtime == "ort":  # ORT's kernels may part from torch's: the model's export, ORT alone
        alone = _ort_alone_forward(sub.paths[b], xb.numpy())
        if alone is not None and _beyond(fused[b], alone, FORWARD_TOL) <= 1:
            return Outcome("runtime", message=f"model {b}: ONNX Runtime alone differs from torch by "
                                              f"{rel_err(alone, ref32):.3g}, the fused forward equals it",
                           details={"beyond": worst[0], "sensitivity": sensitivity})
    shape_note = "" if fused[b].shape == ref32.shape else f" (shape {fused[b].shape} vs {ref32.shape})"
    return Outcome(status, message=f"model {b}: fused forward differs from torch by {err:.3g}{shape_note}",
                   details={"beyond": worst[0], "sensitivity": sensitivity})


def _ort_alone_forward(path: str, x: np.ndarray) -> np.ndarray | None:
    """The exported model alone, run by ONNX Runtime: as exported, or, where ORT refuses that (its CPU Conv runs no
    SAME padding with dilations), as onnxfuse loads it, with static values resolved and window padding made
    explicit (exact rewrites, each checked against torch on its own). None when neither runs."""
    import onnx

    from onnxfuse.core.source import load_source

    for load in (onnx.load, lambda p: load_source(p).model):
        try:
            return _run_onnx(load(path), x)
        except Exception:
            continue
    return None


def _nudged(mod: torch.nn.Module, nudge: float = 1e-7) -> torch.nn.Module:
    """A copy of ``mod`` with every parameter multiplied by 1 + nudge * N(0, 1) (fixed seed)."""
    m = copy.deepcopy(mod)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for p in m.parameters():
            p.mul_(1 + nudge * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


def _train(sub: _Sub, fa, kind: str, folder: str, runtime: str, compile: str = "off") -> Outcome | None:
    from onnxfuse.core.split import split_weights
    from onnxfuse.recipe.losses import get_loss
    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.runtime.trainers import make_trainer

    case, B = sub.case, sub.B
    lrs = LRS[kind][:B]
    batches = [(sub.inputs(), case.targets()) for _ in range(STEPS)]
    fused_losses = []
    if runtime == "loop":  # the user's loop: the array as a module, onnxfuse.optim, torch's loss per model
        import onnxfuse
        from onnxfuse.runtime.torch.array_module import FusedArray

        arr = FusedArray(fa)
        fused_opt = onnxfuse.optim.optimizer_class(kind)(arr, lr=lrs, **HYPER[kind])
        for x, y in batches:
            out = arr(x)
            losses = torch.stack([case.loss(out[b], y) for b in range(B)])
            fused_opt.zero_grad()
            losses.sum().backward()
            fused_opt.step()
            fused_losses.append(losses.detach().numpy())
        states = [{k: v.numpy() for k, v in sd.items()} for sd in arr.state_dicts()]
    else:
        opt = make_optimizer(kind, B, lr=lrs, **HYPER[kind])
        loss = get_loss(case.r.loss, class_axis=case.r.class_axis)
        trainer = make_trainer(runtime, fa.model, fa.spec, loss, opt, workdir=os.path.join(folder, kind),
                               compile=compile if runtime == "torch" else "off")
        # the run loop's way: this step's values and the next ones' handed ahead (the torch runtime computes a
        # window of steps' coefficients at once; the ort runtime computes each step's)
        values = opt.constant_values()
        for x, y in batches:
            feeds = {"input": x.numpy()}
            feeds["labels"] = y.numpy() if case.r.loss == "cross-entropy" else y.numpy().astype(np.float32)
            trainer.launch(feeds, values, lambda n: [values] * n)
            fused_losses.append(trainer.observe().losses)
        states = split_weights(fa.spec, trainer.weights(), steps=STEPS)
    for b in range(B):
        def alone(dtype=torch.float32, nudge=0.0):
            m = _nudged(sub.mods[b], nudge) if nudge else copy.deepcopy(sub.mods[b])
            if dtype != torch.float32:
                m = m.to(dtype)
            bs = [(case.model_input(x, b), y) for x, y in batches]
            if dtype != torch.float32:
                bs = [(x.to(dtype) if x.dtype.is_floating_point else x, y.to(dtype) if y.dtype.is_floating_point
                       else y) for x, y in bs]
            losses = case.train_torch(m, kind, lrs[b], bs, dtype)
            return m, losses

        ref, ref_losses = alone()
        got = states[b]
        why = _compare(kind, case, b, got, [float(v[b]) for v in fused_losses], ref, ref_losses, batches)
        if why is None:
            continue
        beyond, message = why
        # the training's own sensitivity to rounding, on torch alone
        exact, exact_losses = alone(torch.float64)
        nudged, nudged_losses = alone(nudge=1e-7)
        sens = max(_compare_modules(kind, case, b, ref, ref_losses, exact, exact_losses, batches, as_double=True),
                   _compare_modules(kind, case, b, ref, ref_losses, nudged, nudged_losses, batches))
        details = {"beyond": beyond, "sensitivity": sens}
        status = "sensitive" if beyond <= 3 * max(sens, 1e-9) else "fail"
        if status == "fail":
            own, theirs = _from_exact(kind, case, b, got, [float(v[b]) for v in fused_losses], batches, exact,
                                      exact_losses, [(ref, ref_losses), (nudged, nudged_losses)])
            details.update(from_exact=own, torch_from_exact=theirs)
            status = "sensitive" if own <= 3 * max(theirs, 1e-9) else "fail"
        # ONNX Runtime's kernels may part from torch's: the model trained alone by plain onnxruntime-training
        if status == "fail" and runtime == "ort" and _equals_ort_alone(
                case, b, kind, lrs[b], got, [float(v[b]) for v in fused_losses], batches,
                os.path.join(folder, f"{kind}-alone{b}")):
            return Outcome("runtime", message=f"model {b}: {message}; plain onnxruntime-training alone trains it the "
                                              "same way", details=details)
        return Outcome(status, message=f"model {b}: {message}", details=details)
    return None


def _from_exact(kind, case, b, got_state, got_losses, batches, exact, exact_losses, torch32) -> tuple[float, float]:
    """(how far the fused result is from exact arithmetic, torch in float64; the farthest of torch's own float32
    runs ``torch32`` [(module, losses)]), in units of the bound. Within 3x, the result is ``sensitive``.

    Needed where the exact gradient of a parameter is 0 and float32 leaves only rounding noise in it: a bias that
    feeds a train-mode BatchNorm (BatchNorm removes any per-channel constant). AdamW scales that noise (~3e-7) to
    steps of ~0.2-0.5 lr, and the eval-mode output moves with the bias (the running mean follows it only by
    ``momentum`` per step). Two float32 programs that sum in different orders (ONNX Runtime's kernels and torch's)
    draw independent noise; torch nudged by 1e-7 keeps torch's summation order, so its noise is correlated with the
    reference's and measures that distance short (fuzz seed 1524: fused vs torch 2.9 bounds, nudged torch 0.7-0.8,
    while the fused run is 2.2 bounds from float64 and torch float32 0.96). Both float32 results are compared with
    the exact one instead; a real fault is far from it too (if fused-to-exact <= 3x, fused-to-torch <= 4x)."""
    theirs = max(_compare_modules(kind, case, b, m, losses, exact, exact_losses, batches, as_double=True)
                 for m, losses in torch32)
    try:
        ours = _load(case, got_state)
    except Exception:  # a state that does not load with strict=True is a failure (_compare says so)
        return np.inf, theirs
    return _compare_modules(kind, case, b, ours, got_losses, exact, exact_losses, batches, as_double=True), theirs


def _equals_ort_alone(case: _Case, b: int, kind: str, lr: float, got: dict, got_losses, batches, folder) -> bool:
    """Whether the fused model b trained as plain onnxruntime-training trains it alone, from its own export, with
    torch.optim's maths in numpy (fuzz/ort_reference.py: no onnxfuse code), within the same bounds: then ONNX
    Runtime's kernels part from torch's, and the fusion is not at fault."""
    from .ort_reference import train_alone

    mine = [(case.model_input(x, b), y) for x, y in batches]
    try:
        state, losses = train_alone(case.mods[b], case.r.loss, kind, lr, HYPER[kind], mine, folder,
                                    class_axis=case.r.class_axis, opset=case.r.opset)
    except Exception:  # an op the reference cannot train: no second opinion
        return False
    return _compare(kind, case, b, got, got_losses, _load(case, state), list(losses), batches) is None


def _load(case: _Case, state: dict) -> torch.nn.Module:
    m = module_class(case.r.source)()
    m.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}, strict=True)
    return m


def _probe_outputs(case: _Case, m: torch.nn.Module, b: int, batches, as_double=False) -> list[np.ndarray]:
    """What a trained model computes on two fresh batches, in train mode (batch statistics) and eval mode."""
    g = torch.Generator().manual_seed(99)
    outs = []
    x = batches[0][0]
    for mode in ("train", "eval"):
        xb = case.model_input(x, b)
        if case.r.input_kind == "float":
            xb = torch.randn(xb.shape, generator=g)
            if as_double:
                xb = xb.double()
        with torch.no_grad():
            outs.append(getattr(copy.deepcopy(m), mode)()(xb).double().numpy())
    return outs


def _compare(kind, case, b, got_state, got_losses, ref, ref_losses, batches) -> tuple[float, str] | None:
    """(how far beyond the bound, what) when the split state ``got_state`` differs from torch's ``ref``."""
    loss_beyond = _beyond(got_losses, ref_losses, 1e-4)
    if loss_beyond > 1:
        return loss_beyond, f"per-step losses {np.round(got_losses, 6)} vs torch {np.round(ref_losses, 6)}"
    missing = sorted(set(ref.state_dict()) - set(got_state))
    if missing:
        return np.inf, f"split state lacks state_dict key(s) {missing[:3]}"
    if kind == "sgd":
        worst = (0.0, "")
        for key, r in ref.state_dict().items():
            g = np.asarray(got_state[key])
            if not r.dtype.is_floating_point:
                if not np.array_equal(g, r.numpy()):
                    return np.inf, f"{key}: {g.ravel()[:4]} vs torch {r.numpy().ravel()[:4]}"
                continue
            tol = STAT_TOL if "running_" in key else SGD_TOL
            beyond = _beyond(g, r.numpy(), tol)
            if beyond > worst[0]:
                worst = (beyond, f"{key} differs from torch by {rel_err(g, r.numpy()):.3g} (bound {tol:g})")
        return worst if worst[0] > 1 else None
    try:
        ours = _load(case, got_state)
    except Exception as e:
        return np.inf, f"the split state does not load with strict=True: {str(e).splitlines()[0]}"
    beyond = _compare_modules(kind, case, b, ref, ref_losses, ours, got_losses, batches)
    if beyond > 1:
        outs = _probe_outputs(case, ours, b, batches)
        refs = _probe_outputs(case, ref, b, batches)
        return beyond, (f"train/eval outputs after AdamW differ from torch by "
                        f"{rel_err(outs[0], refs[0]):.3g}/{rel_err(outs[1], refs[1]):.3g} (bound {ADAMW_TOL:g})")
    return None


def _compare_modules(kind, case, b, ref, ref_losses, other, other_losses, batches, as_double=False) -> float:
    """How far ``other`` is from ``ref`` in units of the bound of ``kind``'s check."""
    beyond = _beyond(other_losses, ref_losses, 1e-4)
    if kind == "sgd":
        for key, r in ref.state_dict().items():
            o = other.state_dict()[key]
            if r.dtype.is_floating_point:
                beyond = max(beyond, _beyond(o.double().numpy(), r.double().numpy(),
                                             STAT_TOL if "running_" in key else SGD_TOL))
        return beyond
    a = _probe_outputs(case, other, b, batches, as_double)
    r = _probe_outputs(case, ref, b, batches)
    return max(beyond, *(_beyond(x, y, ADAMW_TOL) for x, y in zip(a, r)))


def _ratio(got: dict, alone: dict, full: dict) -> float:
    """||got - alone|| / ||alone - full|| over every float tensor of the state_dicts, the denominator at least
    1e-6 ||alone||, float32's rounding of the weights (a model that reduced precision does not move must match as
    in float32)."""
    def flat(state):
        return np.concatenate([np.asarray(v, np.float64).ravel() for k, v in sorted(state.items())
                               if np.issubdtype(np.asarray(v).dtype, np.floating)])
    g, a, f = flat(got), flat(alone), flat(full)
    if g.shape != a.shape:
        return np.inf
    return float(np.linalg.norm(g - a) / max(np.linalg.norm(a - f), 1e-6 * np.linalg.norm(a), 1e-12))


def _fused_reduced(sub: _Sub, fa, kind: str, lrs, batches, folder: str, runtime: str, compile: str,
                   precision: str) -> dict:
    """The fused array trained in ``precision``: each step's B split states, losses [B], scales [B] and skipped
    steps [B] (fp16). ``torch``: the runtime's trainer; ``loop``: the array as a module, its forward and a torch loss
    under the user's torch.autocast, onnxfuse.optim."""
    from onnxfuse.core.split import split_weights
    from onnxfuse.runtime.trainers import make_trainer
    from onnxfuse.runtime.torch.precision import DTYPES
    from onnxfuse.recipe.losses import get_loss
    from onnxfuse.recipe.optim import make_optimizer

    case, B = sub.case, sub.B
    seen = {"states": [], "losses": [], "scales": [], "skipped": []}
    if runtime == "loop":
        import onnxfuse
        from onnxfuse.runtime.torch.array_module import FusedArray

        arr = FusedArray(fa)
        opt = onnxfuse.optim.optimizer_class(kind)(arr, lr=lrs, **HYPER[kind])
        for x, y in batches:
            with torch.autocast("cpu", dtype=DTYPES[precision]):
                out = arr(x)
                losses = torch.stack([case.loss(out[b], y) for b in range(B)])
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
            seen["losses"].append(losses.detach().float().numpy())
            seen["states"].append([{k: v.numpy() for k, v in sd.items()} for sd in arr.state_dicts()])
        return seen
    opt = make_optimizer(kind, B, lr=lrs, **HYPER[kind])
    loss = get_loss(case.r.loss, class_axis=case.r.class_axis)
    trainer = make_trainer(runtime, fa.model, fa.spec, loss, opt, workdir=os.path.join(folder, kind),
                           compile=compile, precision=precision)
    values = opt.constant_values()
    for t, (x, y) in enumerate(batches):
        feeds = {"input": x.numpy()}
        feeds["labels"] = y.numpy() if case.r.loss == "cross-entropy" else y.numpy().astype(np.float32)
        trainer.launch(feeds, values, lambda n: [values] * n)
        o = trainer.observe()
        seen["losses"].append(o.losses)
        if o.scale is not None:
            seen["scales"].append([float(v) for v in o.scale])
            seen["skipped"].append([not bool(v) for v in o.ok])
        seen["states"].append(split_weights(fa.spec, trainer.weights(), steps=t + 1))
    return seen


def _train_reduced(sub: _Sub, fa, kind: str, folder: str, runtime: str, compile: str = "off", *,
                   precision: str) -> Outcome | None:
    """Each model of the array trained in ``precision`` against it alone under torch.autocast (see the module
    docstring): the ratio at step 1 (SGD) and after STEPS steps, fp16's scales and skipped steps exactly."""
    case, B = sub.case, sub.B
    lrs = LRS[kind][:B]
    batches = [(sub.inputs(), case.targets()) for _ in range(STEPS)]
    try:
        fused = _fused_reduced(sub, fa, kind, lrs, batches, folder, runtime, compile, precision)
    except Exception:
        try:  # torch itself may not run the model in this precision (CPU oneDNN has no fp16 LSTM)
            case.train_autocast(copy.deepcopy(sub.mods[0]), kind, lrs[0], [(case.model_input(x, 0), y)
                                                                             for x, y in batches], precision)
        except Exception as e:
            return Outcome("invalid", message=f"torch alone cannot train it in {precision}: "
                                              f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120]}")
        raise
    for b in range(B):
        mine = [(case.model_input(x, b), y) for x, y in batches]
        alone = case.train_autocast(copy.deepcopy(sub.mods[b]), kind, lrs[b], mine, precision)
        if not all(np.isfinite(v.numpy()).all() for v in alone["states"][-1].values() if v.is_floating_point()):
            return Outcome("sensitive", message=f"model {b}: torch.autocast alone trains it to non-finite weights")
        if precision == "fp16":
            got = ([s[b] for s in fused["scales"]], [s[b] for s in fused["skipped"]])
            if got != (alone["scales"], alone["skipped"]):
                # an overflow within 1/16 of fp16's limit: the model alone overflows elsewhere at a scale 1/16 off
                near = any(case.train_autocast(copy.deepcopy(sub.mods[b]), kind, lrs[b], mine, precision,
                                               2.0 ** 16 * f)["skipped"] != alone["skipped"] for f in (17 / 16, 15 / 16))
                return Outcome("sensitive" if near else "fail",
                               message=f"model {b}: loss scales {got[0]} (skipped {got[1]}) vs GradScaler's "
                                       f"{alone['scales']} (skipped {alone['skipped']})"
                                       + ("; alone at a scale 1/16 off skips other steps" if near else ""))
        full = case.train_autocast(copy.deepcopy(sub.mods[b]), kind, lrs[b], mine, "fp32")
        checks = ([(0, STEP1_RATIO)] if kind == "sgd" else []) + [(STEPS - 1, DRIFT_RATIO)]
        for t, bound in checks:
            ratio = _ratio(fused["states"][t][b], alone["states"][t], full["states"][t])
            if ratio <= bound:
                continue
            nudged = case.train_autocast(_nudged(sub.mods[b]), kind, lrs[b], mine, precision)
            sens = _ratio(nudged["states"][t], alone["states"][t], full["states"][t])
            status = "sensitive" if ratio <= 3 * max(sens, 1e-9) else "fail"
            return Outcome(status, message=f"model {b}: after step {t + 1} in {precision} the fused model is "
                                           f"{ratio:.3g} of its own {precision}-vs-fp32 difference from torch.autocast "
                                           f"alone (bound {bound:g}; weights nudged by 1e-7: {sens:.3g})",
                           details={"ratio": ratio, "sensitivity": sens})
    return None
