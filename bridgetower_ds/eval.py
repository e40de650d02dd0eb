"""Contrastive loss, retrieval recall@k, and the distributed evaluation pass.

Loss: BridgeTower's ITC objective, (CE(text->image) + CE(text->cross) + CE(image->cross)) / 3 over the logits
scaled by exp(logit_scale), computed in fp32 from the model's normalized embeddings. Negatives are the other
samples of the same micro batch on the same rank ("in-batch negatives per rank", like the reference), unless
global negatives are asked for, which all-gathers the embeddings across data-parallel ranks first.

Recall: image->text and text->image over the whole split, from the unimodal embeddings (the cross-modal embedding
needs a (text, image) pair, so it cannot rank a full gallery). Row i of the split pairs image i with caption i;
embeddings are gathered from every rank and de-duplicated by row id before ranking.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

KS = (1, 5, 10)


def contrastive_loss(text: torch.Tensor, image: torch.Tensor, cross: torch.Tensor, logit_scale: torch.Tensor,
                     *, global_negatives: bool = False) -> torch.Tensor:
    """BridgeTower ITC loss in fp32 for L2-normalized [B, D] embeddings; matches the model's return_loss=True."""
    text, image, cross = text.float(), image.float(), cross.float()
    scale = logit_scale.float().exp()
    labels = torch.arange(text.shape[0], device=text.device)
    if global_negatives and torch_dist.is_available() and torch_dist.is_initialized() \
            and torch_dist.get_world_size() > 1:
        # Keys from every rank (gradients flow through this rank's slice only), queries stay local. Micro batches
        # may differ in size across ranks (dropped bad images), so the gather pads and trims.
        sizes = _rank_sizes(text.shape[0], text.device)
        image_k, cross_k = _gather_with_grad(image, sizes), _gather_with_grad(cross, sizes)
        labels = labels + sum(sizes[:torch_dist.get_rank()])
    else:
        image_k, cross_k = image, cross
    t2i = F.cross_entropy(text @ image_k.t() * scale, labels)
    t2c = F.cross_entropy(text @ cross_k.t() * scale, labels)
    i2c = F.cross_entropy(image @ cross_k.t() * scale, labels)
    return (t2i + t2c + i2c) / 3.0


def _rank_sizes(n: int, device: torch.device) -> list[int]:
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(torch_dist.get_world_size())]
    torch_dist.all_gather(sizes, torch.tensor([n], dtype=torch.long, device=device))
    return [int(t.item()) for t in sizes]


