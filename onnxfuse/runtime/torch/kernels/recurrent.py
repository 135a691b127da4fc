"""Recurrent ops: LSTM, GRU, RNN as torch's own recurrent kernels, and the B models' recurrence in one
(``BatchedLSTM`` / ``BatchedGRU`` / ``BatchedRNN``, the recurrent rule's batched form)."""
from __future__ import annotations

import torch

from onnxfuse.runtime.torch.kernels._base import OPS, Kernel, NodeSpec, autocast_lowered, kern, op

# ONNX's gate order per op, and torch's (_VF.lstm / gru / rnn_*): the same gates, stacked differently
_GATES = {"LSTM": ("iofc", "ifco"), "GRU": ("zrh", "rzh"), "RNN": ("h", "h")}


def _torch_gates(w: torch.Tensor, op_type: str) -> torch.Tensor:
    """An ONNX recurrent weight or bias of one direction, gates stacked on axis 0 in ONNX's order, restacked in
    torch's (LSTM: i o f c -> i f c o; GRU: z r h -> r z h)."""
    onnx_order, torch_order = _GATES[op_type]
    if onnx_order == torch_order:
        return w
    blocks = w.chunk(len(onnx_order), 0)
    return torch.cat([blocks[onnx_order.index(g)] for g in torch_order], 0)


def _recurrent_attrs(spec: NodeSpec, t: str) -> tuple[int, str, int, int, bool]:
    """(H, direction, layout, D, relu) of an LSTM / GRU / RNN node (``t``) both recurrent kernels run; the forms they
    refuse fail here, one line each: sequence_lens that are not constant, LSTM peepholes, clip, input_forget,
    activations other than the defaults (RNN: Tanh or Relu), GRU with linear_before_reset=0 (torch's GRU applies
    the reset gate after its recurrent product)."""
    H = int(spec.attr("hidden_size", 0) or 0)
    direction = spec.attr("direction", "forward")
    layout = int(spec.attr("layout", 0))
    acts = [a.decode() if isinstance(a, bytes) else a for a in (spec.attr("activations") or [])]
    defaults = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}[t]
    D = 2 if direction == "bidirectional" else 1
    named = [a.lower() for a in acts]
    relu = t == "RNN" and named == ["relu"] * D
    if named and named != [a.lower() for a in defaults] * D and not relu:
        spec.fail(f"activations {acts} have no torch kernel", "use the default activations (nn.LSTM/GRU/RNN)")
    if spec.attr("clip") is not None:
        spec.fail("clip has no torch kernel", "train it with --runtime ort")
    if int(spec.attr("input_forget", 0)):
        spec.fail("input_forget has no torch kernel", "train it with --runtime ort")
    if t == "GRU" and not int(spec.attr("linear_before_reset", 0)):
        spec.fail("linear_before_reset=0 has no torch kernel (torch's GRU resets after its recurrent product)",
                  "export the GRU from torch (nn.GRU), or train it with --runtime ort")
    if t == "LSTM" and spec.has(7):
        p = spec.const(7)
        if p is None or bool((p != 0).any()):
            spec.fail("peepholes have no torch kernel", "train it with --runtime ort")
    spec.need_const(4, "sequence_lens")
    return H, direction, layout, D, relu


def _full_lengths(spec: NodeSpec, lens: torch.Tensor | None, T: int) -> None:
    if lens is not None and bool((lens != T).any()):
        spec.fail("sequence_lens shorter than the sequence have no torch kernel",
                  "pad every sequence to the same length, or train it with --runtime ort")


