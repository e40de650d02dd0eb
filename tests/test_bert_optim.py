"""bert_ref.optim / bert_ref.layerwise: NVLAMB (apex FusedLAMB), LANS (Habana) and AdamW against their reference
formulas on hand-computed steps, per-preset defaults, LR scaling with the global batch, decay groups, LR schedule."""
from __future__ import annotations

import math

import pytest
import torch

from bert_ref.layerwise import LANS, NVLAMB, FlatLayout, partition_segments
from bert_ref.optim import (
    PUBLISHED,
    bert_defaults,
    build_optimizer,
    for_preset,
    lr_factor,
    no_decay,
    param_groups,
    peak_lr,
)
from ds_core.config.optim import OptimArgs, schedule_for
from ds_core.errors import ConfigError

X0, G = [3.0, 4.0], [0.5, -1.0]  # ||x0|| = 5, ||g|| = 1.118 (> FusedLAMB's max_grad_norm 1: pre-normalized)
LR, B1, B2, EPS, WD = 0.1, 0.9, 0.999, 1e-6, 0.01
GRADS = [G, [-0.2, 0.3], [1.0, 0.25]]
BIAS0, BIAS_GRADS = [0.5, -0.25, 0.0], [[0.1, 0.2, -0.3], [0.0, -0.4, 0.2], [0.3, 0.1, 0.1]]


def _norm(v):
    return math.sqrt(sum(a * a for a in v))


def _ref_fused_lamb(xs, wds, grads, steps, max_grad_norm=1.0, use_nvlamb=False):
    """apex csrc/multi_tensor_lamb.cu (adam_w_mode=1, bias_correction=1, grad_averaging=1) in plain Python floats.
    xs: tensors (lists), wds: their weight decay, grads[t][i]: gradient of tensor i at step t."""
    xs = [list(x) for x in xs]
    ms, vs = [[0.0] * len(x) for x in xs], [[0.0] * len(x) for x in xs]
    for t in range(1, steps + 1):
        gn = math.sqrt(sum(a * a for g in grads[t - 1] for a in g))
        clip = gn / max_grad_norm if gn > max_grad_norm else 1.0  # clipped_global_grad_norm
        for i, (x, wd) in enumerate(zip(xs, wds)):
            g = [a / clip for a in grads[t - 1][i]]
            ms[i] = [B1 * m + (1 - B1) * a for m, a in zip(ms[i], g)]
            vs[i] = [B2 * v + (1 - B2) * a * a for v, a in zip(vs[i], g)]
            u = [(m / (1 - B1 ** t)) / (math.sqrt(v / (1 - B2 ** t)) + EPS) + wd * w
                 for m, v, w in zip(ms[i], vs[i], x)]
            pn, un = _norm(x), _norm(u)
            ratio = LR * pn / un if (use_nvlamb or wd != 0) and pn != 0 and un != 0 else LR  # LAMBStage2Functor
            xs[i] = [w - ratio * a for w, a in zip(x, u)]
    return xs


def _ref_habana_lans(xs, wds, grads, steps, adjust_step=False):
    """Habana Model-References deepspeed-bert lans.py (max_grad_norm=0, as run_pretraining.py passes) in floats."""
    xs = [list(x) for x in xs]
    ms, vs = [[0.0] * len(x) for x in xs], [[0.0] * len(x) for x in xs]
    for t in range(1, steps + 1):
        bt = t - 1 if adjust_step and t > 1 else t
        for i, (x, wd) in enumerate(zip(xs, wds)):
            g = grads[t - 1][i]
            gn = _norm(g)
            g = [a / (gn + EPS) for a in g] if gn != 0 else list(g)
            ms[i] = [B1 * m + (1 - B1) * a for m, a in zip(ms[i], g)]
            vs[i] = [B2 * v + (1 - B2) * a * a for v, a in zip(vs[i], g)]
            den = [math.sqrt(v / (1 - B2 ** bt)) + EPS for v in vs[i]]
            r = [m / (1 - B1 ** bt) / d + wd * w for m, d, w in zip(ms[i], den, x)]
            c = [a / d + wd * w for a, d, w in zip(g, den, x)]
            wn, rn, cn = _norm(x), _norm(r), _norm(c)
            ratio_m = LR * wn / rn if rn != 0 and wn != 0 else LR
            ratio_g = LR * wn / cn if cn != 0 and wn != 0 else LR
            xs[i] = [w - a * ratio_m * B1 - b * ratio_g * (1 - B1) for w, a, b in zip(x, r, c)]
    return xs


