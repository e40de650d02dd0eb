"""ds_core.schedule against its references: transformers.get_scheduler (LR per step, warm-up), poly_warmup (a
Habana-like schedule) as bert_ref.optim ran it, and Trainer.get_decay_parameter_names (decay groups). No DeepSpeed here;
the schedule through the real engine on 2 ranks is checked in tests/test_bt_train.py."""
from __future__ import annotations

import math

import pytest
import torch

from ds_core.errors import ConfigError
from ds_core.schedule import (
    LRSchedule,
    decay_parameter_names,
    lr_schedule,
    param_groups,
    poly_warmup_factor,
    total_optimizer_steps,
    warmup_steps_for,
)


def _reference_lrs(kind: str, base: float, warmup: int, total: int, n: int) -> list[float]:
    """LR of each optimizer step under transformers' own scheduler on a torch optimizer (LambdaLR)."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=base)
    sched = get_scheduler(kind, opt, num_warmup_steps=warmup, num_training_steps=total)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])  # the LR the next update uses
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind,warmup", [("linear", 3), ("linear", 0), ("cosine", 4), ("cosine_with_restarts", 2),
                                         ("polynomial", 3), ("constant_with_warmup", 5), ("constant", 0),
                                         ("inverse_sqrt", 4)])
def test_lr_per_step_equals_transformers_get_scheduler(kind, warmup):
    total, base = 20, 3e-4
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([{"params": [p1], "weight_decay": 0.1}, {"params": [p2], "weight_decay": 0.0}], lr=base)
    sched = lr_schedule(kind, total, warmup)(opt)
    got = []
    for _ in range(total + 2):  # past the end too: linear/cosine hold 0 there
        got.append([g["lr"] for g in opt.param_groups])
        sched.step()
    want = _reference_lrs(kind, base, warmup, total, total + 2)
    assert [g[0] for g in got] == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert all(a == b for a, b in got)  # both decay groups follow the same schedule
    if warmup:  # Trainer's numbering: the first update uses LR 0, the peak is reached after the warm-up steps
        assert got[0][0] == 0.0 and got[warmup - 1][0] < base
    if warmup and kind != "inverse_sqrt":
        assert got[warmup][0] == pytest.approx(base)


def test_schedule_state_round_trip_resumes_at_the_same_lr():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = lr_schedule("cosine", 50, 5)(opt)
    for _ in range(17):
        sched.step()
    state, lr17 = sched.state_dict(), opt.param_groups[0]["lr"]
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    resumed = lr_schedule("cosine", 50, 5)(opt2)
    resumed.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == lr17 == pytest.approx(_reference_lrs("cosine", 1e-3, 5, 50, 18)[17])


@pytest.mark.parametrize("total,warm,const,degree", [(100, 0.1, 0.0, 1.0), (37, 0.2843, 0.0, 1.0),
                                                     (64, 0.05, 0.25, 0.5), (10, 0.0, 0.0, 2.0)])
def test_poly_warmup_kind_follows_the_factor(total, warm, const, degree):
    """BERT's schedule (bert_ref.optim.schedule_for uses poly_warmup_factor; its hand-computed values are in
    tests/test_bert_optim.py) as an LRSchedule kind with the warm-up given in steps."""
    lr_factor = poly_warmup_factor
    steps = int(round(warm * total))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = lr_schedule("poly_warmup", total, steps, constant_proportion=const, degree=degree)(opt)
    for step in range(total):
        assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * lr_factor(step, total, steps / total, const, degree))
        sched.step()


def test_warmup_steps_resolve_as_trainer():
    assert warmup_steps_for(100, warmup_steps=7) == 7
    assert warmup_steps_for(100, warmup_ratio=0.061) == 7  # ceil, as TrainingArguments.get_warmup_steps
    assert warmup_steps_for(100, warmup_steps=0.061) == 7  # transformers 5: warmup_steps < 1 is a ratio
    assert warmup_steps_for(100) == 0
    with pytest.raises(ConfigError, match="both set"):
        warmup_steps_for(100, warmup_steps=5, warmup_ratio=0.1)
    with pytest.raises(ConfigError, match="constant_with_warmup"):
        lr_schedule("constant", 100, 10)
    with pytest.raises(ConfigError, match="expected one of"):
        lr_schedule("reduce_lr_on_plateau", 100, 0)


def test_total_optimizer_steps_counts_accumulation_across_epochs():
    assert total_optimizer_steps(max_steps=12, max_epochs=3, micro_batches_per_epoch=5, grad_accum=2) == 12
    assert total_optimizer_steps(max_steps=0, max_epochs=3, micro_batches_per_epoch=5, grad_accum=2) == 7
    assert total_optimizer_steps(max_steps=0, max_epochs=2, micro_batches_per_epoch=4, grad_accum=1) == 8


def test_decay_groups_are_trainers():
    from transformers import Trainer

    from bridgetower_ds.configs import ModelArgs
    from bridgetower_ds.model import build_model

    model = build_model(ModelArgs(preset="debug"))
    names = decay_parameter_names(model)
    # the same list as Trainer's method (it does not use the Trainer instance)
    assert names == Trainer.get_decay_parameter_names(None, model)
    all_names = [n for n, _ in model.named_parameters()]
    no_decay = set(all_names) - set(names)
    assert no_decay and all(n.endswith("bias") or "layernorm" in n.lower() or ".ln_" in n for n in no_decay), \
        sorted(no_decay)[:20]
    assert not any(n.endswith("bias") for n in names)
    assert "bridgetower.text_model.embeddings.LayerNorm.weight" in no_decay
    assert "itc_text_head.fc.weight" in names
    groups = param_groups(model, 0.01, lr=1e-4)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for g in groups for p in g["params"]} == trainable  # frozen pooler left out, nothing twice
    assert sum(len(g["params"]) for g in groups) == len(trainable)
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert groups[0]["weight_decay"] == 0.01 and groups[1]["weight_decay"] == 0.0
    assert all(by_id[id(p)] in set(names) for p in groups[0]["params"])
    assert all(by_id[id(p)] in no_decay for p in groups[1]["params"])
    assert all(g["lr"] == 1e-4 for g in groups)


def test_lr_schedule_is_a_plain_class_deepspeed_can_drive():
    # DeepSpeed's ZeRO wrappers are not torch Optimizers; anything with param_groups works
    class Wrapper:
        def __init__(self):
            self.param_groups = [{"lr": 0.5}, {"lr": 0.5}]

    w = Wrapper()
    s = LRSchedule(w, lambda step: 1.0 / (step + 1))
    s.step()
    s.step()
    assert s.get_last_lr() == [0.5 / 3, 0.5 / 3] and math.isclose(w.param_groups[1]["lr"], 0.5 / 3)
