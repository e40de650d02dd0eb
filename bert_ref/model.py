"""The pretraining model of a preset (transformers' BertForPreTraining, Post-LN, or MegatronBertForPreTraining,
Pre-LN), its parameter counts, and BERT's training FLOPs.

Pre-LN (bert_1p5b): Habana's deepspeed-bert modeling.py with `layer_norm_large_model: true` keeps an un-normalized
residual stream and normalizes before each sublayer. transformers has no class with Habana's exact forward; its
Pre-LN BERT with MLM + NSP heads, MegatronBertForPreTraining, has the same parameter tensors one to one (2L + 1
LayerNorms: Habana's embeddings LayerNorm <-> layer 0 `attention.ln`; layer i's attention-output LayerNorm <-> layer
i `ln` (before the FFN); layer i's output LayerNorm <-> layer i+1 `attention.ln`, and the last one <-> the final
`encoder.ln`), the same heads and the same count, and differs in exactly two places:
  1. the residual stream's start: Habana starts it at 0 (BertEncoder.forward: layer_norm_input = 0), so the
     embeddings enter only through layer 0's attention input (the embeddings output, LayerNorm-ed, feeds layer 0's
     attention and is not added to the stream); MegatronBert starts it at the embeddings
     (x_1 = emb + Attn(LN(emb)) against Habana's x_1 = Attn(LN(emb)));
  2. the embedding dropout: Habana drops out after the embeddings LayerNorm, MegatronBert before layer 0's LN.
(Also: Habana's additive attention mask is -10000, transformers' the dtype minimum: no difference after softmax.)
bert_1p5b uses MegatronBertForPreTraining as it is: its checkpoints load with transformers alone, and its form is the
standard Pre-LN one (Xiong et al. 2020; Megatron-LM). The `habana_pre_ln` presets (bert_1p5b_habana, debug_habana)
change those two places (habana_pre_ln_form) and so compute Habana's function exactly; their config.json carries
`habana_pre_ln: true`, and check_checkpoint_form refuses to mix the two forms. load_habana_state_dict maps a Habana
checkpoint's names to ours (bert_ref/habana_ckpt.py). Both forms run attention through SDPA (as BERT-Large) unless
attn_implementation is 'eager': transformers' MegatronBert has only the eager kernel, so the self-attention modules
are given the SDPA forward of transformers' BERT (use_sdpa_attention).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from ds_core.compat.hf import call_arguments
from ds_core.compat.torch_releases import meta_device
from ds_core.errors import ConfigError

from .configs import BertPreset
from .habana_ckpt import is_habana_checkpoint, load_habana_state_dict, read_habana_checkpoint


def hf_config(preset: BertPreset, attn_implementation: str = "sdpa"):
    """transformers config of the preset: BertConfig (Post-LN) or MegatronBertConfig (Pre-LN). MegatronBert has
    only the eager attention kernel in transformers, so its config says eager (build_model swaps in SDPA)."""
    from transformers import BertConfig, MegatronBertConfig

    cls = MegatronBertConfig if preset.pre_ln else BertConfig
    cfg = cls(
        vocab_size=preset.vocab_size, hidden_size=preset.hidden_size, num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads, intermediate_size=preset.intermediate_size,
        max_position_embeddings=preset.max_position_embeddings, type_vocab_size=preset.type_vocab_size,
        hidden_dropout_prob=preset.hidden_dropout_prob,
        attention_probs_dropout_prob=preset.attention_probs_dropout_prob,
        hidden_act="gelu", initializer_range=0.02, layer_norm_eps=1e-12,
    )
    cfg._attn_implementation = "eager" if preset.pre_ln else attn_implementation
    if preset.habana_pre_ln:
        cfg.habana_pre_ln = True  # saved in config.json: check_checkpoint_form reads it back
    return cfg


def model_class(preset: BertPreset, sparse_mlm: bool = False):
    """The transformers class of the preset (with the sparse MLM forward when sparse_mlm)."""
    from transformers import BertForPreTraining, MegatronBertForPreTraining

    base = MegatronBertForPreTraining if preset.pre_ln else BertForPreTraining
    return _sparse_mlm_class(base) if sparse_mlm else base


FORMS = {"bert": "Post-LN BertForPreTraining", "megatron-bert": "Pre-LN MegatronBertForPreTraining",
         "megatron-bert+habana": "Pre-LN MegatronBertForPreTraining in Habana's form (habana_pre_ln)"}


def check_checkpoint_form(preset: BertPreset, config: dict, where: str) -> None:
    """Refuse weights of the other LayerNorm placement: a Post-LN checkpoint's tensors do not exist in the Pre-LN
    model and vice versa (and a partial load would train from a half-random model); and refuse the other Pre-LN form:
    the tensors are the same, the function is not (a silent switch would break a loss curve)."""
    model_type = config.get("model_type", "")
    want = "megatron-bert" if preset.pre_ln else "bert"
    form = model_type + ("+habana" if config.get("habana_pre_ln") else "")
    want_form = want + ("+habana" if preset.habana_pre_ln else "")
    if form != want_form:
        got = FORMS.get(form, f"model_type {model_type!r}")
        raise ConfigError(f"{where}: a {got} checkpoint, but preset {preset.name} is a {FORMS[want_form]} "
                          f"(model_type {want!r}, habana_pre_ln {preset.habana_pre_ln}); start from a checkpoint of "
                          f"the same preset")


def _sparse_mlm_class(base):
    """BertForPreTraining (or MegatronBertForPreTraining: same bert / cls attributes) whose forward also takes
    `masked_lm_positions` [B, P] (0-padded, as in the shards): then
    the MLM head (transform + decoder over the vocabulary) runs only at those B * P positions, the sparse MLM head
    of NVIDIA's and Habana's BERT recipes, and prediction_logits is [B, P, V]. Same parameters and state dict as
    BertForPreTraining; without masked_lm_positions it is BertForPreTraining."""
    from transformers.models.bert.modeling_bert import BertForPreTrainingOutput

    class SparseMLM(base):
        def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, masked_lm_positions=None,
                    **kwargs):
            if masked_lm_positions is None:
                return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                       token_type_ids=token_type_ids, **kwargs)
            out = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, return_dict=True,
                            **kwargs)
            seq, pooled = out[:2]
            idx = masked_lm_positions.unsqueeze(-1).expand(-1, -1, seq.size(-1))
            pred, nsp = self.cls(torch.gather(seq, 1, idx), pooled)
            return BertForPreTrainingOutput(prediction_logits=pred, seq_relationship_logits=nsp)

    SparseMLM.__name__ = SparseMLM.__qualname__ = base.__name__ + "SparseMLM"
    return SparseMLM


@functools.cache
def _megatron_classes() -> tuple[type, type]:
    """HabanaFirstAttention and MegatronBertSdpaSelfAttention, made on first use (transformers is imported lazily
    here) and registered as attributes of this module, so that pickle finds a model's classes by name."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.megatron_bert.modeling_megatron_bert import (
        MegatronBertAttention,
        MegatronBertSelfAttention,
    )

    class HabanaFirstAttention(MegatronBertAttention):
        """Layer 0's attention in Habana's form: LayerNorm (Habana's embeddings LayerNorm), embedding dropout,
        self-attention, output dense + dropout, and no residual (Habana's stream starts at 0). The self-attention
        gets the arguments this attention got, as MegatronBertAttention hands them on (positionally in transformers
        4.51, by keyword since)."""

        def forward(self, hidden_states, *args, **kwargs):
            normed = self.emb_dropout(self.ln(hidden_states))
            context = self.self(normed, *args, **kwargs)
            return (self.output.dropout(self.output.dense(context[0])),) + tuple(context[1:])

    class MegatronBertSdpaSelfAttention(MegatronBertSelfAttention):
        """MegatronBert self-attention through transformers' sdpa_attention_forward (BERT-Large's kernel). Its
        arguments are read by name through the installed MegatronBertSelfAttention's signature
        (ds_core.compat.hf.call_arguments: 4.51 passes them positionally)."""

        def forward(self, hidden_states, *args, **kwargs):
            given = call_arguments(MegatronBertSelfAttention.forward, (hidden_states, *args), kwargs)
            attention_mask = given.get("attention_mask")
            if any(given.get(k) is not None for k in ("head_mask", "encoder_hidden_states", "cache",
                                                       "past_key_value", "past_key_values")) or \
                    given.get("output_attentions"):
                raise ValueError("MegatronBertSdpaSelfAttention: self-attention of an encoder only (no head mask, "
                                 "cross attention, cache or attention outputs); build the model with "
                                 "attn_implementation='eager' for those")
            shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
            q, k, v = (lin(hidden_states).view(shape).transpose(1, 2) for lin in (self.query, self.key, self.value))
            out, _ = sdpa_attention_forward(self, q, k, v, attention_mask, is_causal=False,
                                            dropout=self.dropout.p if self.training else 0.0)
            return out.reshape(*hidden_states.shape[:-1], -1).contiguous(), None

    for cls in (HabanaFirstAttention, MegatronBertSdpaSelfAttention):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
        globals()[cls.__name__] = cls
    return HabanaFirstAttention, MegatronBertSdpaSelfAttention