def _run(opt_cls, steps, with_bias=False, **kw):
    """Steps of opt_cls on a decayed weight (X0, GRADS) and, with_bias, an undecayed bias; float64."""
    w = torch.nn.Parameter(torch.tensor(X0, dtype=torch.float64))
    b = torch.nn.Parameter(torch.tensor(BIAS0, dtype=torch.float64))
    groups = [{"params": [w], "weight_decay": WD}] + ([{"params": [b], "weight_decay": 0.0}] if with_bias else [])
    opt = opt_cls(groups, lr=LR, betas=(B1, B2), eps=EPS, **kw)
    for t in range(steps):
        w.grad = torch.tensor(GRADS[t], dtype=torch.float64)
        b.grad = torch.tensor(BIAS_GRADS[t], dtype=torch.float64) if with_bias else None
        opt.step()
    return [w.detach().tolist()] + ([b.detach().tolist()] if with_bias else [])


def test_nvlamb_first_step_hand_computed():
    # ||g|| = 1.11803 > 1: g' = g / 1.11803 = [0.44721, -0.89443]; m^ = g', v^ = g'^2, so u = sign(g') (eps
    # negligible) + 0.01 x = [1.03, -0.96]; ||u|| = 1.40801; trust = 5 / 1.40801 = 3.55111;
    # x1 = x0 - 0.1 * 3.55111 * [1.03, -0.96] = [2.63424, 4.34091]
    assert _run(NVLAMB, 1)[0] == pytest.approx([2.63424, 4.34091], abs=2e-5)


@pytest.mark.parametrize("use_nvlamb", [False, True])
def test_nvlamb_matches_fused_lamb_kernel_over_steps(use_nvlamb):
    """Two tensors (the global pre-normalization spans both groups); the undecayed bias gets the trust ratio only
    with use_nvlamb, as in apex."""
    got = _run(NVLAMB, 3, with_bias=True, use_nvlamb=use_nvlamb)
    grads = [[g, bg] for g, bg in zip(GRADS, BIAS_GRADS)]
    want = _ref_fused_lamb([X0, BIAS0], [WD, 0.0], grads, 3, use_nvlamb=use_nvlamb)
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
    other = _ref_fused_lamb([X0, BIAS0], [WD, 0.0], grads, 3, use_nvlamb=not use_nvlamb)
    assert got[1] != pytest.approx(other[1], rel=1e-6)  # the flag changes the bias's step: the test can tell


