"""FusedGAN: B DCGAN (generator, discriminator) pairs trained alternately, fused, == each pair trained alone with
torch.optim.Adam by the same procedure (same noise, same real batches, [real; fake] discriminator batches,
BatchNorm in training mode)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import rel_err
from onnxfuse import fuse_models
from onnxfuse.core.errors import ConfigError, DataError
from onnxfuse.exporters import export_module, zoo
from onnxfuse.recipe.optim import make_optimizer
from onnxfuse.training.gan import FusedGAN

B, N, NZ, ITERS = 3, 4, 8, 3
G_LR, D_LR = [2e-4, 1e-3, 5e-3], [1e-3, 2e-4, 3e-3]
BETAS = (0.5, 0.999)


def _arrays(tmp_path, per_model_z=False, per_model_d=True):
    gens, discs, gp, dp = [], [], [], []
    os.makedirs(tmp_path / "jobs", exist_ok=True)
    for b in range(B):
        torch.manual_seed(40 + b)
        gens.append(zoo.DCGANGenerator(nz=NZ, ngf=8, nc=1, image=16))
        discs.append(zoo.DCGANDiscriminator(nc=1, ndf=8, image=16))
        gp.append(str(tmp_path / "jobs" / f"g{b}.onnx"))
        dp.append(str(tmp_path / "jobs" / f"d{b}.onnx"))
        export_module(gens[b], gp[b], input_shape=(N, NZ, 1, 1))
        export_module(discs[b], dp[b], input_shape=(2 * N, 1, 16, 16))
    g_array = fuse_models(gp, per_model_inputs=["input"] if per_model_z else [])
    d_array = fuse_models(dp, per_model_inputs=["input"] if per_model_d else [])
    return gens, discs, g_array, d_array


def _torch_iteration(G, D, opt_g, opt_d, z, real):
    """The reference: one DCGAN iteration with the real and fake halves in one discriminator batch."""
    G.train(), D.train()
    fake = G(z)
    opt_d.zero_grad()
    out = D(torch.cat([real, fake.detach()]))
    target = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
    d_loss = F.binary_cross_entropy_with_logits(out, target)
    d_loss.backward()
    opt_d.step()
    opt_g.zero_grad()
    g_loss = F.binary_cross_entropy_with_logits(D(fake), torch.ones(len(real), 1))
    g_loss.backward()
    opt_g.step()
    return d_loss.item(), g_loss.item()


@pytest.mark.parametrize("per_model_z", [False, True])
def test_fused_gan_equals_torch_pairs(per_model_z, tmp_path):
    gens, discs, g_array, d_array = _arrays(tmp_path, per_model_z)
    gan = FusedGAN(g_array, d_array,
                   make_optimizer("adamw", B, lr=G_LR, betas=BETAS, weight_decay=0.0),
                   make_optimizer("adamw", B, lr=D_LR, betas=BETAS, weight_decay=0.0),
                   workdir=str(tmp_path / "art"))
    opts_g = [torch.optim.Adam(g.parameters(), lr=G_LR[b], betas=BETAS) for b, g in enumerate(gens)]
    opts_d = [torch.optim.Adam(d.parameters(), lr=D_LR[b], betas=BETAS) for b, d in enumerate(discs)]
    g_init = [g.state_dict()["main.0.weight"].numpy().copy() for g in gens]
    d_init = [d.state_dict()["main.0.weight"].numpy().copy() for d in discs]
    rng = np.random.default_rng(5)
    for _ in range(ITERS):
        z = rng.standard_normal(((B,) if per_model_z else ()) + (N, NZ, 1, 1)).astype(np.float32)
        real = rng.uniform(-1, 1, (N, 1, 16, 16)).astype(np.float32)
        res = gan.step(z, real)
        for b in range(B):
            zb = torch.from_numpy(z[b] if per_model_z else z)
            d_loss, g_loss = _torch_iteration(gens[b], discs[b], opts_g[b], opts_d[b], zb, torch.from_numpy(real))
            assert abs(res.d_loss[b] - d_loss) < 1e-5 and abs(res.g_loss[b] - g_loss) < 1e-5, (b, res, d_loss, g_loss)
    g_split, d_split = gan.split()
    for kind, split, mods in (("G", g_split, gens), ("D", d_split, discs)):
        for b, m in enumerate(mods):
            sd = m.state_dict()
            assert set(split[b]) == set(sd)
            for key, ref in sd.items():
                if key.endswith("num_batches_tracked"):
                    assert int(split[b][key]) == int(ref), (kind, b, key)
                else:
                    assert rel_err(split[b][key], ref.numpy()) < 1e-4, (kind, b, key)
    with pytest.raises(DataError, match=r"real has shape \[4, 1, 8, 8\] but the array expects \[N, 1, 16, 16\]"):
        gan.step(z, np.zeros((N, 1, 8, 8), np.float32))
    # every generator and discriminator really moved
    for split, before in ((g_split, g_init), (d_split, d_init)):
        assert min(rel_err(split[b]["main.0.weight"], before[b]) for b in range(B)) > 1e-3


def test_discriminator_needs_per_model_input(tmp_path):
    _, _, g_array, d_array = _arrays(tmp_path, per_model_d=False)
    with pytest.raises(ConfigError, match=r"per_model_inputs=\['input'\]"):
        FusedGAN(g_array, d_array, make_optimizer("adamw", B), make_optimizer("adamw", B))
