"""NVLAMB (NVIDIA's FusedLAMB update) and LANS (Habana's), with trust ratios per parameter TENSOR also under ZeRO.

Why hand-written: apex's FusedLAMB is CUDA-only and Habana's LANS ships only inside Model-References; neither runs on
the CPU / HPU accelerators here, and neither knows DeepSpeed's partitions. pytorch_optimizer's Lamb is a different rule
(||w|| clamped at 10, no bias correction, no global gradient pre-normalization). Both rules below are tested against
the references' formulas step by step (tests/test_bert_optim.py).

Trust ratios under ZeRO: DeepSpeed's bf16 / ZeRO wrappers hand the optimizer one flat fp32 tensor per parameter group
and rank (ZeRO-1/2, bf16 ZeRO-1) or per sub-group (ZeRO-3), holding slices of many parameters. A "layer-wise" norm of
that flat tensor is a norm of a partition, not of a parameter: at world size 64 that is not LAMB. attach_zero_layout()
reads the wrapper's partition layout after deepspeed.initialize; step() then computes, per parameter tensor, the partial
sums of squares of its slice on this rank and sums them across the data-parallel group in one all-reduce (LANS needs a
second one for its per-tensor gradient normalisation, which must precede the moment update).
"""
from __future__ import annotations

import itertools
from typing import Any, Iterable

import torch

from ds_core.compat import changes
from ds_core.compat.zero_layout import FlatLayout, missing_attributes, partition_segments, zero_layouts
from ds_core.device.hpu import op_on_device, sum_dtype
from ds_core.errors import ConfigError