def habana_pre_ln_form(model: torch.nn.Module) -> None:
    """Make a MegatronBert(ForPreTraining) compute Habana's `layer_norm_large_model` forward (module docstring, the
    two differences): layer 0's attention adds no residual (Habana's stream starts at 0), and the embedding dropout
    moves from before layer 0's LayerNorm (MegatronBert) to after it (Habana: BertEmbeddings LayerNorm -> dropout).
    Parameters and state dict are unchanged; the model's config gets habana_pre_ln = True."""
    from transformers.models.megatron_bert.modeling_megatron_bert import MegatronBertAttention

    first_cls, _ = _megatron_classes()
    bert = model.bert if hasattr(model, "bert") else model
    first = bert.encoder.layer[0].attention
    if type(first) is first_cls:
        return
    if type(first) is not MegatronBertAttention:
        raise TypeError(f"habana_pre_ln_form: layer 0 attention is {type(first).__name__}, expected "
                        f"MegatronBertAttention (a Pre-LN model)")
    first.__class__ = first_cls
    first.emb_dropout = bert.embeddings.dropout  # the same nn.Dropout (p, FastDropout) at Habana's place
    bert.embeddings.dropout = torch.nn.Identity()
    (model.config if hasattr(model, "config") else bert.config).habana_pre_ln = True