def test_nvlamb_first_update_of_a_bert_large_weight():
    """At NVIDIA's phase-1 LR 6e-3 the first update of a 4096 x 1024 weight drawn N(0, 0.02)
    has RMS lr * ||w|| / ||u|| * rms(u) = lr * 0.02 = 1.20e-4 (pytorch_optimizer's Lamb gave 2.93e-5)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4096, 1024) * 0.02)
    w0 = w.detach().clone()
    opt = NVLAMB([{"params": [w], "weight_decay": 0.01}], lr=6e-3)
    w.grad = torch.randn_like(w) * 1e-4
    opt.step()
    rms = float((w.detach() - w0).pow(2).mean().sqrt())
    assert rms == pytest.approx(1.20e-4, rel=0.01)


def test_lans_first_step_hand_computed():
    # g~ = g / (||g|| + eps); m^ = g~, v^ = g~^2 so r = c = sign(g~) = [1, -1] (eps negligible); + 0.01 x ->
    # [1.03, -0.96], ||.|| = 1.40801, trust = 5 / 1.40801 = 3.55111 for both terms, so
    # x1 = x0 - 0.1 * 3.55111 * (0.9 + 0.1) * [1.03, -0.96] = [2.63424, 4.34091]
    assert _run(LANS, 1)[0] == pytest.approx([2.63424, 4.34091], abs=2e-5)


@pytest.mark.parametrize("adjust_step", [False, True])
def test_lans_matches_habana_over_steps(adjust_step):
    """Both groups get trust ratios (Habana's LANS has no use_nvlamb switch); adjust_step = Habana's ZeRO setting."""
    got = _run(LANS, 3, with_bias=True, adjust_step=adjust_step)
    grads = [[g, bg] for g, bg in zip(GRADS, BIAS_GRADS)]
    want = _ref_habana_lans([X0, BIAS0], [WD, 0.0], grads, 3, adjust_step=adjust_step)
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
    assert got[0] != pytest.approx(_ref_habana_lans([X0], [WD], [[g] for g in GRADS], 3,
                                                    adjust_step=not adjust_step)[0], rel=1e-7)


def test_adamw_first_step_hand_computed():
    # torch AdamW: x <- x (1 - lr wd) - lr m^ / (sqrt(v^) + eps) = 0.999 x0 - 0.1 sign(g) = [2.897, 4.096]
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.tensor(X0, dtype=torch.float64))
    opt = build_optimizer(model, OptimArgs(optimizer="adamw", learning_rate=LR, weight_decay=WD))
    model.weight.grad = torch.tensor(G, dtype=torch.float64)
    opt.step()
    assert model.weight.detach().tolist() == pytest.approx([2.897, 4.096], abs=1e-6)


@pytest.mark.parametrize("opt_cls", [NVLAMB, LANS])
def test_zero_grad_and_zero_weight_are_safe(opt_cls):
    p = torch.nn.Parameter(torch.zeros(3))
    opt = opt_cls([p], lr=0.1)
    p.grad = torch.zeros(3)
    opt.step()
    assert torch.isfinite(p).all()
    p.grad = torch.tensor([1.0, 0.0, 0.0])
    opt.step()  # ||x|| = 0 -> trust ratio 1
    assert torch.isfinite(p).all() and p[0] < 0


def testpartition_segments():
    # tensors of 5, 3 (+1 alignment padding), 4 elements: flat [0..5) [5..8) pad [9..13)
    numels, offsets = [5, 3, 4], [0, 5, 9]
    assert partition_segments(numels, offsets, 0, 7) == [(0, 0, 5), (1, 5, 2)]
    assert partition_segments(numels, offsets, 7, 7) == [(1, 0, 1), (-1, 1, 1), (2, 2, 4), (-1, 6, 1)]


@pytest.mark.parametrize("opt_cls", [NVLAMB, LANS])
def test_flat_tensor_with_layout_steps_like_separate_tensors(opt_cls):
    """What DeepSpeed hands the optimizer (one flat tensor, here with a padding gap) gives per-tensor results once
    the layout is attached, and refuses to step without one."""
    torch.manual_seed(0)
    a, b = torch.randn(6, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    ga, gb = [torch.randn(6, dtype=torch.float64) for _ in range(3)], [torch.randn(4, dtype=torch.float64)
                                                                        for _ in range(3)]
    pa, pb = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())
    sep = opt_cls([pa, pb], lr=0.05, weight_decay=0.01)
    flat = torch.nn.Parameter(torch.cat([a, torch.zeros(2, dtype=torch.float64), b]))
    whole = opt_cls([flat], lr=0.05, weight_decay=0.01)
    foreign = torch.nn.Parameter(flat.detach().clone())
    whole.param_groups[0]["params"] = [foreign]  # as DeepSpeed swaps in its flat partition
    foreign.grad = torch.zeros_like(foreign)
    whole.step()  # DeepSpeed's state-creating step inside deepspeed.initialize: zero grads, skipped
    assert not whole.state and torch.equal(foreign.detach(), flat.detach())
    foreign.grad = torch.ones_like(foreign)
    with pytest.raises(RuntimeError, match="attach_zero_layout"):
        whole.step()
    whole.param_groups[0]["params"] = [flat]
    whole.attach({id(flat): FlatLayout([(0, 0, 6), (-1, 6, 2), (1, 8, 4)], 2)}, None, False)
    for t in range(3):
        pa.grad, pb.grad = ga[t].clone(), gb[t].clone()
        flat.grad = torch.cat([ga[t], torch.zeros(2, dtype=torch.float64), gb[t]])
        sep.step()
        whole.step()
    assert torch.allclose(flat.detach()[:6], pa.detach(), rtol=1e-12, atol=1e-14)
    assert torch.allclose(flat.detach()[8:], pb.detach(), rtol=1e-12, atol=1e-14)
    assert torch.equal(flat.detach()[6:8], torch.zeros(2, dtype=torch.float64))


def test_presets_default_to_their_published_optimizer_and_lr():
    big = for_preset(OptimArgs(), "bert_1p5b")
    assert (big.optimizer, big.learning_rate, big.base_global_batch) == ("lans", 0.0015, 12288)  # Habana's JSON
    large = for_preset(OptimArgs(), "bert_large")
    assert (large.optimizer, large.learning_rate, large.base_global_batch) == ("lamb", 6e-3, 65536)
    assert for_preset(OptimArgs(), "bert_large", 2).learning_rate == 4e-3
    mine = for_preset(OptimArgs(optimizer="adamw", learning_rate=1e-4), "bert_1p5b")
    assert (mine.optimizer, mine.learning_rate) == ("adamw", 1e-4)  # explicit flags win
    assert set(PUBLISHED) >= {"bert_large", "bert_1p5b"}
    model = torch.nn.Linear(2, 2)
    assert isinstance(build_optimizer(model, for_preset(OptimArgs(), "bert_1p5b")), LANS)
    assert isinstance(build_optimizer(model, for_preset(OptimArgs(), "bert_large")), NVLAMB)
    with pytest.raises(ConfigError, match="for_preset"):
        build_optimizer(model, OptimArgs())
    with pytest.raises(ConfigError, match="no published recipe"):
        for_preset(OptimArgs(), "my_model")


def test_lr_scales_with_global_batch_not_nodes():
    args = for_preset(OptimArgs(scale_lr_with_global_batch=True), "bert_1p5b")
    assert peak_lr(args, 12288) == pytest.approx(0.0015)  # Habana's 12288 sequences: the published LR
    assert peak_lr(args, 2 * 12288) == pytest.approx(0.003)
    assert peak_lr(args, 16 * 8 * 96) == pytest.approx(0.0015)  # 16 nodes at the published batch: the base LR
    assert peak_lr(args, 8 * 8 * 48) == pytest.approx(0.000375)
    assert peak_lr(for_preset(OptimArgs(), "bert_1p5b"), 2 * 12288) == 0.0015  # off by default
    opt = build_optimizer(torch.nn.Linear(2, 2), args, global_batch=2 * 12288)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.003)] * 2
    assert not hasattr(OptimArgs(), "scale_lr_with_nodes")  # the node-count rule is gone
    with pytest.raises(ConfigError, match="train_batch_size"):
        peak_lr(args, 0)


def test_weight_decay_groups_exclude_bias_and_layernorm():
    from bert_ref.configs import debug, debug_pre_ln
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
    # Pre-LN (MegatronBert) names its pre-sublayer and final LayerNorms `ln`: no decay for them either
    pre = build_model(debug_pre_ln())
    names = {id(p): n for n, p in pre.named_parameters()}
    skipped = {names[id(p)] for p in param_groups(pre, 0.01)[1]["params"]}
    assert {"bert.encoder.layer.0.attention.ln.weight", "bert.encoder.layer.1.ln.weight",
            "bert.encoder.ln.weight", "bert.encoder.ln.bias"} <= skipped
    assert all(n.endswith("bias") or n.rsplit(".", 2)[-2] in ("ln", "LayerNorm") for n in skipped)


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
        OptimArgs(warmup_ratio=0.8, constant_proportion=0.5).validate()
    with pytest.raises(ConfigError):
        OptimArgs(optimizer="sgd").validate()


def test_scheduler_drives_param_groups_and_round_trips():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    args = bert_defaults(OptimArgs(lr_scheduler_type="poly_warmup", warmup_ratio=0.2, constant_proportion=0.0,
                                   poly_degree=1.0))
    assert for_preset(OptimArgs(), "bert_large").lr_scheduler_type == "nvidia_poly"  # the recipe's kind
    sch = schedule_for(args, 10)(opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    sch.step()
    assert sch.get_last_lr() == [pytest.approx(1.0)]
    sch.step()
    state = sch.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sch2 = schedule_for(args, 10)(opt2)
    sch2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"]) == 1.0  # 2 warm-up steps done
    sch.step()
    sch2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"]) == pytest.approx(7 / 8)


def test_layerwise_optimizers_refuse_bad_hyperparameters_naming_themselves():
    w = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=r"NVLAMB: invalid lr=0\.0"):
        NVLAMB(w, lr=0.0)
    with pytest.raises(ValueError, match=r"LANS: invalid .*betas=\(1\.0, 0\.9\)"):
        LANS(w, betas=(1.0, 0.9))
    assert NVLAMB(w, lr=1e-3).defaults["betas"] == (0.9, 0.999)


def _flat_step_ops(opt_cls, n_tensors: int) -> tuple[int, int]:
    """Top-level aten ops and host syncs of one step() on a flat tensor holding n_tensors parameter tensors (as
    DeepSpeed ZeRO hands it: one flat fp32 partition per group, with alignment padding between tensors)."""
    from ds_tools.op_count import OpCounter

    torch.manual_seed(0)
    numels = [3 + (k % 5) for k in range(n_tensors)]
    offsets = [sum(n + 1 for n in numels[:k]) for k in range(n_tensors)]  # one element of padding after each
    size = offsets[-1] + numels[-1] + 1
    flat = torch.nn.Parameter(torch.randn(size))
    opt = opt_cls([flat], lr=0.01, weight_decay=0.01, max_grad_norm=0.0)
    opt.attach({id(flat): FlatLayout(partition_segments(numels, offsets, 0, size), n_tensors)}, None, False)
    for _ in range(2):  # the second step is counted: state and the layout's index tensors exist by then
        flat.grad = torch.randn(size)
        with OpCounter() as count:
            opt.step()
    return count.total, count.syncs


@pytest.mark.parametrize("opt_cls", [NVLAMB, LANS])
def test_flat_step_op_count_does_not_grow_with_tensors(opt_cls):
    """The host cost of a step over DeepSpeed's flat partition is a fixed number of ops (norms by segment_reduce,
    trust ratios spread by repeat_interleave), not a few per parameter tensor, and never waits for the device."""
    ops10, syncs10 = _flat_step_ops(opt_cls, 10)
    ops400, syncs400 = _flat_step_ops(opt_cls, 400)
    assert ops10 == ops400, (ops10, ops400)
    assert syncs10 == syncs400 == 0
