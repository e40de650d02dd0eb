"""ds_tools.tuning: the memory model is consistent (rises with micro batch, falls with ZeRO stage and with more
ranks), uses DeepSpeed's estimators where they exist, and ds-tune's DeepSpeed JSON validates with ds_core.config."""
import json

import pytest

from ds_tools import tuning
from ds_core.config import load_ds_config

GB = tuning.GB


@pytest.fixture(scope="module")
def bert_large():
    return tuning.model_shape("bert-large")


def test_model_shapes_are_exact_parameter_counts(tmp_path):
    from transformers import BertConfig, BertForPreTraining

    small = {"model_type": "bert", "architectures": ["BertForPreTraining"], "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256, "vocab_size": 1024}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(small))
    shape = tuning.model_shape(str(path), 32)
    real = BertForPreTraining(BertConfig(**{k: v for k, v in small.items() if k not in ("model_type", "architectures")}))
    assert shape.exact and shape.params == sum(p.numel() for p in real.parameters())
    # the largest module is the MLM decoder: the tied embedding matrix plus its bias
    assert shape.largest_layer_params == 1024 * 64 + 1024 and shape.towers[0].seq == 32
    assert 330e6 < tuning.model_shape("bert-large").params < 340e6
    assert 1.5e9 < tuning.model_shape("bert-1.5b").params < 1.56e9
    bt = tuning.model_shape("bridgetower-large")
    assert all(tuning.model_shape(m).exact for m in tuning.shipped_models())   # the presets build on the meta device
    assert 0.85e9 < bt.params < 0.95e9 and [t.name for t in bt.towers] == ["text", "vision", "cross-text",
                                                                           "cross-image"]
    with pytest.raises(tuning.TuningError, match="not one of"):
        tuning.model_shape("gpt-17")


def test_memory_rises_with_micro_batch(bert_large):
    for stage in tuning.STAGES:
        for ckpt in (False, True):
            totals = [tuning.estimate(bert_large, stage, m, 8, 2, checkpointing=ckpt).total for m in (1, 2, 4, 8, 16)]
            assert totals == sorted(totals) and len(set(totals)) == 5, (stage, ckpt, totals)
    off = tuning.estimate(bert_large, 1, 16, 8, 2, checkpointing=False).parts["activations"]
    on = tuning.estimate(bert_large, 1, 16, 8, 2, checkpointing=True).parts["activations"]
    assert on < off / 2    # the MLM head (logits over the vocabulary) is not checkpointed


def test_memory_falls_with_stage_and_with_more_ranks(bert_large):
    for nodes in (1, 2, 8):
        states = [tuning.estimate(bert_large, s, 8, 8, nodes).model_states for s in tuning.STAGES]
        totals = [tuning.estimate(bert_large, s, 8, 8, nodes).total for s in tuning.STAGES]
        assert states == sorted(states, reverse=True) and len(set(states)) == 4, states
        assert totals == sorted(totals, reverse=True), totals
    for stage in (1, 2, 3):
        per_nodes = [tuning.estimate(bert_large, stage, 8, 8, n).total for n in (1, 2, 4, 8)]
        assert per_nodes == sorted(per_nodes, reverse=True) and len(set(per_nodes)) == 4, (stage, per_nodes)
        # what a rank holds between steps never exceeds the predicted peak, and falls with more ranks too
        resident = [tuning.resident_state_bytes(bert_large, stage, 8 * n) for n in (1, 2, 4, 8)]
        assert resident == sorted(resident, reverse=True)
        assert all(r < tuning.estimate(bert_large, stage, 1, 8, n).total for r, n in zip(resident, (1, 2, 4, 8)))
    # ZeRO-0 replicates everything: more ranks change nothing
    assert len({tuning.estimate(bert_large, 0, 8, 8, n).total for n in (1, 2, 4)}) == 1


def test_deepspeed_estimators_are_used_for_stage_2_and_3(bert_large):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    P = bert_large.params
    e2 = tuning.estimate(bert_large, 2, 4, 8, 2)
    assert e2.model_states == estimate_zero2_model_states_mem_needs(P, 8, 2, cpu_offload=False)[1]
    e3 = tuning.estimate(bert_large, 3, 4, 8, 2)
    ds3 = estimate_zero3_model_states_mem_needs(P, bert_large.largest_layer_params, 8, 2, cpu_offload=False,
                                                cpu_offload_params=False)[1]
    assert e3.model_states == pytest.approx(ds3 + 2 * P / 16)    # + the bf16 partition the estimator leaves out
    assert "deepspeed estimator" in e2.sources["states"] and "added" in tuning.estimate(bert_large, 1, 4, 8, 2).sources["states"]
    # ZeRO-0 / ZeRO-1 in DeepSpeed's bytes-per-parameter terms
    assert tuning.estimate(bert_large, 0, 4, 8, 2).model_states == 20 * P
    assert tuning.estimate(bert_large, 1, 4, 8, 2).model_states == pytest.approx(4 * P + 16 * P / 16)


def test_ds_tune_recommends_and_its_json_validates(tmp_path, capsys):
    out = tmp_path / "ds.json"
    rc = tuning.main(["--model", "bert-large", "--accelerator", "gaudi2", "--accelerators-per-node", "8",
                      "--nodes", "2", "--global-batch", "1024", "--out", str(out), "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    best = summary["recommended"]
    assert summary["feasible"] and all(o["headroom_gb"] >= 0 for o in summary["feasible"])
    assert {k: best[k] for k in ("stage", "micro_batch", "grad_accum")} in [
        {k: o[k] for k in ("stage", "micro_batch", "grad_accum")} for o in summary["feasible"]]
    cfg = load_ds_config(str(out), world_size=16)
    assert cfg["train_batch_size"] == 1024
    assert cfg["train_micro_batch_size_per_gpu"] == best["micro_batch"]
    assert cfg["gradient_accumulation_steps"] == best["grad_accum"]
    assert cfg["zero_optimization"]["stage"] == best["stage"] and cfg["bf16"]["enabled"]
    # every listed option's JSON validates too, checkpointing section included
    shape = tuning.model_shape("bert-large")
    for o in tuning.search(shape, "gaudi", 8, 2, 512, "on")[::7]:
        load_ds_config(tuning.ds_config(o, 512), world_size=16)
        no_opt = load_ds_config(tuning.ds_config(o, 512, optimizer="none"), world_size=16)
        assert "optimizer" not in no_opt and no_opt["zero_allow_untested_optimizer"]


def test_bert_1p5b_on_8_nodes_of_first_gen_gaudi(tmp_path, capsys):
    out = tmp_path / "ds.json"
    rc = tuning.main(["--model", "bert-1.5b", "--accelerator", "gaudi", "--nodes", "8", "--global-batch", "4096",
                      "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "Recommended: ZeRO-" in text and "usable 29.4 GB" in text
    assert "| 0 |" not in text       # ZeRO-0 needs 20 B/param = 30.7 GB: never listed as feasible
    load_ds_config(str(out), world_size=64)


def test_nothing_fits_says_what_would(tmp_path, capsys):
    out = tmp_path / "ds.json"
    rc = tuning.main(["--model", "bert-1.5b", "--accelerator", "gaudi", "--accelerators-per-node", "1",
                      "--nodes", "1", "--global-batch", "8", "--activation-checkpointing", "off", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 1 and "Nothing fits" in text and not out.exists()
    assert "use at least 2 nodes with ZeRO-3" in text
    with pytest.raises(tuning.TuningError, match="not a positive multiple of 16 ranks"):
        tuning.search(tuning.model_shape("bert-large"), "gaudi", 8, 2, 1000)
