"""Makes tests/data/lr_reference.npz: NVIDIA's and Habana's own PolyWarmUpScheduler, stepped as their
run_pretraining.py steps it, LR of every update. Not part of the project: run it from a directory OUTSIDE the repository
holding the references' files (nothing else of theirs is needed):
    nvidia/schedulers.py  NVIDIA/DeepLearningExamples 7a4c42501ce05ac5b76999e3b9ddadeffd177b1d
                          PyTorch/LanguageModeling/BERT/schedulers.py
    habana/schedulers.py, habana/lans.py  HabanaAI/Model-References 06bfc5eaa56c3282c26896efd535982abe52b2eb
                          PyTorch/nlp/DeepSpeedExamples/deepspeed-bert/{schedulers,lans}.py
    python make_lr_reference.py OUT.npz
"""
import importlib.util
import sys

import numpy as np
import torch
from torch.optim import Optimizer


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m

nv = load("nvidia/schedulers.py", "nv_sched")
hb = load("habana/schedulers.py", "hb_sched")
hb_lans = load("habana/lans.py", "hb_lans")

class FusedLAMBStub(Optimizer):
    """Only what the scheduler reads: apex FusedLAMB.step's per-group step count (apex/optimizers/fused_lamb.py:
    `if 'step' in group: group['step'] += 1 else: group['step'] = 1`)."""
    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))
    def step(self, closure=None):
        for group in self.param_groups:
            if 'step' in group:
                group['step'] += 1
            else:
                group['step'] = 1

def groups(lr=None):
    p1, p2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    return [{'params': [p1], 'weight_decay': 0.01}, {'params': [p2], 'weight_decay': 0.0}]

def nvidia(lr, warmup, total, phase2=False, phase1_end=7038):
    # run_pretraining.py prepare_model_and_optimizer + the training loop (lines 383-408, 611-613 at 7a4c4250)
    opt = FusedLAMBStub(groups(), lr=lr)
    sched = nv.PolyWarmUpScheduler(opt, warmup=warmup, total_steps=total)
    if phase2:  # --resume_from_checkpoint --phase2 from phase 1's last checkpoint:
        # global_step = resume_step - phase1_end_step
        p1 = FusedLAMBStub(groups(), lr=6e-3)
        for _ in range(phase1_end):
            p1.step()
        ckpt = {'optimizer': p1.state_dict()}
        global_step = phase1_end - phase1_end
        for it, item in enumerate(ckpt['optimizer']['param_groups']):
            item['step'] = global_step
            item['t_total'] = total
            item['warmup'] = warmup
            item['lr'] = lr
        opt.load_state_dict(ckpt['optimizer'])
    lrs, global_step = [], 0
    while global_step < total:  # steps_this_run = max_steps
        sched.step()  # "learning rate warmup", before take_optimizer_step
        lrs.append(opt.param_groups[0]['lr'])
        opt.step()
        global_step += 1
    return np.array(lrs, dtype=np.float64)

def habana(lr, warmup, const, degree, total, zero=True):
    # run_pretraining.py: LANS(max_grad_norm=0., eps=1e-6, adjust_step=args.zero_optimization), PolyWarmUpScheduler
    # handed to deepspeed.initialize, which steps it after each optimizer step. With bf16 + ZeRO-1 DeepSpeed's
    # optimizer wrapper calls optimizer.step() once inside initialize (zero gradients) to create the state: that is
    # the step LANS's adjust_step takes back for bias correction, and the scheduler reads param_group['step'].
    opt = hb_lans.LANS(groups(), lr=lr, max_grad_norm=0., eps=1e-6, adjust_step=zero)
    sched = hb.PolyWarmUpScheduler(opt, warmup=warmup, total_steps=total, degree=degree, constant=const)
    if zero:
        opt.step()  # the wrapper's init step (params have no grad: LANS only counts the step)
    lrs = []
    for _ in range(total):
        lrs.append(float(opt.param_groups[0]['lr']))
        opt.step()    # engine.step(): optimizer, then lr_scheduler.step()
        sched.step()
    return np.array(lrs, dtype=np.float64)

out = dict(nvidia_large_p1=nvidia(6e-3, 0.2843, 7038),
           nvidia_large_p2=nvidia(4e-3, 0.128, 1563, phase2=True),
           habana_1p5b=habana(0.0015, 0.05, 0.25, 1.0, 155000))
# Habana's script passes lr as torch.tensor(args.learning_rate) (float32): the LR it applies is float32.
h32 = []
opt = hb_lans.LANS(groups(), lr=torch.tensor(0.0015), max_grad_norm=0., eps=1e-6, adjust_step=True)
s = hb.PolyWarmUpScheduler(opt, warmup=0.05, total_steps=155000, degree=1.0, constant=0.25)
opt.step()
for _ in range(155000):
    h32.append(float(opt.param_groups[0]['lr']))
    opt.step()
    s.step()
h32 = np.array(h32)
rel = np.abs(h32 - out['habana_1p5b']) / np.maximum(np.abs(out['habana_1p5b']), 1e-300)
print("habana float32-tensor LR vs float LR: max rel diff", rel[out['habana_1p5b'] > 0].max())
for k, v in out.items():
    print(k, len(v), v[[0, 1, 2, 100, len(v)//3, len(v) - 2, len(v) - 1]])
np.savez_compressed(sys.argv[1], **out)
