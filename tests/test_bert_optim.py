"""bert_ref.optim: LAMB / LANS against their papers' update rules on hand-computed examples, decay groups, LR schedule."""
from __future__ import annotations

import math

import pytest
import torch

from bert_ref.optim import (LANS, OptimArgs, PolyWarmupSchedule, build_optimizer, lr_factor, no_decay, param_groups,
                            scaled_lr)
from ds_core.config import ConfigError

X0, G = [3.0, 4.0], [0.5, -1.0]  # ||x0|| = 5
LR, B1, B2, EPS, WD = 0.1, 0.9, 0.999, 1e-6, 0.01


def _norm(v):
    return math.sqrt(sum(a * a for a in v))


def _ref_lamb(x, grads, steps):
    """LAMB, You et al. 2019 (arXiv:1904.00962 v3, Algorithm 2 without bias correction, as pytorch_optimizer
    documents), phi(z) = min(z, 10), in plain Python floats."""
    m, v = [0.0] * len(x), [0.0] * len(x)
    for t in range(steps):
        g = grads[t]
        m = [B1 * a + (1 - B1) * b for a, b in zip(m, g)]
        v = [B2 * a + (1 - B2) * b * b for a, b in zip(v, g)]
        u = [a / (math.sqrt(b) + EPS) + WD * w for a, b, w in zip(m, v, x)]
        trust = min(_norm(x), 10.0) / (_norm(u) + EPS)
        x = [w - LR * trust * a for w, a in zip(x, u)]
    return x


def _ref_lans(x, grads, steps):
    """LANS, Zheng et al. 2020 (arXiv:2006.13484, Algorithm 2), phi = identity, in plain Python floats."""
    m, v = [0.0] * len(x), [0.0] * len(x)
    for t in range(1, steps + 1):
        g = grads[t - 1]
        gn = _norm(g)
        g = [a / gn for a in g]
        m = [B1 * a + (1 - B1) * b for a, b in zip(m, g)]
        v = [B2 * a + (1 - B2) * b * b for a, b in zip(v, g)]
        den = [math.sqrt(b / (1 - B2 ** t)) + EPS for b in v]
        r = [a / (1 - B1 ** t) / d + WD * w for a, d, w in zip(m, den, x)]
        c = [a / d + WD * w for a, d, w in zip(g, den, x)]
        xn = _norm(x)
        x = [w - LR * B1 * xn / _norm(r) * a - LR * (1 - B1) * xn / _norm(c) * b for w, a, b in zip(x, r, c)]
    return x


def _run(opt_cls, grads, steps, **kw):
    p = torch.nn.Parameter(torch.tensor(X0, dtype=torch.float64))
    opt = opt_cls([p], **kw)
    for t in range(steps):
        p.grad = torch.tensor(grads[t], dtype=torch.float64)
        opt.step()
    return p.detach().tolist()


GRADS = [G, [-0.2, 0.3], [1.0, 0.25]]


def test_lamb_first_step_hand_computed():
    from pytorch_optimizer import Lamb

    # m = 0.1 g = [0.05, -0.1]; v = 0.001 g^2 = [2.5e-4, 1e-3]; r = m / sqrt(v) ~ [3.16227, -3.16227];
    # u = r + 0.01 x = [3.19217, -3.12217]; ||u|| = 4.46521; trust = 5 / 4.46521 = 1.11977;
    # x1 = x0 - 0.1 * 1.11977 * u = [2.64255, 4.34962]
    got = _run(Lamb, GRADS, 1, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, weight_decouple=False,
               adam_debias=True)
    assert got == pytest.approx([2.64255, 4.34962], abs=2e-5)


def test_lamb_matches_paper_rule_over_steps():
    from pytorch_optimizer import Lamb

    got = _run(Lamb, GRADS, 3, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, weight_decouple=False,
               adam_debias=True)
    assert got == pytest.approx(_ref_lamb(X0, GRADS, 3), rel=1e-9, abs=1e-12)


