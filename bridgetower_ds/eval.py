"""Retrieval recall@k and the distributed evaluation pass (the contrastive loss lives with the model: model.py).

Eval loss: the model's ITC loss per micro batch with in-batch negatives, averaged over samples. The batches come from
batching.BatchPlan, which gives batch c of the split to rank c mod W: the same batches on any number of ranks, so
the loss depends on the eval micro batch size but not on the world size. Global negatives are off during evaluation.

Recall: image->text and text->image over the whole split, from the unimodal embeddings (the cross-modal embedding
needs a (text, image) pair, so it cannot rank a full gallery). Row i of the split pairs image i with caption i;
embeddings are gathered from every rank and de-duplicated by row id before ranking.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as torch_dist

from ds_core.device import hpu
from ds_core.run.evaluation import EvalTask, Evaluation
from ds_core.run.step import step_marker

from .batching import MIN_CONTRASTIVE_ROWS
from .configs import RunArgs

KS = (1, 5, 10)


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
    n = torch.tensor([x.shape[0]], dtype=hpu.count_dtype(x.device.type), device=x.device)  # HCCL: int32 on HPU
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
    t = torch.tensor([1 if flag else 0], dtype=hpu.count_dtype(device.type), device=device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return bool(t.item())


@torch.no_grad()
def evaluate(engine, batches: Iterable[dict], *, prefix: str = "eval") -> dict[str, float]:
    """One pass over a split: mean contrastive loss (in-batch negatives, sample-weighted over all batches of all
    ranks), and i2t / t2i recall@1/5/10 over the gathered split. Every rank must call it (collectives). Without any
    batch of two or more real rows there is no loss and `{prefix}_loss` is left out.

    Ranks advance in lock-step: while any rank still has a batch, all run a forward (a rank that ran out repeats
    its last batch and drops the result), so ZeRO-3's parameter gathers never wait on a rank that has finished.
    """
    module = engine.module if hasattr(engine, "module") else engine
    device = next(module.parameters()).device
    was_training = module.training
    module.eval()
    # Eval loss uses in-batch negatives: the plan's batches are the same on any world size, global ones are not.
    had_global = "global_negatives" in vars(module)
    saved_global = getattr(module, "global_negatives", False)
    module.global_negatives = False
    it = iter(batches)
    last = None
    # float64 / int64 sums, float32 / int32 on an HPU (ds_core.device.hpu: no float64 there, HCCL reduces neither)
    loss_sum = torch.zeros((), dtype=hpu.sum_dtype(device.type), device=device)
    n_sum = torch.zeros((), dtype=hpu.count_dtype(device.type), device=device)
    index_dtype = hpu.count_dtype(device.type)
    mark_step = step_marker(device)  # Gaudi's lazy mode: one graph per batch, as GaudiTrainer's evaluation loop
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
            if mark_step is not None:
                mark_step()
            if not real:
                continue
            n = b["input_ids"].shape[0]
            # rows with index < 0 are stand-in repeats: they weigh nothing and are not ranked. A batch of one real
            # row has no negative (loss exactly 0): it is ranked for recall but not averaged into the loss.
            n_real = int((b["index"] >= 0).sum().item()) if "index" in b else n
            if n_real == n and n >= MIN_CONTRASTIVE_ROWS:
                loss_sum += out.loss.detach().to(loss_sum.dtype) * n
                n_sum += n
            texts.append(out.text_embeds.float())
            images.append(out.image_embeds.float())
            rows.append(b["index"].to(index_dtype) if "index" in b else
                        torch.arange(n, dtype=index_dtype, device=device) + sum(r.shape[0] for r in rows))
    finally:
        module.train(was_training)
        if had_global:
            module.global_negatives = saved_global
        else:
            vars(module).pop("global_negatives", None)

    dim = module.config.contrastive_hidden_size
    text = torch.cat(texts) if texts else torch.zeros((0, dim), device=device)
    image = torch.cat(images) if images else torch.zeros((0, dim), device=device)
    row = torch.cat(rows) if rows else torch.zeros((0,), dtype=index_dtype, device=device)
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
    result = {f"{prefix}_samples": int(text.shape[0])}
    if n_sum.item() > 0:  # no batch of >= 2 rows (eval micro batch 1): no contrastive loss to report, not 0.0
        result[f"{prefix}_loss"] = (loss_sum / n_sum).item()
    if text.shape[0]:
        for k, v in recall_at_k(image @ text.t()).items():
            result[f"{prefix}_{k}"] = v
    return result


def evaluation_for(run_args: RunArgs, eval_every: int, make_source: Callable[[str], Any]) -> Evaluation:
    """The Trainer's evaluation of a BridgeTower run, as run_bridgetower.py does it: --do_eval evaluates the
    validation split (every --eval_every steps and at the end of training, or once without training), --do_predict
    the test split after training; results go to Trainer's eval_results.json / predict_results.json. Each split's
    data source is built on first use by make_source(split) and reused by every later evaluation."""
    sources: dict[str, Any] = {}

    def task(name: str, split: str, prefix: str) -> EvalTask:
        def fn(engine: Any, step: int) -> dict:
            if split not in sources:
                sources[split] = make_source(split)
            sources[split].set_epoch(0)
            batches = [0]

            def counted():
                for b in sources[split]:
                    batches[0] += 1
                    yield b

            t0 = time.perf_counter()
            logs = evaluate(engine, counted(), prefix=prefix)
            runtime = time.perf_counter() - t0  # Trainer's speed_metrics: the whole pass, gathering included
            logs.update({f"{prefix}_runtime": round(runtime, 4),
                         f"{prefix}_samples_per_second": round(logs[f"{prefix}_samples"] / runtime, 3),
                         f"{prefix}_steps_per_second": round(batches[0] / runtime, 3)})
            # bad images (distinct over ranks) and bad captions of the split go into its results file too
            return {**logs, **sources[split].result_counts(prefix)}
        return EvalTask(name, fn)

    def close() -> None:
        for source in sources.values():
            source.close()

    return Evaluation(during=task("eval", "validation", "eval") if run_args.do_eval else None,
                      after=[task("predict", "test", "test")] if run_args.do_predict else [], every=eval_every,
                      save_results=True, close=close)
