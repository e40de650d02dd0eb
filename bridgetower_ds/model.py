"""Build `BridgeTowerForContrastiveLearning`, freeze parts of it, and count its FLOPs per training sample."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from transformers import BridgeTowerConfig, BridgeTowerForContrastiveLearning

from ds_core.compat.hf import bridgetower_sdpa_missing, dtype_kwargs
from ds_core.errors import ConfigError

from . import log
from .configs import CONTRASTIVE_HIDDEN_SIZE, LOGIT_SCALE_INIT, ModelArgs, preset


class BridgeTowerContrastive(BridgeTowerForContrastiveLearning):
    """`BridgeTowerForContrastiveLearning` with the ITC loss computed in fp32 inside forward.

    Same parameters, state-dict keys and outputs as the transformers class (checkpoints load both ways). The loss
    must be computed inside forward: under ZeRO-3 `logit_scale` is only materialized while the module's forward
    runs. Under DeepSpeed bf16 the stock loss would run the softmax in bf16; here the [B, B] logits are fp32.
    `global_negatives` (class default False) all-gathers image/cross embeddings across ranks as extra negatives.
    """

    global_negatives: bool = False

    def __init__(self, config: BridgeTowerConfig):
        super().__init__(config)
        # Checkpoints keep `logit_scale` 0-dim (the transformers layout); see logit_scale_as_1d for why it changes.
        self.register_state_dict_post_hook(_logit_scale_to_0d)
        self.register_load_state_dict_pre_hook(_logit_scale_from_0d)

    def logit_scale_as_1d(self) -> None:
        """Make `logit_scale` a [1] parameter (call before deepspeed.initialize).

        DeepSpeed 0.19 broadcasts parameters as `p.data.view(torch.uint8)` (engine start, ZeRO-3 conversion and
        gathered saves), which fails on 0-dim tensors ("self.dim() cannot be 0 to view ... as Byte"). The forward
        pass broadcasts [1] like a scalar; state_dict() / save_pretrained still write the 0-dim layout, and
        load_state_dict accepts it.
        """
        if self.logit_scale.dim() == 0:
            self.logit_scale = torch.nn.Parameter(self.logit_scale.detach().reshape(1),
                                                  requires_grad=self.logit_scale.requires_grad)

    def save_pretrained(self, save_directory, *args, state_dict=None, **kwargs):
        if state_dict is not None:  # e.g. ZeRO-3's gathered state dict, shaped like the live [1] parameter
            state_dict = dict(state_dict)
            _logit_scale_to_0d(self, state_dict, "", None)
        return super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, pixel_values=None,
                pixel_mask=None, inputs_embeds=None, image_embeds=None, return_loss=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2 and self.config._attn_implementation == "sdpa":
            attention_mask = sdpa_padding_mask(attention_mask)
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                              pixel_values=pixel_values, pixel_mask=pixel_mask, inputs_embeds=inputs_embeds,
                              image_embeds=image_embeds, return_loss=False, **kwargs)
        if return_loss:
            out["loss"] = contrastive_loss(out.text_embeds, out.image_embeds, out.cross_embeds, self.logit_scale,
                                           global_negatives=self.global_negatives)
        return out


def sdpa_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] padding mask (1 = token) -> the [B, 1, 1, T] boolean mask (True = attend) that transformers' SDPA mask
    builder makes of it for BridgeTower's text and cross-modal attention (queries broadcast). Given the 2-D mask,
    the builder first asks `padding_mask.all()` to drop an all-ones mask, a read-back that stops the host until the
    device caught up, every forward; a 4-D mask is taken as it is. Same attention either way (an all-True mask and
    no mask attend to every token)."""
    return attention_mask[:, None, None, :].bool()


# ---------------------------------------------------------------------------------------------------- loss
# BridgeTower's ITC objective, (CE(text->image) + CE(text->cross) + CE(image->cross)) / 3 over the logits scaled by
# exp(logit_scale), in fp32 from the model's normalized embeddings. Negatives are the other samples of the same micro
# batch on the same rank ("in-batch negatives", like the reference), unless global negatives are asked for, which
# all-gathers the keys across data-parallel ranks first. A batch of one row has no negative: its loss is exactly 0
# (batching.BatchPlan never plans one).
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