@op("LSTM", "GRU", "RNN")
def recurrent(spec: NodeSpec) -> Kernel:
    """ONNX LSTM / GRU / RNN as torch's own recurrent kernels (``torch._VF.lstm``, ``gru``, ``rnn_tanh``,
    ``rnn_relu``: what ``nn.LSTM``/``nn.GRU``/``nn.RNN`` run, so the same numerics), one layer, forward, reverse
    or bidirectional, layout 0 (X [T, N, I]) or 1 ([N, T, I]), with initial states. The weights W [D, G*H, I],
    R [D, G*H, H] and bias B [D, 2*G*H] are restacked from ONNX's gate order to torch's. Y: [T, D, N, H]
    (layout 1: [N, T, D, H]); Y_h, Y_c: [D, N, H] ([N, D, H]). Refused: see :func:`_recurrent_attrs`."""
    t = spec.op_type
    H, direction, layout, D, relu = _recurrent_attrs(spec, t)
    fn_vf = {"LSTM": torch._VF.lstm, "GRU": torch._VF.gru}.get(t) or (torch._VF.rnn_relu if relu else torch._VF.rnn_tanh)
    lens = spec.const(4)
    n_out = spec.n_outputs

    def fn(x, w, r, b=None, seq_lens=None, h0=None, c0=None, peepholes=None):
        T_axis, N_axis = (1, 0) if layout else (0, 1)
        _full_lengths(spec, lens, x.shape[T_axis])
        N = x.shape[N_axis]
        params = []
        for d in range(D):
            params += [_torch_gates(w[d], t), _torch_gates(r[d], t)]
            if b is not None:
                wb, rb = b[d].chunk(2, 0)
                params += [_torch_gates(wb, t), _torch_gates(rb, t)]
        # cast once, as autocast casts a module's weights once (its cache): the T steps' gradients of each weight
        # are then summed in the lower precision, as torch sums them for the module alone
        params = list(autocast_lowered(*params))

        def state(s):
            if s is None:
                return x.new_zeros(D, N, H)
            return s.transpose(0, 1) if layout else s
        hx = (state(h0), state(c0)) if t == "LSTM" else state(h0)
        seq = x.flip(T_axis) if direction == "reverse" else x
        y, *states = fn_vf(seq, hx, params, b is not None, 1, 0.0, spec.training, D == 2, bool(layout))
        if direction == "reverse":
            y = y.flip(T_axis)
        y = y.reshape(*y.shape[:2], D, H)  # [T, N, D, H] or [N, T, D, H]
        if not layout:
            y = y.permute(0, 2, 1, 3)  # [T, D, N, H]
        states = [s.transpose(0, 1) if layout else s for s in states]
        return ((y, *states) + (None,) * 3)[:n_out] if n_out > 1 else y
    return kern(fn, *range(len(spec.node.input)))


