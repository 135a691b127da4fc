"""The array in your own PyTorch loop (README, "In your own training loop"): three CNNs with three learning rates
and weight decays, a hand-written loss, bfloat16 autocast, 2-step gradient accumulation, per-model clipping, a
cosine schedule per model, a DataLoader with random augmentation; then per-model checkpoints, each evaluated alone
on the held-out digits that `onnxfuse train --data sklearn:digits --eval-fraction 0.2 --seed 0` holds out.

    python examples/own_training_loop.py [OUT_DIR]
"""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import onnxfuse
from onnxfuse.recipe.datasets import load_named, split_holdout

B, STEPS = 3, int(os.environ.get("STEPS", 100))
out_dir = sys.argv[1] if len(sys.argv) > 1 else "own_loop_out"


class MyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        return self.fc(F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1))


data = load_named("sklearn:digits")                  # images [1797, 1, 8, 8] scaled to [0, 1], labels [1797]
train, held_out = split_holdout(data, 0.2, seed=0)   # the split `--eval-fraction 0.2 --seed 0` trains on


class Noisy(torch.utils.data.Dataset):               # your dataset, with its own augmentation
    def __len__(self):
        return len(train["labels"])

    def __getitem__(self, i):
        return torch.from_numpy(train["input"][i]) + 0.05 * torch.randn(1, 8, 8), int(train["labels"][i])


torch.manual_seed(0)
nets = [MyCNN() for _ in range(B)]                   # any torch module; one architecture, any weights
arr = onnxfuse.fuse(nets, torch.randn(2, 1, 8, 8))   # example inputs: one model's
opt = onnxfuse.optim.AdamW(arr, lr=[1e-3, 3e-3, 1e-2], weight_decay=[0.0, 0.01, 0.05])   # one value or B
scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(opt.model(b), T_max=STEPS) for b in range(B)]
loader = torch.utils.data.DataLoader(Noisy(), batch_size=64, shuffle=True)

step = 0
while step < STEPS:
    for micro, (x, y) in enumerate(loader):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = arr(x)                             # [B, 64, 10]: out[b] is model b's output
        logp = out.float().log_softmax(-1)           # a hand-written loss, one per model: [B]
        losses = -logp.gather(-1, y.expand(B, -1)[..., None]).squeeze(-1).mean(-1)
        (losses.sum() / 2).backward()                # the sum keeps each model's gradient its own
        if micro % 2 == 1:                           # 2-step gradient accumulation
            onnxfuse.optim.clip_grad_norm_(arr, max_norm=1.0)   # each model's own norm
            opt.step()
            opt.zero_grad()
            for s in scheds:
                s.step()
            step += 1
            if step == STEPS:
                break

os.makedirs(out_dir, exist_ok=True)
for b, sd in enumerate(arr.state_dicts()):           # B torch state_dicts with every key: strict=True loads
    torch.save(sd, os.path.join(out_dir, f"model_{b}.pt"))
arr.save(os.path.join(out_dir, "array"), overwrite=True)   # an array folder: `onnxfuse train` continues it

x, y = torch.from_numpy(held_out["input"]), torch.from_numpy(held_out["labels"])
for b in range(B):                                   # each model alone, from its checkpoint
    model = MyCNN()
    model.load_state_dict(torch.load(os.path.join(out_dir, f"model_{b}.pt")), strict=True)
    accuracy = (model.eval()(x).argmax(1) == y).float().mean().item()
    print(f"model {b}: lr {opt.param_groups[b]['initial_lr']:g}, held-out accuracy {accuracy:.1%}")
