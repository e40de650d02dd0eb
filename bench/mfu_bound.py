"""The MFU upper bound of bench.bert_step: what this CPU allows at all for the step it measures (its `--skip_bound`
part). Apart from bert_step.py, which measures the step itself, to keep each file short."""
from __future__ import annotations

import argparse


def bound_part(a: argparse.Namespace, preset, peak: float, dtype: str) -> dict:
    """What this CPU allows at all: the MFU the step would have if everything but its linear layers' GEMMs and the
    optimizer's own update were free (attention, softmax, LayerNorm, GELU, dropout, embeddings, loss, DeepSpeed's
    bf16 <-> fp32 copies and clipping cost nothing). Same threads, shapes, micro batch, accumulation and dtype as
    bench.bert_step's ours_part (`preset`: its model slice).

    t_linear: forward + backward (input and weight gradients) of every nn.Linear of the slice at its real row count
    (B*S rows in the encoder, B*P in the sparse MLM head, B in pooler/NSP), bf16, median of 5.
    t_opt: one step of the bench's LAMB over two flat fp32 tensors holding the slice's parameters (the decay and
    no-decay groups: the layout DeepSpeed's bf16 optimizer hands it), median of 3.
    mfu_upper_bound = step FLOPs / (accum * t_linear + t_opt) / peak; linear_only_mfu = linear FLOPs / t_linear /
    peak."""
    import statistics
    import time

    import torch

    from bert_ref.model import flops_per_sequence, hf_config
    from bert_ref.optim import build_optimizer, param_groups
    from ds_core.compat.torch_releases import meta_device
    from ds_core.config.optim import OptimArgs

    h, inter, B = preset.hidden_size, preset.intermediate_size, a.micro_batch
    P = preset.seq_len if a.dense_mlm else preset.max_predictions_per_seq
    rows_in_out = ([(B * preset.seq_len, h, h)] * 4 + [(B * preset.seq_len, h, inter), (B * preset.seq_len, inter, h)]
                   ) * preset.num_hidden_layers + [(B * P, h, h), (B * P, h, preset.vocab_size), (B, h, h), (B, h, 2)]
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    layers = [(torch.randn(r, k, generator=g).to(dt), torch.nn.Linear(k, n).to(dt),
               torch.randn(r, n, generator=g).to(dt)) for r, k, n in rows_in_out]
    for _, lin, _ in layers:
        lin.requires_grad_(True)
    linear_flops = sum(6 * r * k * n for r, k, n in rows_in_out)

    def linear_pass() -> float:
        t0 = time.perf_counter()
        for x, lin, dy in layers:
            xg = x.requires_grad_(True)
            lin(xg).backward(dy)
            xg.grad = None
            lin.weight.grad = lin.bias.grad = None
        return time.perf_counter() - t0

    linear_pass()
    t_linear = statistics.median(linear_pass() for _ in range(5))
    layers.clear()  # the tensors freed; linear_pass (which reads the list) is not called again

    # the slice's parameters as DeepSpeed's bf16 optimizer holds them: one flat fp32 tensor per weight-decay group
    from transformers import BertForPreTraining

    with meta_device():
        groups = param_groups(BertForPreTraining(hf_config(preset)), 0.01)
    sizes = [sum(prm.numel() for prm in grp["params"]) for grp in groups]
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(sizes[0]))
    model.bias = torch.nn.Parameter(torch.zeros(sizes[1]))
    opt = build_optimizer(model, OptimArgs(optimizer="lamb", learning_rate=1e-4, warmup_ratio=0.0))
    for prm in (model.weight, model.bias):
        prm.grad = torch.randn(prm.shape, generator=g)

    def opt_step() -> float:
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    opt_step()
    t_opt = statistics.median(opt_step() for _ in range(3))
    step_flops = flops_per_sequence(preset, mlm_positions=0 if a.dense_mlm else P) * B * a.grad_accum
    bound = step_flops / (a.grad_accum * t_linear + t_opt) / 1e12 / peak
    linear_only = linear_flops / t_linear / 1e12 / peak
    print(f"[bound] linear layers fwd+bwd {t_linear:.3f} s per micro batch ({linear_flops / t_linear / 1e12:.3f} "
          f"TFLOPs, {linear_only:.3f} of peak), LAMB update {t_opt:.3f} s per step over "
          f"{sum(sizes) / 1e6:.1f}M params -> MFU upper bound {bound:.3f}", flush=True)
    out = {"mfu_upper_bound": bound, "linear_only_mfu": linear_only, "linear_fwd_bwd_s_per_micro": t_linear,
           "optimizer_update_s_per_step": t_opt}
    if linear_only > 1:  # GEMMs faster than the "peak": the probe ran in a busy moment, the MFU figures read high
        out["bound_note"] = (f"linear layers ran at {linear_only:.2f} of the {peak:.4f} TFLOPs peak: that peak probe "
                             "read low (a busy machine); mfu and mfu_upper_bound are not meaningful in this run")
    return out