def _logit_scale_to_0d(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "logit_scale"
    value = state_dict.get(key)
    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == 1:
        state_dict[key] = value.reshape(())


def _logit_scale_from_0d(module, state_dict, prefix, *args) -> None:
    key = prefix + "logit_scale"
    value = state_dict.get(key)
    if isinstance(value, torch.Tensor) and value.dim() != module.logit_scale.dim() and value.numel() == 1:
        state_dict[key] = value.reshape(module.logit_scale.shape)


def load_config(args: ModelArgs) -> BridgeTowerConfig:
    """The checkpoint's config when --model_name_or_path is given, else the preset's."""
    if not args.model_name_or_path:
        return preset(args.preset)
    path = Path(args.model_name_or_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model_name_or_path {path}: no config.json there (expected a local directory "
                                f"holding a saved BridgeTower, e.g. the Large ITM/MLM/ITC checkpoint)")
    cfg = BridgeTowerConfig.from_pretrained(str(path), local_files_only=True)
    # Checkpoints saved without the ITC head (e.g. ITM/MLM-only) lack these two; current transformers no longer
    # supplies defaults, so use the published ITC checkpoint's values.
    for key, value in (("contrastive_hidden_size", CONTRASTIVE_HIDDEN_SIZE),
                       ("logit_scale_init_value", LOGIT_SCALE_INIT)):
        if getattr(cfg, key, None) is None:
            log.warn(f"{path}: config.json has no {key}; using {value}", every_rank=True, stderr=True)
            setattr(cfg, key, value)
    return cfg


def build_model(args: ModelArgs, config: BridgeTowerConfig | None = None) -> BridgeTowerContrastive:
    """The model in fp32 (DeepSpeed's bf16 section casts it), weights loaded or random, freezing applied. `config`:
    a random-init architecture other than the preset's (benches that build fewer layers than a preset has)."""
    if config is not None and args.model_name_or_path:
        raise ConfigError("build_model: pass either a config (random init) or --model_name_or_path, not both")
    cfg = config if config is not None else load_config(args)
    if args.model_name_or_path:
        model = BridgeTowerContrastive.from_pretrained(
            args.model_name_or_path, config=cfg, local_files_only=True, **dtype_kwargs(torch.float32))
    else:
        model = BridgeTowerContrastive(cfg)
    apply_freezing(model, args)
    model.global_negatives = args.global_negatives
    if args.attn_implementation == "sdpa":
        use_sdpa(model)
    elif args.attn_implementation != "eager":
        raise ConfigError(f"--attn_implementation must be sdpa or eager, got {args.attn_implementation!r}")
    return model


def use_sdpa(model: BridgeTowerForContrastiveLearning) -> bool:
    """Run the text and cross-modal attention through torch's scaled_dot_product_attention (fused kernels, a few
    aten ops per layer instead of matmul + mask + softmax + dropout + matmul); the vision tower's
    nn.MultiheadAttention already calls it (need_weights=False), and gets a leaner forward around it
    (SelfAttentionMHA). False (text and cross-modal attention eager, said in one line) where the installed
    transformers' BridgeTower has no attention-function switch.

    transformers declares no SDPA support for BridgeTower, and switching naively would change the function: the
    cross-modal layers' self-attention is constructed with is_causal=True, which eager ignores (it only adds the
    padding mask) but SDPA honours when no mask is given, which is always the case for the image stream. BridgeTower
    is an encoder everywhere, so is_causal is set False on every attention module; the outputs then equal eager's
    within float rounding (tests/test_bt_model.py). transformers 4.55's BridgeTower has eager attention only
    (ds_core.compat.hf.bridgetower_sdpa_missing): rank 0 says so in one line.
    """
    from transformers.models.bridgetower import modeling_bridgetower as mb

    for module in model.modules():
        if type(module) is torch.nn.MultiheadAttention:
            module.__class__ = SelfAttentionMHA  # same parameters and state; a leaner forward (any transformers)
    why = bridgetower_sdpa_missing()
    if why is not None:
        log.say(f"--attn_implementation sdpa: {why} (the vision tower's attention is SDPA already)")
        return False
    for module in model.modules():
        if isinstance(module, (mb.BridgeTowerSelfAttention, mb.BridgeTowerCrossAttention)):
            module.is_causal = False
    model.config._attn_implementation = "sdpa"  # the setter passes it on to text_config and vision_config
    return True


class SelfAttentionMHA(torch.nn.MultiheadAttention):
    """nn.MultiheadAttention with a forward for the vision tower's unmasked self-attention, [L, B, E] in and out.

    torch's own path (F.multi_head_attention_forward) reaches SDPA too, but around it splits the packed q/k/v
    projection with a full copy, checks, reshapes and copies back: ~280 aten ops per block forward + backward
    against ~190 here, and 10 fewer activation-sized copies; same weights, same kernels, the same numbers (bit-equal
    in fp32 on the CPU). Anything else (masks, weights wanted, dropout, batch_first, separate q/k/v weights, or
    query, key and value that are not one tensor, as under DeepSpeed ZeRO-3, whose hooks wrap each input) takes
    the stock forward.
    """

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if (query is not key or key is not value or key_padding_mask is not None or attn_mask is not None
                or need_weights or is_causal or self.batch_first or not self._qkv_same_embed_dim
                or self.bias_k is not None or (self.dropout and self.training)):
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        length, batch, width = query.shape
        heads = self.num_heads
        qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias).view(length, batch, 3, heads, width // heads)
        q, k, v = qkv.permute(2, 1, 3, 0, 4).unbind(0)  # each [B, heads, L, head_dim]
        out = F.scaled_dot_product_attention(q, k, v).permute(2, 0, 1, 3).reshape(length, batch, width)
        return F.linear(out, self.out_proj.weight, self.out_proj.bias), None


def apply_freezing(model: BridgeTowerForContrastiveLearning, args: ModelArgs) -> dict[str, int]:
    """Set requires_grad per the freeze flags; returns {"trainable": n, "frozen": n} parameter counts.

    The text pooler is frozen by default: the contrastive head reads the text tower's last hidden state at [CLS],
    never the pooler, so it would get no gradient (DeepSpeed ZeRO then carries an always-None gradient).
    """
    bt = model.bridgetower
    groups = {
        "vision_model": (args.freeze_vision_model, bt.vision_model),
        "text_model": (args.freeze_text_model, bt.text_model),
    }
    for name, (freeze, module) in groups.items():
        for p in module.parameters():
            p.requires_grad_(not freeze)
    if bt.text_model.pooler is not None:
        # After the text tower: --freeze_text_model freezes the pooler too, whatever --freeze_text_pooler says.
        for p in bt.text_model.pooler.parameters():
            p.requires_grad_(not (args.freeze_text_pooler or args.freeze_text_model))
    counts = {"trainable": 0, "frozen": 0}
    for p in model.parameters():
        counts["trainable" if p.requires_grad else "frozen"] += p.numel()
    if counts["trainable"] == 0:
        raise ConfigError("every parameter is frozen: nothing to train (check --freeze_* flags)")
    return counts


def forward_flops(cfg: BridgeTowerConfig, seq_len: int) -> dict[str, float]:
    """Matmul FLOPs (2 per multiply-add) of one sample's forward pass, per part: vision, text, cross.

    Counts what `BridgeTowerForContrastiveLearning.forward` runs: the vision tower up to as many blocks as the
    text tower has layers, the text tower, the cross-modal layers (self + cross attention + MLP, both streams),
    the per-layer transforms into the cross-modal width, the cross-modal poolers and the three ITC heads.
    Layer norms, softmax, GELU and the in-batch logits (B x B) are left out (<1%).
    """
    t, v = cfg.text_config, cfg.vision_config
    T = int(seq_len)
    grid = int(v.image_size) // int(v.patch_size)
    P = grid * grid + 1  # patches + class token
    ht, it, hv, hc = t.hidden_size, t.intermediate_size, v.hidden_size, cfg.hidden_size
    lt = t.num_hidden_layers
    lv = min(v.num_hidden_layers, lt)  # forward walks the vision blocks in step with the text layers
    lc = cfg.num_hidden_layers

    text = lt * (2 * T * (4 * ht * ht + 2 * ht * it) + 4 * T * T * ht)
    vision = 2 * grid * grid * 3 * v.patch_size ** 2 * hv + lv * (2 * P * (4 * hv * hv + 8 * hv * hv) + 4 * P * P * hv)

    def cross_layer(n_q: int, n_kv: int) -> float:  # BridgeTowerBertCrossLayer at the text width (hc == ht)
        self_attn = 2 * n_q * 4 * ht * ht + 4 * n_q * n_q * ht
        cross_attn = 2 * n_q * 2 * ht * ht + 2 * n_kv * 2 * ht * ht + 4 * n_q * n_kv * ht
        mlp = 2 * n_q * 2 * ht * it
        return self_attn + cross_attn + mlp

    c = cfg.contrastive_hidden_size
    cross = lc * (cross_layer(T, P) + cross_layer(P, T))
    cross += 2 * T * ht * hc * lc + 2 * P * hv * hc * (lc + 1)  # transforms (+1: the ITC image branch)
    cross += 2 * (2 * hc * hc) + 2 * (ht * c + hc * c + 2 * hc * c)  # cross-modal poolers, ITC heads
    return {"vision": float(vision), "text": float(text), "cross": float(cross)}


def flops_per_sample(cfg: BridgeTowerConfig, seq_len: int, *, freeze_vision: bool = False,
                     freeze_text: bool = False) -> float:
    """Training FLOPs per sample: forward + backward (2x forward) for trained parts, forward only for frozen
    towers (they sit at the bottom of the graph, so no activation gradient flows into them either)."""
    f = forward_flops(cfg, seq_len)
    return (f["cross"] * 3 + f["vision"] * (1 if freeze_vision else 3) + f["text"] * (1 if freeze_text else 3))


def model_summary(model: torch.nn.Module) -> str:
    n = sum(p.numel() for p in model.parameters())
    nt = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"BridgeTowerForContrastiveLearning: {n / 1e6:.1f}M parameters, {nt / 1e6:.1f}M trainable"