@OPS.register("BatchedLSTM", "BatchedGRU", "BatchedRNN", domain="onnxfuse.torch")
def batched_recurrent(spec: NodeSpec) -> Kernel:
    """B models' LSTM / GRU / RNN in one recurrence: the recurrent rule's "batched" form
    (``core/rules/recurrent.py``), the attributes of the ONNX op. Every per-model tensor has a leading model axis:
    X [B, T, N, I] (layout 1: [B, N, T, I]; a shared X [T, N, I] is read by every model), W [B, D, G*H, I],
    R [B, D, G*H, H], bias [B, D, 2*G*H], initial states [B, D, N, H] ([B, N, D, H]; shared: [D, N, H]);
    Y [B, T, D, N, H] ([B, N, T, D, H]), Y_h / Y_c [B, D, N, H] ([B, N, D, H]).
    Math: torch's CPU recurrence (aten/src/ATen/native/RNN.cpp, the cells of ``_VF.gru`` / ``rnn_*``): the input
    product of every step first (``linear(x, W, Wb)``), then per step the recurrent product ``linear(h, R, Rb)``
    plus it and the cell in torch's order of operations, each product batched over the B models and the D
    directions (``baddbmm``); a reverse direction runs on its input reversed in time. Refused: see
    :func:`_recurrent_attrs`."""
    t = spec.op_type[len("Batched"):]
    H, direction, layout, D, relu = _recurrent_attrs(spec, t)
    G = {"LSTM": 4, "GRU": 3, "RNN": 1}[t]
    reverse = [direction == "reverse" or d == 1 for d in range(D)]
    lens = spec.const(4)
    n_out = spec.n_outputs
    act = torch.relu if relu else torch.tanh

    def flip_reversed(z):  # z [B, D, T, ...]: each reverse direction's time axis reversed
        if not any(reverse):
            return z
        return torch.cat([z[:, d:d + 1].flip(2) if reverse[d] else z[:, d:d + 1] for d in range(D)], 1)

    def cell(xw, hw, h, c):  # torch's cells, in place on the fresh recurrent product hw as they are
        if t == "LSTM":  # ONNX's gates i o f c; torch: c' = f * c + i * g, h' = o * tanh(c')
            i, o, f, g = hw.add_(xw).unsafe_chunk(4, -1)
            i, o, f, g = i.sigmoid_(), o.sigmoid_(), f.sigmoid_(), g.tanh_()
            c = (f * c).add_(i * g)
            return o * c.tanh(), c
        if t == "GRU":  # ONNX's gates z r h; torch: n = tanh(xn + r * hn), h' = (h - n) * z + n
            xz, xr, xn = xw.unsafe_chunk(3, -1)
            hz, hr, hn = hw.unsafe_chunk(3, -1)
            r, z = hr.add_(xr).sigmoid_(), hz.add_(xz).sigmoid_()
            n = xn.add(hn.mul_(r)).tanh_()
            return (h - n).mul_(z).add_(n), c
        return act(hw.add_(xw)), c

    def fn(x, w, r, b=None, seq_lens=None, h0=None, c0=None, peepholes=None):
        Bm = w.shape[0]
        MD = Bm * D  # the models' directions, one batch of recurrences
        if layout:
            x = x.transpose(-3, -2)  # [.., T, N, I]
        T, N, I = x.shape[-3:]
        _full_lengths(spec, lens, T)
        xs = x.reshape(-1, 1, T * N, I).expand(Bm, D, T * N, I).reshape(MD, T * N, I)
        wt, rt = w.reshape(MD, G * H, I).transpose(1, 2), r.reshape(MD, G * H, H).transpose(1, 2)
        wb, rb = b.reshape(MD, 1, 2 * G * H).chunk(2, -1) if b is not None else (None, None)
        if wb is not None and (x[0] if x.dim() == 4 else x).is_contiguous():
            xw = torch.baddbmm(wb, xs, wt)  # torch's linear of a contiguous [T, N, I]: addmm, the bias inside
        else:  # of a strided one (batch_first's transpose): matmul, then add_(bias), each rounded under autocast
            xw = torch.bmm(xs, wt)
            if wb is not None:
                xw.add_(wb.to(xw.dtype))
        xw = flip_reversed(xw.reshape(Bm, D, T, N, G * H)).reshape(MD, T, N, G * H)
        # cast once, as autocast casts a module's weights once (its cache): the T steps' gradients of R and Rb are
        # then summed in the lower precision, as torch sums them alone
        rt, rb = autocast_lowered(rt, rb) if rb is not None else (autocast_lowered(rt)[0], None)

        def state(s):
            if s is None:
                return x.new_zeros(MD, N, H)
            if layout:  # [.., N, D, H]
                s = s.transpose(-3, -2)
            return s.expand(Bm, D, N, H).reshape(MD, N, H)
        h, c = state(h0), (state(c0) if t == "LSTM" else None)
        ys = []
        for xw_t in xw.unbind(1):  # (not xw[:, step]: each select's gradient would be a zero-filled copy of xw)
            hw = torch.bmm(h, rt) if rb is None else torch.baddbmm(rb, h, rt)
            h, c = cell(xw_t, hw, h, c)
            ys.append(h)
        y = flip_reversed(torch.stack(ys, 1).reshape(Bm, D, T, N, H))
        y = y.permute(0, 3, 2, 1, 4) if layout else y.permute(0, 2, 1, 3, 4)  # [B, N, T, D, H] / [B, T, D, N, H]
        states = [s.reshape(Bm, D, N, H) for s in ((h, c) if t == "LSTM" else (h,))]
        states = [s.transpose(1, 2) if layout else s for s in states]
        return ((y, *states) + (None,) * 3)[:n_out] if n_out > 1 else y
    return kern(fn, *range(len(spec.node.input)))