def use_sdpa_attention(model: torch.nn.Module) -> None:
    """Give every MegatronBert self-attention the SDPA kernel BERT-Large runs (transformers' sdpa_attention_forward,
    the function BertSelfAttention calls with attn_implementation='sdpa'): same Q/K/V modules and state dict, same
    additive mask (the eager mask MegatronBertModel builds), attention-probability dropout inside the kernel.
    tests/test_bert_habana.py checks it equal to the eager path."""
    from transformers.models.megatron_bert.modeling_megatron_bert import MegatronBertSelfAttention

    _, sdpa_cls = _megatron_classes()
    bert = model.bert if hasattr(model, "bert") else model
    for layer in bert.encoder.layer:
        if type(layer.attention.self) is MegatronBertSelfAttention:
            layer.attention.self.__class__ = sdpa_cls
    # every self-attention now takes SDPA's boolean mask: bert_ref.step hands the model a ready 4-D one, which
    # transformers passes on as it is (from a 2-D mask its builder reads `mask.all()` back every forward)
    model.sdpa_attention = all(type(layer.attention.self) is sdpa_cls for layer in bert.encoder.layer)


class FastDropout(torch.nn.Dropout):
    """nn.Dropout whose keep mask comes from 16-bit slices of 64-bit random words (4 draws per call of torch's
    generator instead of one per element: CPU bernoulli_ costs ~10 ns per element here). p is rounded to a multiple of
    2^-15 (0.1 -> 0.100006); the kept values are scaled by 1 / (1 - that p). Under torch.compile it is nn.Dropout:
    dynamo cannot trace an integer random_() (a graph break per layer), and inductor draws its own random numbers
    inside the fused kernel anyway."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if torch.compiler.is_compiling():
            return super().forward(x)
        n, drop = x.numel(), round(self.p * 32768)
        words = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_()  # 63 random bits each
        keep = (words.view(torch.int16)[:n] & 0x7FFF) >= drop  # low 15 bits of each 16-bit lane: uniform
        return x * keep.view(x.shape).to(x.dtype).mul_(32768 / (32768 - drop))


def build_model(preset: BertPreset, init_checkpoint: str = "", activation_checkpointing: bool = False,
                attn_implementation: str = "sdpa", sparse_mlm: bool = False,
                fast_dropout: bool = False) -> torch.nn.Module:
    """A BertForPreTraining (Post-LN presets) or MegatronBertForPreTraining (Pre-LN presets): MLM + NSP heads,
    decoder tied to the word embeddings; randomly initialised from the preset or loaded from a local Hugging Face
    checkpoint directory of the same form (never downloaded), or, for a habana_pre_ln preset, from a Habana
    deepspeed-bert checkpoint (bert_ref.habana_ckpt). sparse_mlm: the subclass
    whose forward takes masked_lm_positions (see _sparse_mlm_class; bert_ref.step.make_step_fn). fast_dropout: the
    hidden dropouts become FastDropout (same p up to 2^-15, cheaper random numbers on the CPU)."""
    cls = model_class(preset, sparse_mlm)
    if init_checkpoint and preset.habana_pre_ln and is_habana_checkpoint(init_checkpoint):
        model = cls(hf_config(preset, attn_implementation))
        habana_pre_ln_form(model)
        load_habana_state_dict(model, read_habana_checkpoint(init_checkpoint), f"--init_checkpoint {init_checkpoint}")
    elif init_checkpoint:
        import json

        cfg_file = Path(init_checkpoint) / "config.json"
        try:
            saved = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--init_checkpoint {init_checkpoint}: cannot read {cfg_file}: {e}") from e
        check_checkpoint_form(preset, saved, f"--init_checkpoint {init_checkpoint}")
        got = cls.config_class.from_pretrained(init_checkpoint, local_files_only=True)  # check before the weights
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if getattr(got, key) != getattr(preset, key):
                raise ConfigError(f"--init_checkpoint {init_checkpoint}: {key} = {getattr(got, key)} but preset "
                                  f"{preset.name} has {getattr(preset, key)}")
        if got.max_position_embeddings < preset.seq_len:
            raise ConfigError(f"--init_checkpoint {init_checkpoint}: max_position_embeddings "
                              f"{got.max_position_embeddings} < seq_len {preset.seq_len}")
        if got.vocab_size > preset.vocab_size:
            raise ConfigError(f"--init_checkpoint {init_checkpoint}: vocab_size {got.vocab_size} > preset "
                              f"{preset.name} vocab_size {preset.vocab_size}")
        model = cls.from_pretrained(init_checkpoint, local_files_only=True,
                                    attn_implementation="eager" if preset.pre_ln else attn_implementation)
        if got.vocab_size < preset.vocab_size:  # a published 30522-token checkpoint: pad rows to 30528
            model.resize_token_embeddings(preset.vocab_size)
        # Dropout follows the preset, not the checkpoint (phase 2 continues phase 1's regularisation).
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = preset.hidden_dropout_prob
    else:
        model = cls(hf_config(preset, attn_implementation))
    if preset.habana_pre_ln:
        habana_pre_ln_form(model)
    if preset.pre_ln and attn_implementation == "sdpa":
        use_sdpa_attention(model)
    if fast_dropout:  # the hidden dropouts (attention-probability dropout runs inside SDPA)
        for m in model.modules():
            if type(m) is torch.nn.Dropout:
                m.__class__ = FastDropout
    if activation_checkpointing:
        # Non-reentrant checkpointing works with ZeRO-3's parameter gathering hooks and with inputs that do not
        # require grad (the embeddings' output does, but the non-reentrant variant does not depend on it).
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def param_counts(preset: BertPreset) -> dict[str, int]:
    """Parameter counts of the preset's model, built on the meta device (no weights are allocated).

    total counts the decoder weight once (it is tied to the word embeddings); embeddings = word + position + token
    type embeddings (+ their LayerNorm, Post-LN only); encoder = the transformer layers (+ the final LayerNorm,
    Pre-LN); heads = pooler, MLM transform, MLM bias, NSP classifier."""
    with meta_device():
        model = model_class(preset)(hf_config(preset))
    total = sum(p.numel() for p in model.parameters())
    emb = sum(p.numel() for p in model.bert.embeddings.parameters())
    enc = sum(p.numel() for p in model.bert.encoder.parameters())
    return {"total": total, "embeddings": emb, "encoder": enc, "heads": total - emb - enc}


def flops_per_sequence(preset: BertPreset, seq_len: int | None = None, mlm_positions: int | None = None) -> float:
    """Model FLOPs to TRAIN on one sequence (forward + backward), counting matmuls only (2 FLOPs per multiply-add).

    With S = seq_len, h = hidden, I = intermediate, L = layers, V = vocab (padded):
      per encoder layer, forward:
        projections  2 * S * (4 h^2 + 2 h I)    Q, K, V, attention output (4 h x h) + FFN in and out (2 h x I)
        attention    2 * 2 * S^2 * h            Q K^T scores and probs x V (all heads together)
      MLM head, forward: 2 * S * (h^2 + h V)    transform dense + decoder; transformers computes prediction logits
                                                at all S positions (not only the masked ones), so all S count;
                                                with the sparse MLM head (mlm_positions = P, the preset's
                                                max_predictions_per_seq) it runs at P positions per sequence
                                                (padding slots included: they are computed), so 2 * P * (h^2 + h V)
      pooler + NSP, forward: 2 * (h^2 + 2 h)    once per sequence
      train = 3 * forward                       backward = 2 x forward (grads w.r.t. activations and weights)
    Embedding lookups, LayerNorm, GELU, softmax and the optimizer are not counted (the usual MFU convention), and the
    recomputed forward of activation checkpointing is not counted either (model FLOPs, not hardware FLOPs).
    For BERT-Large at S=128 this is ~2.6e11, close to the 6 * params * S rule of thumb (2.58e11)."""
    S = seq_len or preset.seq_len
    h, inter, L, V = preset.hidden_size, preset.intermediate_size, preset.num_hidden_layers, preset.vocab_size
    layer = 2 * S * (4 * h * h + 2 * h * inter) + 4 * S * S * h
    mlm = 2 * (mlm_positions or S) * (h * h + h * V)
    nsp = 2 * (h * h + 2 * h)
    return float(3 * (L * layer + mlm + nsp))

