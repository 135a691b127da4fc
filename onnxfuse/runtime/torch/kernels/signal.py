"""Signal processing: DFT, STFT, the Hann / Hamming / Blackman windows and MelWeightMatrix (a spectrogram front end
of an audio model). ONNX holds complex numbers as a trailing axis of 2 (real, imaginary); a real signal has a
trailing axis of 1. Windows and the mel matrix are computed in float64 from the specification's formulas and cast
once, as onnxruntime does."""
from __future__ import annotations

import math

import torch

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, kern, norm_axis, op, torch_dtype


def _complex(x: torch.Tensor) -> torch.Tensor:
    """[..., 1] real or [..., 2] (real, imaginary) -> a complex tensor of [...] (differentiable)."""
    if x.shape[-1] == 1:
        return torch.complex(x[..., 0], torch.zeros_like(x[..., 0]))
    return torch.complex(x[..., 0].contiguous(), x[..., 1].contiguous())


def _pairs(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([z.real, z.imag], -1).to(dtype)


def _dft(x: torch.Tensor, n: int, axis: int, inverse: bool, onesided: bool) -> torch.Tensor:
    """The DFT of ``x`` [..., 1|2] along ``axis`` (of the signal's axes) over n points (zero-padded or cut), the
    first n // 2 + 1 bins when ``onesided``; the inverse is normalized by 1 / n (numpy's ifft)."""
    z = (torch.fft.ifft if inverse else torch.fft.fft)(_complex(x), n, axis)
    if onesided:
        z = z.narrow(axis, 0, n // 2 + 1)
    return _pairs(z, x.dtype)


@op("DFT")
def dft(spec: NodeSpec) -> Kernel:
    """DFT(input [..., 1|2], dft_length?, axis?) -> [..., 2]: axis an attribute (default 1) before opset 20, an
    input (default -2, counting the complex axis) from then on; dft_length and axis are host values."""
    inverse, onesided = bool(spec.attr("inverse", 0)), bool(spec.attr("onesided", 0))
    if spec.opset < 20:
        axis0 = int(spec.attr("axis", 1))

        def fn17(x, n=None):
            a = norm_axis(axis0, x.dim())
            return _dft(x, int(n.reshape(-1)[0]) if n is not None else x.shape[a], a, inverse, onesided)
        return kern(fn17, *[i for i in (0, 1) if spec.has(i)], host=(1,) if spec.has(1) else ())
    given = [i for i in (0, 1, 2) if spec.has(i)]

    def fn(x, *rest):
        n = rest[given.index(1) - 1] if 1 in given else None
        a = int(rest[given.index(2) - 1].reshape(-1)[0]) if 2 in given else -2
        a = norm_axis(a, x.dim())
        return _dft(x, int(n.reshape(-1)[0]) if n is not None else x.shape[a], a, inverse, onesided)
    return kern(fn, *given, host=tuple(i for i in given if i))


@op("STFT")
def stft(spec: NodeSpec) -> Kernel:
    """STFT(signal [batch, L, 1|2], frame_step, window?, frame_length?) -> [batch, frames, bins, 2]: frames of
    frame_length (the window's length when not given) every frame_step samples, 1 + (L - frame_length) // step of
    them, each times the window and transformed (bins: frame_length // 2 + 1 when ``onesided``, the default)."""
    onesided = bool(spec.attr("onesided", 1))
    given = [i for i in (0, 1, 2, 3) if spec.has(i)]

    def fn(x, *rest):
        got = dict(zip(given[1:], rest))
        step = int(got[1].reshape(-1)[0])
        window = got.get(2)
        n = int(got[3].reshape(-1)[0]) if 3 in got else window.shape[0]
        frames = x.unfold(1, n, step)  # [batch, frames, 1|2, n]
        frames = frames.movedim(-1, -2)  # [batch, frames, n, 1|2]
        if window is not None:
            frames = frames * window.to(x.dtype).reshape(n, 1)
        return _dft(frames, n, 2, False, onesided)
    return kern(fn, *given, host=tuple(i for i in given if i in (1, 3)))


def _window(spec: NodeSpec, terms: tuple[float, ...]) -> Kernel:
    """sum_j (-1)^j terms[j] * cos(2 pi j n / N1), n < size, N1 = size (``periodic`` 1) or size - 1."""
    periodic = bool(spec.attr("periodic", 1))
    dtype = torch_dtype(int(spec.attr("output_datatype", 1)))
    device = spec.device

    def fn(size):
        N = int(size.reshape(-1)[0])
        n1 = N if periodic else N - 1
        n = torch.arange(N, dtype=torch.float64)
        w = sum((-1) ** j * a * torch.cos(2 * math.pi * j * n / n1) for j, a in enumerate(terms))
        return (w if isinstance(w, torch.Tensor) else torch.full((N,), float(w), dtype=torch.float64)).to(
            device=device(), dtype=dtype)
    return kern(fn, 0, host=(0,))


@op("HannWindow")
def hann_window(spec: NodeSpec) -> Kernel:
    return _window(spec, (0.5, 0.5))


@op("HammingWindow")
def hamming_window(spec: NodeSpec) -> Kernel:
    """alpha = 25/46, beta = 21/46: the specification's (not torch.hamming_window's 0.54 / 0.46)."""
    return _window(spec, (25 / 46, 21 / 46))


@op("BlackmanWindow")
def blackman_window(spec: NodeSpec) -> Kernel:
    return _window(spec, (0.42, 0.5, 0.08))


@op("MelWeightMatrix")
def mel_weight_matrix(spec: NodeSpec) -> Kernel:
    """[dft_length // 2 + 1, num_mel_bins] triangular filters between lower and upper edge hertz on the mel scale
    (2595 log10(1 + f / 700)), their corners at the bins floor((dft_length + 1) f / sample_rate): the
    specification's construction. Every input is a host value."""
    dtype = torch_dtype(int(spec.attr("output_datatype", 1)))
    device = spec.device

    def fn(num_mel_bins, dft_length, sample_rate, lower, upper):
        m, n, rate = (int(t.reshape(-1)[0]) for t in (num_mel_bins, dft_length, sample_rate))
        lo, hi = (float(t.reshape(-1)[0]) for t in (lower, upper))
        mel_lo, mel_hi = 2595 * math.log10(1 + lo / 700), 2595 * math.log10(1 + hi / 700)
        step = (mel_hi - mel_lo) / (m + 2)
        hz = [700 * (10 ** ((k * step + mel_lo) / 2595) - 1) for k in range(m + 2)]
        corner = [int(((n + 1) * f) // rate) for f in hz]
        out = torch.zeros(n // 2 + 1, m, dtype=torch.float64)
        for i in range(m):
            left, centre, right = corner[i], corner[i + 1], corner[i + 2]
            if centre == left:
                out[centre, i] = 1
            else:
                for j in range(left, centre + 1):
                    out[j, i] = (j - left) / (centre - left)
            for j in range(centre, right):
                out[j, i] = (right - j) / (right - centre)
        return out.to(device=device(), dtype=dtype)
    return kern(fn, 0, 1, 2, 3, 4, host=(0, 1, 2, 3, 4))
