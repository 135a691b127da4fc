"""Control flow: If, Loop and Scan, their subgraphs compiled as programs of their own (``NodeSpec.subprogram``)
that read the enclosing graph's tensors by name (autograd flows through them to the outer parameters).
Data-dependent iteration counts and branches run on the host (a condition is read with ``bool()``)."""
from __future__ import annotations

import torch

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, op


def _compile(spec: NodeSpec, name: str):
    if spec.subprogram is None:
        spec.fail("its subgraphs need a module to compile them", "run it through OnnxModule")
    graph = spec.attr(name)
    return spec.subprogram(graph.g)


def _outer(*programs) -> tuple[str, ...]:
    names: list[str] = []
    for p in programs:
        names += [n for n in p.outer if n not in names]
    return tuple(names)


@op("If")
def if_(spec: NodeSpec) -> Kernel:
    """The then_branch's outputs when cond is true, else the else_branch's (the condition read on the host)."""
    then, other = _compile(spec, "then_branch"), _compile(spec, "else_branch")
    outer = _outer(then, other)
    n_out = spec.n_outputs

    def fn(cond, *values):
        env = dict(zip(outer, values))
        outs = (then if bool(cond) else other).run((), env)
        return outs[0] if n_out == 1 else tuple(outs)
    return Kernel(fn, (0,), (0,), outer)


@op("Loop")
def loop(spec: NodeSpec) -> Kernel:
    """Loop(M?, cond?, v_initial...): body(iteration, cond, v...) -> (cond', v'..., scan outputs...), run while
    iteration < M and cond; outputs the final loop-carried values and each scan output stacked over iterations."""
    body = _compile(spec, "body")
    outer = body.outer
    n_in = len(spec.node.input)
    n_carried = n_in - 2

    def fn(trip, cond, *rest):
        carried, env = list(rest[:n_carried]), dict(zip(outer, rest[n_carried:]))
        limit = int(trip.reshape(-1)[0]) if trip is not None else None
        keep = bool(cond.reshape(-1)[0]) if cond is not None else True
        scans: list[list[torch.Tensor]] = []
        i = 0
        while keep and (limit is None or i < limit):
            outs = body.run([torch.tensor(i, dtype=torch.int64), torch.tensor(keep)] + carried, env)
            keep, carried = bool(outs[0].reshape(-1)[0]), list(outs[1:1 + n_carried])
            scans = scans or [[] for _ in outs[1 + n_carried:]]
            for k, v in enumerate(outs[1 + n_carried:]):
                scans[k].append(v)
            i += 1
        stacked = [torch.stack(s) for s in scans]
        result = carried + stacked
        return result[0] if len(result) == 1 else tuple(result)
    return Kernel(fn, tuple(range(n_in)), (0, 1), outer)


@op("Scan")
def scan(spec: NodeSpec) -> Kernel:
    """Scan(states..., scan inputs...): body(states..., one slice of each scan input) -> (states'...,
    scan outputs...) along each scan input's axis (``scan_input_axes``, reversed per ``scan_input_directions``);
    outputs the final states and the scan outputs stacked along ``scan_output_axes`` (reversed per
    ``scan_output_directions``)."""
    body = _compile(spec, "body")
    outer = body.outer
    n_in = len(spec.node.input)
    k = int(spec.attr("num_scan_inputs"))
    n_states = n_in - k
    in_axes = list(spec.attr("scan_input_axes") or [0] * k)
    in_dirs = list(spec.attr("scan_input_directions") or [0] * k)
    n_scan_out = len(spec.node.output) - n_states
    out_axes = list(spec.attr("scan_output_axes") or [0] * n_scan_out)
    out_dirs = list(spec.attr("scan_output_directions") or [0] * n_scan_out)

    def fn(*values):
        states, xs, env = list(values[:n_states]), values[n_states:n_in], dict(zip(outer, values[n_in:]))
        slices = []
        for x, axis, rev in zip(xs, in_axes, in_dirs):
            parts = list(torch.unbind(x, axis % x.dim()))
            slices.append(parts[::-1] if rev else parts)
        outs_by_step = []
        for step in range(len(slices[0]) if slices else 0):
            outs = body.run(states + [s[step] for s in slices], env)
            states = list(outs[:n_states])
            outs_by_step.append(outs[n_states:])
        scans = []
        for j in range(n_scan_out):
            seq = [o[j] for o in outs_by_step]
            seq = seq[::-1] if out_dirs[j] else seq
            scans.append(torch.stack(seq, out_axes[j] % (seq[0].dim() + 1)))
        result = states + scans
        return result[0] if len(result) == 1 else tuple(result)
    return Kernel(fn, tuple(range(n_in)), (), outer)