class _TensorwiseOptimizer(torch.optim.Optimizer):
    """Shared machinery: per-tensor sums of squares over segments, all-reduced when the layout is partitioned.

    max_grad_norm > 0: the gradients are first divided by max(1, ||g||_global / max_grad_norm) (FusedLAMB's and
    Habana's pre-normalization), on the device: apex's FusedLAMB computes the global norm with multi_tensor_l2norm
    and divides inside its kernel, with no host sync. Under a partitioned ZeRO layout the global norm is the one
    DeepSpeed's wrapper has just computed over every rank's partition (its _global_grad_norm, a device tensor set
    before it calls step(): ZeRO-1/2 and ZeRO-3 call step() once per parameter group or sub-group, so no call sees
    every gradient, and DeepSpeed computes that norm whatever its clipping setting). When the DeepSpeed JSON sets
    `gradient_clipping` to the same threshold, DeepSpeed divides first (within its 1e-6 guard) and the optimizer
    leaves the gradients alone; with `gradient_clipping` 0 the optimizer clips, and DeepSpeed's clip, which reads
    the norm on the host (two `.item()` per step in ZeRO-1/2, one in bf16 ZeRO-1's BF16_Optimizer), is gone.
    attach_zero_layout() decides which of the two clips."""

    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 max_grad_norm: float, adjust_step: bool):
        if lr <= 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"{type(self).__name__}: invalid lr={lr}, betas={betas}, eps={eps} or "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.max_grad_norm = float(max_grad_norm)
        self.adjust_step = adjust_step
        self._own = {id(p) for g in self.param_groups for p in g["params"]}
        self._layouts: dict[int, FlatLayout] = {}
        self._group = None
        self._partitioned = False
        self._clip_here = True  # False where DeepSpeed's gradient_clipping already divided (attach_zero_layout)
        self._global_norm: Any = None  # () -> the DeepSpeed wrapper's global gradient norm of this step
        self._idx_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def attach(self, layouts: dict[int, FlatLayout], process_group: Any, partitioned: bool,
               clip_here: bool = True, global_norm: Any = None) -> None:
        self._layouts, self._group, self._partitioned = layouts, process_group, partitioned
        self._clip_here, self._global_norm = clip_here, global_norm

    def _layout(self, p: torch.Tensor) -> FlatLayout:
        lay = self._layouts.get(id(p))
        if lay is not None:
            return lay
        if id(p) not in self._own:
            raise RuntimeError(f"{type(self).__name__}: step() got a tensor of {p.numel()} elements that is neither a "
                               "model parameter nor a known DeepSpeed partition; call bert_ref.layerwise."
                               "attach_zero_layout(engine, optimizer) after deepspeed.initialize so that trust ratios "
                               "are per parameter tensor, not per flat partition")
        return FlatLayout([(0, 0, p.numel())], 1)

    @torch.no_grad()
    def step(self, closure=None):
        """The part both optimizers share: the closure, DeepSpeed's initial zero-gradient step (skipped), this rank's
        (group, flat tensor, layout, offset) items, the global clip divisor, the number of norm keys and the device;
        then the optimizer's own _update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._is_init_step():
            return loss
        items = self._params()
        n = sum(lay.n_keys for _, _, lay, _ in items)
        self._update(items, n, items[0][1] if items else None)
        return loss

    def _update(self, items: list, n: int, dev) -> None:
        raise NotImplementedError

    def _is_init_step(self) -> bool:
        """DeepSpeed's bf16 / fp16 wrappers call step() once inside deepspeed.initialize, with all-zero gradients on
        their own fp32 tensors, to create the optimizer state (before attach_zero_layout can run). Skip it: the state
        is created on the first real step, and a zero-gradient step would still move the weights (weight decay) and
        the bias-correction step count."""
        params = [p for g in self.param_groups for p in g["params"]]
        if any(id(p) in self._own or id(p) in self._layouts for p in params):
            return False
        return all(p.grad is None or not p.grad.any() for p in params)

    def _bias_step(self, t: int) -> int:
        # Habana's run_pretraining passes adjust_step=True whenever ZeRO is on: from step 2 on the bias correction
        # uses t - 1 (their comment: "needed for Zero01 optimization when using DeepSpeed")
        return t - 1 if self.adjust_step and t > 1 else t

    def _index(self, t: torch.Tensor, lay: FlatLayout, off: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(segment lengths, global key per segment; padding -> slot n) of a flat tensor, on its device, cached: the
        step then works on whole flat tensors with a fixed number of ops, however many tensors they hold."""
        ck = (id(lay), off, n, t.device, t.numel())
        hit = self._idx_cache.get(ck)
        if hit is None:
            starts = [s for _, s, _ in lay.segments]
            lens = [ln for _, _, ln in lay.segments]
            if starts != [sum(lens[:i]) for i in range(len(lens))] or sum(lens) != t.numel():
                raise RuntimeError(f"{type(self).__name__}: a layout's segments must tile its flat tensor of "
                                   f"{t.numel()} elements back to back: {lay.segments[:4]}...")
            hit = (torch.tensor(lens, dtype=torch.int64, device=t.device),
                   torch.tensor([off + k if k >= 0 else n for k, _, _ in lay.segments], device=t.device))
            self._idx_cache[ck] = hit
        return hit

    def _expand(self, vals: torch.Tensor, t: torch.Tensor, lay: FlatLayout, off: int, n: int) -> torch.Tensor:
        """vals (n + 1 per-key values, the last for padding) spread over the elements of the flat tensor t."""
        lens, keys = self._index(t, lay, off, n)
        return vals.to(t.dtype).index_select(0, keys).repeat_interleave(lens, output_size=t.numel())

    def _sq_norms(self, items: Iterable[tuple[torch.Tensor, FlatLayout, int]], n: int,
                  like: torch.Tensor | None) -> torch.Tensor:
        """Sum of squares per key (global index = offset + key) over the given flat tensors, then one all-reduce if
        partitioned. items: (1-D tensor, layout, offset), consumed lazily (a generator keeps one temporary alive).
        One segment_reduce per flat tensor, not one norm per segment (on an HPU, where Habana lists no
        segment_reduce, one per segment); no host sync."""
        dtype = torch.float64 if like is not None and like.dtype == torch.float64 else torch.float32
        device = like.device if like is not None else torch.device("cpu")
        out = torch.zeros(n + 1, dtype=dtype, device=device)  # slot n collects the padding, dropped below
        for t, lay, off in items:
            lens, keys = self._index(t, lay, off, n)
            # float64 squares on CPU: its segment_reduce sums sequentially (fp32: ~1e-3 relative over 4M elements);
            # CUDA's is a tree reduction, where fp32 is as exact as torch._foreach_norm
            acc = torch.float64 if t.dtype == torch.float64 or t.device.type == "cpu" else torch.float32
            x = t.to(acc)
            if op_on_device("segment_reduce", t.device.type):
                # unsafe=True: skip segment_reduce's check that the lengths are >= 0 and sum to the size, two host
                # reads of the device per call; _index builds them from the layout, which covers the tensor exactly
                sums = torch.segment_reduce(x * x, "sum", lengths=lens, unsafe=True)
            else:
                # Habana lists no segment_reduce for HPU (ds_core.device.hpu.HPU_LISTED_OPS): one sum of squares per
                # segment in listed ops, as Habana's LANS takes one norm per tensor (grad.pow(2).sum()); ops grow
                # with the tensors here, which the HPU's graph (torch.compile / lazy mode) absorbs
                sums = torch.stack([x.narrow(0, s, ln).pow(2).sum() for _, s, ln in lay.segments])
            out.index_add_(0, keys, sums.to(dtype))
        out = out.narrow(0, 0, n)
        if self._partitioned:
            import deepspeed.comm as dist

            # named for DeepSpeed's comms_logger: an optimizer-step norm exchange, not gradient traffic (the study
            # report counts gradient collectives per step by op name: ds_tools.study.report.REDUCTION_OPS)
            dist.all_reduce(out, group=self._group, log_name="layerwise_norms_all_reduce")
        return out

    def _global_clip(self, items: list) -> float | torch.Tensor:
        """Divisor of the gradients for the global pre-normalization: 1.0 when disabled or done by DeepSpeed; else a
        0-d tensor on the device, max(1, ||g|| / max_grad_norm), no host sync."""
        if self.max_grad_norm <= 0 or not self._clip_here or not items:
            return 1.0
        if self._partitioned:
            norm = self._global_norm() if self._global_norm is not None else None
            if not isinstance(norm, torch.Tensor):
                raise RuntimeError(f"{type(self).__name__}: the DeepSpeed wrapper left no global gradient norm "
                                   f"({norm!r}) to clip by; keep zero_optimization.compute_grad_norm on, or set "
                                   f"gradient_clipping to max_grad_norm {self.max_grad_norm} in the DeepSpeed JSON")
        else:  # the model's own tensors: apex's multi_tensor_l2norm
            grads = [p.grad for _, p, _, _ in items]
            dev = grads[0].device.type
            # Habana lists neither torch._foreach_norm nor float64 for HPU (ds_core.device.hpu): a norm per tensor there
            norms = torch._foreach_norm(grads) if op_on_device("_foreach_norm", dev) else [g.norm() for g in grads]
            norm = torch.linalg.vector_norm(torch.stack(norms).to(sum_dtype(dev)))
        return torch.clamp(norm / self.max_grad_norm, min=1.0)

    def _params(self) -> list[tuple[dict, torch.Tensor, FlatLayout, int]]:
        """(group, param, layout, key offset) for every param with a gradient in this call, offsets back to back."""
        out, off = [], 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                lay = self._layout(p)
                out.append((group, p, lay, off))
                off += lay.n_keys
        return out

    @staticmethod
    def _ratios(w2: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
        """||w|| / ||u|| per key, 1 where either norm is 0 (apex: `ratio = lr` there); stays on the device."""
        ok = (w2 > 0) & (u2 > 0)
        return torch.where(ok, (w2 / torch.where(ok, u2, 1.0)).sqrt(), 1.0)

    def _state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st


class NVLAMB(_TensorwiseOptimizer):
    """LAMB as NVIDIA's BERT recipe runs it: apex FusedLAMB (csrc/multi_tensor_lamb.cu) with its defaults
    (bias_correction, adam_w_mode, grad_averaging, max_grad_norm=1.0). With c = max(1, ||g||_global / max_grad_norm):
        g' = g / c;  m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2
        u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd w
        w <- w - lr * (||w|| / ||u||) * u        (ratio 1 where ||w|| or ||u|| is 0; no clamp)
    The trust ratio applies to tensors with weight decay only, unless use_nvlamb (apex's flag; NVIDIA's
    run_pretraining.py leaves it False, so biases and LayerNorms take the plain Adam step lr * u)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, max_grad_norm: float = 1.0, use_nvlamb: bool = False,
                 adjust_step: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, max_grad_norm, adjust_step)
        self.use_nvlamb = use_nvlamb

    def _update(self, items: list, n: int, dev) -> None:
        clip = self._global_clip(items)
        for group, p, lay, off in items:
            b1, b2 = group["betas"]
            st = self._state(p)
            st["step"] += 1
            t = self._bias_step(st["step"])
            g = p.grad if isinstance(clip, float) else p.grad.div_(clip)
            m, v = st["exp_avg"], st["exp_avg_sq"]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            # the update overwrites the gradient, as apex's kernel does (no extra tensor-sized buffer)
            u = torch.div(v, 1 - b2 ** t, out=p.grad).sqrt_().add_(group["eps"])
            u.reciprocal_().mul_(m).div_(1 - b1 ** t)
            if group["weight_decay"]:
                u.add_(p, alpha=group["weight_decay"])
        trusted = [(p, lay, off) for group, p, lay, off in items if self.use_nvlamb or group["weight_decay"]]
        like = items[0][1] if items else None
        ratio = None
        if trusted:  # ONE all-reduce carries ||w||^2 and ||u||^2 of every trusted tensor
            sq = self._sq_norms([(p.view(-1), lay, off) for p, lay, off in trusted]
                                + [(p.grad.view(-1), lay, n + off) for p, lay, off in trusted], 2 * n, like)
            ratio = self._ratios(sq[:n], sq[n:])
        for group, p, lay, off in items:
            on, lr = self.use_nvlamb or group["weight_decay"], group["lr"]
            if on and ratio is not None:  # lr * ratio per tensor, lr on the padding (its update is 0 or unread)
                scale = self._expand(torch.cat([ratio, ratio.new_ones(1)]).mul_(lr), p.view(-1), lay, off, n)
                p.view(-1).addcmul_(scale, p.grad.view(-1), value=-1.0)
            else:
                p.add_(p.grad, alpha=-lr)


class LANS(_TensorwiseOptimizer):
    """LANS as Habana's deepspeed-bert ships it (Model-References PyTorch/nlp/DeepSpeedExamples/deepspeed-bert/lans.py;
    Zheng et al. 2020, arXiv:2006.13484, Algorithm 2). Per tensor, with c the global clip divisor (max_grad_norm > 0
    only; Habana's run_pretraining passes 0 and clips through DeepSpeed's gradient_clipping 1.0 instead, the same
    division by max(1, ||g|| / 1.0) within DeepSpeed's 1e-6 guard):
        g = g / c;  g~ = g / (||g|| + eps) (g itself where ||g|| = 0)
        m = b1 m + (1 - b1) g~;  v = b2 v + (1 - b2) g~^2;  d = sqrt(v / (1 - b2^t)) + eps
        r = (m / (1 - b1^t)) / d + wd w;  c = g~ / d + wd w
        w <- w - lr b1 (||w|| / ||r||) r - lr (1 - b1) (||w|| / ||c||) c      (each ratio 1 where a norm is 0)
    Trust ratios apply to every tensor, decayed or not (as Habana's)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, max_grad_norm: float = 0.0, adjust_step: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, max_grad_norm, adjust_step)

    def _update(self, items: list, n: int, dev) -> None:
        bc: dict[int, tuple[float, float]] = {}  # bias corrections of this step, per tensor
        clip = self._global_clip(items)
        # all-reduce 1: per-tensor ||g||^2 and ||w||^2 (g~ needs ||g|| before the moments move)
        sq = self._sq_norms([(p.grad.view(-1), lay, off) for _, p, lay, off in items]
                            + [(p.view(-1), lay, n + off) for _, p, lay, off in items], 2 * n, dev)
        gnorm, w2 = sq[:n].sqrt() / clip, sq[n:]
        for group, p, lay, off in items:
            b1, b2 = group["betas"]
            eps, wd = group["eps"], group["weight_decay"]
            st = self._state(p)
            st["step"] += 1
            t = self._bias_step(st["step"])
            bc[id(p)] = (1 - b1 ** t, 1 - b2 ** t)
            g = p.grad
            # g / clip / (||g|| + eps), g / clip where ||g|| = 0 and on the padding
            inv = torch.where(gnorm != 0, 1.0 / (gnorm + eps), 1.0)
            g.view(-1).mul_(self._expand(torch.cat([inv, inv.new_ones(1)]) / clip, g.view(-1), lay, off, n))
            m, v = st["exp_avg"], st["exp_avg_sq"]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            g.div_((v / (1 - b2 ** t)).sqrt_().add_(eps))  # c, kept in the gradient buffer
            if wd:
                g.add_(p, alpha=wd)
        # all-reduce 2: per-tensor ||r||^2 and ||c||^2; r is recomputed when applied rather than kept (memory)
        r_parts = ((self._r(group, p, bc[id(p)]).view(-1), lay, off) for group, p, lay, off in items)
        c_parts = ((p.grad.view(-1), lay, n + off) for _, p, lay, off in items)
        sq = self._sq_norms(itertools.chain(r_parts, c_parts), 2 * n, dev)
        one = sq.new_ones(1)
        ratio_r, ratio_c = torch.cat([self._ratios(w2, sq[:n]), one]), torch.cat([self._ratios(w2, sq[n:]), one])
        for group, p, lay, off in items:  # each term has its own ratio, per tensor (1 on the padding)
            b1, lr = group["betas"][0], group["lr"]
            upd, cf = self._r(group, p, bc[id(p)]).view(-1), p.grad.view(-1)
            upd.mul_(self._expand(ratio_r * (lr * b1), upd, lay, off, n))
            upd.addcmul_(self._expand(ratio_c * (lr * (1 - b1)), cf, lay, off, n), cf)
            p.sub_(upd.view_as(p))

    def _r(self, group: dict, p: torch.Tensor, bc: tuple[float, float]) -> torch.Tensor:
        st, (bc1, bc2) = self.state[p], bc
        r = (st["exp_avg_sq"] / bc2).sqrt_().add_(group["eps"])
        r.reciprocal_().mul_(st["exp_avg"]).div_(bc1)
        if group["weight_decay"]:
            r.add_(p, alpha=group["weight_decay"])
        return r


def attach_zero_layout(engine: Any, optimizer: torch.optim.Optimizer) -> None:
    """After deepspeed.initialize: give a NVLAMB / LANS optimizer the partition layout of the engine's ZeRO / bf16
    wrapper, so that its trust ratios are per parameter tensor, and decide who does the global gradient clip: the
    optimizer (on the device, across ranks) where the DeepSpeed JSON's gradient_clipping is 0, DeepSpeed where it
    equals max_grad_norm (the optimizer's would then divide by 1). No-op for other optimizers. Raises ConfigError
    where both are set to different thresholds (the gradients would be clipped twice, at two norms)."""
    if not isinstance(optimizer, _TensorwiseOptimizer):
        return
    name = type(optimizer).__name__
    # ds_core.compat.changes: zero_partition_layout, the read of the wrapper's layout, decided per wrapper instance
    read = changes.outcome("zero_partition_layout")
    off = read.state in (changes.State.REFUSED, changes.State.SWITCHED_OFF)
    why = missing_attributes(engine.optimizer) or (str(read) if off else None)
    if why:
        raise ConfigError(f"{name} computes its trust ratios per parameter tensor from DeepSpeed's partition layout, "
                          f"and {why}: run {name} with another ZeRO stage, or --optimizer adamw")
    layouts, group = zero_layouts(engine.optimizer)
    if not layouts and engine.zero_optimization_stage() > 0:
        raise ConfigError(f"{name} under ZeRO stage {engine.zero_optimization_stage()}: DeepSpeed's optimizer "
                          f"wrapper {type(engine.optimizer).__name__} is not one whose partition layout is known "
                          f"(ds_core.compat.zero_layout.READS); its trust ratios would be per partition, not per "
                          f"tensor")
    partitioned = group is not None
    clip = float(engine.gradient_clipping() or 0.0)
    if optimizer.max_grad_norm > 0 and clip > 0 and clip != optimizer.max_grad_norm:
        raise ConfigError(f"{type(optimizer).__name__} clips gradients at their global norm {optimizer.max_grad_norm} "
                          f"(max_grad_norm) and the DeepSpeed JSON's gradient_clipping is {clip}: set "
                          f"\"gradient_clipping\": 0 in the DeepSpeed JSON (the optimizer clips on the device, no host "
                          f"sync) or {optimizer.max_grad_norm} (DeepSpeed clips; ZeRO stage "
                          f"{engine.zero_optimization_stage()})")
    wrapper = engine.optimizer
    optimizer.attach(layouts, group, partitioned, clip_here=not (partitioned and clip > 0),
                     global_norm=lambda: getattr(wrapper, "_global_grad_norm", None))


__all__ = ["NVLAMB", "LANS", "FlatLayout", "partition_segments", "zero_layouts", "attach_zero_layout"]