def test_lans_first_step_hand_computed():
    # g~ = g / ||g|| ; with bias correction m^ = g~, v^ = g~^2 so r = c = sign(g~) = [1, -1] (eps negligible);
    # + 0.01 x -> [1.03, -0.96], ||.|| = 1.40801, trust = 5 / 1.40801 = 3.55111; both terms share it, so
    # x1 = x0 - 0.1 * 3.55111 * [1.03, -0.96] = [2.63424, 4.34091]
    got = _run(LANS, GRADS, 1, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    assert got == pytest.approx([2.63424, 4.34091], abs=2e-5)


def test_lans_matches_paper_rule_over_steps():
    got = _run(LANS, GRADS, 3, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    assert got == pytest.approx(_ref_lans(X0, GRADS, 3), rel=1e-9, abs=1e-12)


def test_lans_zero_grad_and_zero_weight_are_safe():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = LANS([p], lr=0.1)
    p.grad = torch.zeros(3)
    opt.step()
    assert torch.isfinite(p).all()
    p.grad = torch.tensor([1.0, 0.0, 0.0])
    opt.step()  # ||x|| = 0 -> trust ratio 1
    assert torch.isfinite(p).all() and p[0] < 0


def test_weight_decay_groups_exclude_bias_and_layernorm():
    from bert_ref.configs import debug
    from bert_ref.model import build_model

    model = build_model(debug())
    groups = param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = [names[id(p)] for p in groups[0]["params"]]
    skipped = [names[id(p)] for p in groups[1]["params"]]
    assert groups[0]["weight_decay"] == 0.01 and groups[1]["weight_decay"] == 0.0
    assert all(not n.endswith("bias") and "LayerNorm" not in n for n in decayed)
    assert any("LayerNorm.weight" in n for n in skipped) and any(n.endswith("dense.bias") for n in skipped)
    assert "bert.embeddings.word_embeddings.weight" in decayed
    assert len(decayed) + len(skipped) == len(list(model.parameters()))
    assert no_decay("cls.predictions.bias", None)
    for name in ("lamb", "lans", "adamw"):
        opt = build_optimizer(model, OptimArgs(optimizer=name, learning_rate=0.01))
        assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]


def test_lr_scaling_with_nodes():
    assert scaled_lr(0.0015, 16, 8) == pytest.approx(0.003)
    assert scaled_lr(0.0015, 8, 8) == pytest.approx(0.0015)
    assert scaled_lr(0.0015, 16, 8, enabled=False) == 0.0015
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, OptimArgs(optimizer="adamw", learning_rate=0.0015, scale_lr_with_nodes=True), 16)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.003)


def test_lr_schedule_warmup_constant_poly():
    f = lambda s: lr_factor(s, 100, 0.1, 0.2, 2.0)  # noqa: E731
    assert f(0) == pytest.approx(0.1) and f(4) == pytest.approx(0.5) and f(9) == 1.0
    assert f(10) == 1.0 and f(29) == 1.0 and f(30) == 1.0
    assert f(65) == pytest.approx(0.25)  # (1 - 35/70)^2
    assert f(99) == pytest.approx((1 / 70) ** 2) and f(100) == 0.0
    assert all(f(s) >= f(s + 1) for s in range(9, 100))
    assert lr_factor(0, 10, 0.0) == 1.0 and lr_factor(5, 10, 0.0) == pytest.approx(0.5)
    with pytest.raises(ConfigError):
        lr_factor(0, 0, 0.1)
    with pytest.raises(ConfigError):
        OptimArgs(warmup_proportion=0.8, constant_proportion=0.5).validate()
    with pytest.raises(ConfigError):
        OptimArgs(optimizer="sgd").validate()


def test_scheduler_drives_param_groups_and_round_trips():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sch = PolyWarmupSchedule(opt, 10, 0.2, 0.0, 1.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    sch.step()
    assert sch.get_last_lr() == [pytest.approx(1.0)]
    sch.step()
    state = sch.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sch2 = PolyWarmupSchedule(opt2, 10, 0.2, 0.0, 1.0)
    sch2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"]) == 1.0  # 2 warm-up steps done
    sch.step()
    sch2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"]) == pytest.approx(7 / 8)


@pytest.mark.parametrize("name,ref", [("lamb", _ref_lamb), ("lans", _ref_lans)])
def test_build_optimizer_uses_the_paper_rule(name, ref):
    """The optimizer train.py builds (library settings included) follows the reference for decayed weights."""
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.tensor(X0, dtype=torch.float64))
    opt = build_optimizer(model, OptimArgs(optimizer=name, learning_rate=LR, beta1=B1, beta2=B2, eps=EPS,
                                           weight_decay=WD))
    for g in GRADS:
        model.weight.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    assert model.weight.detach().tolist() == pytest.approx(ref(X0, GRADS, 3), rel=1e-9, abs=1e-12)