def _gather_with_grad(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenation of every rank's [n_r, D] rows; only this rank's slice carries gradient."""
    pad = max(sizes) - x.shape[0]
    padded = torch.cat([x.detach(), x.new_zeros((pad, *x.shape[1:]))]) if pad else x.detach()
    parts = [torch.empty_like(padded) for _ in sizes]
    torch_dist.all_gather(parts, padded.contiguous())
    parts = [p[:n] for p, n in zip(parts, sizes)]
    parts[torch_dist.get_rank()] = x
    return torch.cat(parts, dim=0)


def recall_at_k(sim: torch.Tensor, ks: Sequence[int] = KS) -> dict[str, float]:
    """Retrieval recall from an [N_images, N_texts] similarity matrix whose true pairs lie on the diagonal.

    i2t_r{k}: fraction of images whose own caption is among its k highest-scoring captions; t2i_r{k}: the same for
    captions over images. Ties count against the true pair (a tie with a wrong item ranks it first), so a constant
    matrix scores recall k / N, not 1.
    """
    if sim.ndim != 2 or sim.shape[0] != sim.shape[1]:
        raise ValueError(f"similarity matrix must be square [N, N], got {tuple(sim.shape)}")
    sim = sim.float()
    pos = sim.diagonal()
    # rank of the true item = number of other items scoring >= it (0 = best)
    i2t_rank = (sim >= pos[:, None]).sum(dim=1) - 1
    t2i_rank = (sim >= pos[None, :]).sum(dim=0) - 1
    out = {}
    for k in ks:
        out[f"i2t_r{k}"] = (i2t_rank < k).float().mean().item()
        out[f"t2i_r{k}"] = (t2i_rank < k).float().mean().item()
    return out


def _gather_rows(x: torch.Tensor) -> torch.Tensor:
    """all_gather of [n_rank, ...] tensors whose n differs per rank (pads to the max, then trims)."""
    if not (torch_dist.is_available() and torch_dist.is_initialized()) or torch_dist.get_world_size() == 1:
        return x
    n = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(torch_dist.get_world_size())]
    torch_dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    pad = torch.zeros((max(sizes) - x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded = torch.cat([x, pad], dim=0).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    torch_dist.all_gather(parts, padded)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)], dim=0)


def _any_rank(flag: bool, device: torch.device) -> bool:
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return bool(t.item())


@torch.no_grad()
def evaluate(engine, batches: Iterable[dict], *, prefix: str = "eval") -> dict[str, float]:
    """One pass over a split: mean contrastive loss (per-rank in-batch negatives, sample-weighted over all
    ranks), and i2t / t2i recall@1/5/10 over the gathered split. Every rank must call it (collectives).

    Ranks advance in lock-step: while any rank still has a batch, all run a forward (a rank that ran out repeats
    its last batch and drops the result), so ZeRO-3's parameter gathers never wait on a rank that has finished.
    """
    module = engine.module if hasattr(engine, "module") else engine
    device = next(module.parameters()).device
    was_training = module.training
    module.eval()
    # Eval loss always uses per-rank in-batch negatives (ranks' last batches may differ in size).
    had_global = "global_negatives" in vars(module)
    saved_global = getattr(module, "global_negatives", False)
    module.global_negatives = False
    it = iter(batches)
    last = None
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_sum = torch.zeros((), dtype=torch.float64, device=device)
    texts, images, rows = [], [], []
    try:
        while True:
            batch = next(it, None)
            if not _any_rank(batch is not None, device):
                break
            real = batch is not None
            if real:
                last = batch
            elif last is None:
                raise RuntimeError("evaluation: this rank got no batch at all while another did; the split is "
                                   "smaller than the number of ranks")
            b = {k: v.to(device, non_blocking=True) for k, v in (batch if real else last).items()
                 if isinstance(v, torch.Tensor)}
            out = engine(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                         pixel_values=b["pixel_values"], return_loss=True)
            if not real:
                continue
            n = b["input_ids"].shape[0]
            # rows with index < 0 are padding/fill-in repeats: they weigh nothing and are not ranked
            n_real = int((b["index"] >= 0).sum().item()) if "index" in b else n
            loss_sum += out.loss.detach().double() * n_real
            n_sum += n_real
            texts.append(out.text_embeds.float())
            images.append(out.image_embeds.float())
            rows.append(b["index"].long() if "index" in b else
                        torch.arange(n, device=device) + sum(r.shape[0] for r in rows))
    finally:
        module.train(was_training)
        if had_global:
            module.global_negatives = saved_global
        else:
            vars(module).pop("global_negatives", None)

    dim = module.config.contrastive_hidden_size
    text = torch.cat(texts) if texts else torch.zeros((0, dim), device=device)
    image = torch.cat(images) if images else torch.zeros((0, dim), device=device)
    row = torch.cat(rows) if rows else torch.zeros((0,), dtype=torch.long, device=device)
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.all_reduce(loss_sum)
        torch_dist.all_reduce(n_sum)
    text, image, row = _gather_rows(text), _gather_rows(image), _gather_rows(row)
    # Ranks' shares may be padded with repeats (marked index -1, or a repeated row id): keep one of each row.
    row_sorted, order = torch.sort(row, stable=True)
    keep = row_sorted >= 0
    keep[1:] &= row_sorted[1:] != row_sorted[:-1]
    order = order[keep]
    text, image = text[order], image[order]
    result = {f"{prefix}_loss": (loss_sum / n_sum.clamp(min=1)).item(), f"{prefix}_samples": int(text.shape[0])}
    if text.shape[0]:
        for k, v in recall_at_k(image @ text.t()).items():
            result[f"{prefix}_{k}"] = v
    return result


def make_eval_fn(make_batches: Callable[[], Iterable[dict]], prefix: str = "eval") -> Callable:
    """eval_fn(engine, step) -> dict for ds_core.loop.train; make_batches() returns a fresh pass over the split."""
    def eval_fn(engine, step: int) -> dict[str, float]:
        return evaluate(engine, make_batches(), prefix=prefix)
    return eval_fn
