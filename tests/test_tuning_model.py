"""ds_tools.tuning: the memory model is consistent (rises with micro batch, falls with ZeRO stage and with more
ranks), picks the optimizer wrapper DeepSpeed picks (BF16_Optimizer's unpartitioned fp32 gradients for bf16 ZeRO-1
with fp32 accumulation), and ds-tune's DeepSpeed JSON validates, states every field the model assumed and keeps the
headroom it claims. The model against measured memory: tests/test_bench_zero_memory.py."""
import json

import pytest

from ds_core.config import load_ds_config
from ds_tools import tuning, zero_memory_model as zmm

pytestmark = pytest.mark.stack  # ds-tune's memory model asks the installed DeepSpeed

GIB = 2 ** 30


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
    real = BertForPreTraining(BertConfig(**{k: v for k, v in small.items()
                                            if k not in ("model_type", "architectures")}))
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
    for stage in zmm.STAGES:
        for ckpt in (False, True):
            acc = zmm.grad_accum_dtype_for(stage, "bf16")  # what ds-tune uses: an accumulation DeepSpeed runs
            runs = [zmm.estimate(bert_large, stage, m, 8, 2, checkpointing=ckpt, grad_accum_dtype=acc)
                    for m in (1, 2, 4, 8, 16)]
            totals = [e.total for e in runs]
            acts = [e.activations for e in runs]
            # the peak is the larger of the step (no activations) and forward/backward: it never falls
            assert totals == sorted(totals) and totals[-1] > totals[0], (stage, ckpt, totals)
            assert acts == sorted(acts) and len(set(acts)) == 5
    off = zmm.estimate(bert_large, 1, 16, 8, 2, checkpointing=False).activations
    on = zmm.estimate(bert_large, 1, 16, 8, 2, checkpointing=True).activations
    assert on < off / 2    # the MLM head (logits over the vocabulary) is not checkpointed


def test_memory_falls_with_stage_and_with_more_ranks(bert_large):
    fp32_acc = {s: zmm.grad_accum_dtype_for(s, "bf16") for s in zmm.STAGES}
    for nodes in (1, 2, 8):
        runs = [zmm.estimate(bert_large, s, 8, 8, nodes, grad_accum_dtype=fp32_acc[s]) for s in zmm.STAGES]
        states = [e.model_states for e in runs]
        assert states == sorted(states, reverse=True) and len(set(states[1:])) == 3, states
        # ZeRO-0 holds more than ZeRO-1, except where both get BF16_Optimizer (Habana's fork runs bf16 ZeRO-0 with
        # it: the same partitioned fp32 master weights and moments)
        assert states[0] > states[1] or {runs[0].optimizer, runs[1].optimizer} == {"BF16_Optimizer"}, states
        totals = [e.total for e in runs]
        # ZeRO-3 is not below ZeRO-2 at the peak: the parameters it gathers stay live during forward/backward up to
        # stage3_max_live_parameters (1e9 elements, more than BERT-Large has)
        assert totals[:3] == sorted(totals[:3], reverse=True), totals
        assert "gathered parameters (stage3_max_live_parameters)" in runs[3].phases["forward/backward"]
    for stage in (1, 2, 3):
        per_nodes = [zmm.estimate(bert_large, stage, 8, 8, n, grad_accum_dtype="fp32").total for n in (1, 2, 4, 8)]
        assert per_nodes == sorted(per_nodes, reverse=True) and len(set(per_nodes)) == 4, (stage, per_nodes)
        # what a rank holds between steps never exceeds the predicted peak, and falls with more ranks too
        resident = [zmm.resident_state_bytes(bert_large, stage, 8 * n) for n in (1, 2, 4, 8)]
        assert resident == sorted(resident, reverse=True)
        assert all(r < zmm.estimate(bert_large, stage, 1, 8, n).total for r, n in zip(resident, (1, 2, 4, 8)))
    # ZeRO-0 without a partitioning wrapper (fp32: the optimizer itself) replicates everything: more ranks change
    # nothing (bf16 ZeRO-0 on Habana's fork is BF16_Optimizer, which partitions: tests/test_deepspeed_behaviour.py)
    assert len({zmm.estimate(bert_large, 0, 8, 8, n, precision="fp32").total for n in (1, 2, 4)}) == 1


def test_the_optimizer_deepspeed_picks_and_its_buffers():
    big = tuning.model_shape("bert-1.5b")
    P, GBy = big.params, 1e9
    # the shipped bert_1p5b_zero1_bf16.json: bf16, grad_accum_dtype fp32, ZeRO-1, 64 ranks -> BF16_Optimizer, whose
    # fp32 gradient buffer is not partitioned: 2 (bf16 params) + 4 (fp32 grads) + 12 / N bytes per parameter held,
    # + 2 (the bf16 gradients) where the installed DeepSpeed keeps them between steps (Habana's fork)
    e = zmm.estimate(big, 1, 32, 8, 8, grad_accum=2, grad_accum_dtype="fp32")
    assert e.optimizer == "BF16_Optimizer"
    held = 2 * P if zmm.bf16_grads_held() else 0
    assert e.model_states == pytest.approx(6 * P + held + 12 * P / 64)
    assert 9.3 * GBy < e.model_states - held < 9.6 * GBy
    assert any("NOT partitioned" in k for k in e.parts)
    # + the bf16 gradients of forward/backward: ~12.6 GiB (13.5 GB) per rank before activations
    assert e.total - e.activations == pytest.approx(8 * P + 12 * P / 64 + 2 * min(P, 5e8), rel=0.02)
    # bf16 accumulation (DeepSpeed's default) keeps DeepSpeedZeroOptimizer: gradients in bf16, 4 B/param less
    e_bf16 = zmm.estimate(big, 1, 32, 8, 8, grad_accum=2, grad_accum_dtype="bf16")
    assert e_bf16.optimizer == "DeepSpeedZeroOptimizer" and e_bf16.model_states < e.model_states - 3.9 * P
    assert zmm.estimate(big, 0, 1, 8, 1, precision="fp32").optimizer == "basic"
    # bf16 at ZeRO-0 is where the releases of the support matrix differ (the installed one decides:
    # tests/test_deepspeed_behaviour.py): 0.19 runs it with bf16 accumulation only, Habana's fork with fp32 only
    import deepspeed

    on, off = (("fp32", None) if deepspeed.__version__.startswith("0.16.") else (None, "fp32"))
    want = "BF16_Optimizer" if on == "fp32" else "FP16_UnfusedOptimizer"
    assert zmm.estimate(big, 0, 1, 8, 1, fused_adam=False, grad_accum_dtype=on).optimizer == want
    with pytest.raises(zmm.TuningError, match="refuses it at deepspeed.initialize"):
        zmm.estimate(big, 0, 1, 8, 1, grad_accum_dtype=off)
    # overlap_comm doubles the reduce bucket; the CPU's non-fused Adam adds two fp32 copies of the partition
    small = zmm.estimate(big, 2, 1, 8, 8, grad_accum_dtype="fp32")
    both = zmm.estimate(big, 2, 1, 8, 8, grad_accum_dtype="fp32", overlap_comm=True)
    assert both.phases["forward/backward"] != small.phases["forward/backward"]
    unfused = zmm.estimate(big, 2, 1, 8, 8, grad_accum_dtype="fp32", fused_adam=False)
    step_growth = unfused.phase_totals()["optimizer step"] - small.phase_totals()["optimizer step"]
    assert step_growth == pytest.approx(8 * P / 64)


def test_ds_tune_recommends_and_its_json_validates(tmp_path, capsys):
    out = tmp_path / "ds.json"
    rc = tuning.main(["--model", "bert-large", "--accelerator", "gaudi2", "--accelerators-per-node", "8",
                      "--nodes", "2", "--global-batch", "1024", "--out", str(out), "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    best = summary["recommended"]
    assert summary["feasible"] and all(o["headroom_gib"] >= 0 for o in summary["feasible"])
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


def test_bert_1p5b_on_8_nodes_of_first_gen_gaudi(tmp_path):
    """ds-tune as a user runs it, in a process of its own: its first act there is to build the model on the meta
    device, which on torch 2.6 was the first import of torch._dynamo; that import fails under a meta default device
    and left torch._dynamo half-imported, so the count fell back to the formula and DeepSpeed could then not be
    imported (ds_core.compat.torch_releases.meta_device). This test process imported torch._dynamo long ago."""
    import subprocess
    import sys

    from conftest import REPO, dist_env

    out = tmp_path / "ds.json"
    proc = subprocess.run([sys.executable, "-c", "import sys; from ds_tools.tuning import main; sys.exit(main())",
                           "--model", "bert-1.5b", "--accelerator", "gaudi", "--nodes", "8", "--global-batch", "4096",
                           "--out", str(out), "--json"], cwd=REPO, env=dist_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    best = summary["recommended"]
    shape = tuning.model_shape("bert-1.5b")
    assert shape.exact and (summary["params"], summary["params_by"]) == (shape.params, "count")  # not by formula
    assert summary["capacity_gib"] == 32 and summary["usable_gib"] == pytest.approx(32 * 0.92)
    assert all(o["stage"] != 0 for o in summary["feasible"])   # ZeRO-0 holds 14 B/param = 21 GB + gradients
    # the JSON states every field that changes memory or numerics, as the model assumed them ...
    cfg = load_ds_config(str(out), world_size=64)
    zero = cfg["zero_optimization"]
    assert cfg["bf16"]["enabled"] and cfg["data_types"]["grad_accum_dtype"] == "fp32"
    assert {"reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
            "reduce_scatter"} <= set(zero)
    # ... so the memory of the configuration the JSON describes is the predicted one, with the promised headroom
    again = zmm.estimate(shape, zero["stage"], cfg["train_micro_batch_size_per_gpu"], 8, 8, precision="bf16",
                         grad_accum=cfg["gradient_accumulation_steps"],
                         grad_accum_dtype=cfg["data_types"]["grad_accum_dtype"], overlap_comm=zero["overlap_comm"],
                         contiguous_gradients=zero["contiguous_gradients"],
                         buckets={k: zero[k] for k in ("reduce_bucket_size", "allgather_bucket_size")})
    assert again.total / GIB == pytest.approx(best["predicted_gib"])
    assert summary["usable_gib"] - again.total / GIB >= tuning.SAFETY_MARGIN * again.total / GIB
    assert best["optimizer"] == again.optimizer


def test_nothing_fits_says_what_would(tmp_path, capsys):
    out = tmp_path / "ds.json"
    # a 2.5 B BERT on one 32 GB Gaudi: even ZeRO-3 holds 2 + 4 + 8 + 4 = 18 B/param = 45 GB
    big = tmp_path / "bert_2p5b.json"
    big.write_text(json.dumps({"model_type": "bert", "architectures": ["BertForPreTraining"], "hidden_size": 2048,
                               "num_hidden_layers": 48, "num_attention_heads": 16, "intermediate_size": 8192,
                               "vocab_size": 30528, "seq_len": 128}))
    rc = tuning.main(["--model", str(big), "--accelerator", "gaudi", "--accelerators-per-node", "1",
                      "--nodes", "1", "--global-batch", "8", "--activation-checkpointing", "off", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 1 and "Nothing fits" in text and not out.exists()
    assert "use at least 2 nodes with ZeRO-3" in text
    with pytest.raises(tuning.TuningError, match="not a positive multiple of 16 ranks"):
        tuning.search(tuning.model_shape("bert-large"), "gaudi", 8, 2, 1000)


def test_ds_tune_says_where_its_json_goes_and_prints_it_on_request(tmp_path, capsys, monkeypatch):
    help_text = tuning.build_parser().format_help()
    assert "default: ds_config_tuned.json in the current directory" in " ".join(help_text.split())
    monkeypatch.chdir(tmp_path)
    args = ["--model", "bert-large", "--accelerator", "gaudi2", "--nodes", "2", "--global_batch", "1024"]
    assert tuning.main([*args, "--out", "-"]) == 0
    printed = capsys.readouterr()
    assert not list(tmp_path.iterdir())  # nothing written
    cfg = json.loads(printed.out)  # stdout: the JSON only; the report went to stderr
    assert "Recommended: ZeRO-" in printed.err
    assert load_ds_config(cfg, world_size=16)["train_batch_size"] == 1024
    assert tuning.main(args) == 0 and (tmp_path / "ds_config_tuned.json").is_file()
    assert "DeepSpeed JSON written to ds_config_tuned.json" in capsys.readouterr().out


def test_optimizer_none_json_clips_as_the_shipped_configs_do():
    """A JSON for an entry point that builds its own optimizer (LAMB / LANS clip at --max_grad_norm 1.0 themselves)
    has the gradient_clipping of the shipped JSONs without an optimizer section, stage by stage."""
    from ds_core.config import DS_CONFIG_DIR

    shipped = {}
    for path in DS_CONFIG_DIR.glob("*.json"):
        raw = json.loads(path.read_text())
        if "optimizer" not in raw:
            shipped.setdefault(raw["zero_optimization"]["stage"], set()).add(raw["gradient_clipping"])
    assert set(shipped) == {1, 3}
    shape = tuning.model_shape("bert-large")
    for o in tuning.search(shape, "gaudi2", 8, 1, 512, "off", stages=(0, 1, 2, 3)):
        clip = tuning.ds_config(o, 512, optimizer="none")["gradient_clipping"]
        assert clip == tuning.CODE_OPTIMIZER_CLIPPING[o.stage]
        assert shipped.get(o.stage, {clip}) == {clip}, (o.stage, shipped)
        assert tuning.ds_config(o, 512)["gradient_clipping"] == 1.0  # AdamW section: DeepSpeed clips


def test_one_set_of_accelerator_names_across_ds_tune_and_predict(capsys):
    from ds_core.device import accelerators
    from ds_tools import fabrics

    assert tuning.capacity_bytes("dl1", 8) == tuning.capacity_bytes("gaudi", 8) == 32 * GIB   # 32 GiB of HBM2
    for fab in fabrics.FABRICS.values():  # each system is a name ds-tune takes, and names its accelerators
        assert accelerators.get(fab.name).name in fab.accelerators
        for acc in fab.accelerators:
            assert fabrics.lookup(acc) is fab
    assert fabrics.lookup("gaudi1") is fabrics.lookup("dl1") is fabrics.FABRICS["dl1"]
    with pytest.raises(ValueError, match="no modelled system is built from h200"):
        fabrics.lookup("h200")
    from ds_tools import predict

    argv = ["--measured", "1379.76", "--measured_nodes", "1", "--model", "bert-large", "--precision", "bf16",
            "--zero_stage", "0", "--micro_batch", "64", "--global_batch", "65536", "--accelerators_per_node", "8",
            "--nodes", "2", "--format", "json"]
    assert predict.main([*argv, "--fabric", "dl1"]) == 0
    by_fabric = json.loads(capsys.readouterr().out)
    assert predict.main([*argv, "--fabric", "gaudi"]) == 0
    assert json.loads(capsys.readouterr().out) == by_fabric


def test_recommendations_stay_in_the_documented_stages_and_name_our_checkpointing_flag(capsys):
    """ZeRO-1 or ZeRO-3 unless --stages asks for more (the model docs cover those); where a recommendation needs
    activation checkpointing, the note names the entry point's flag."""
    args = ["--model", "bert-1.5b", "--accelerator", "dl1", "--nodes", "8", "--global_batch", "12288", "--json",
            "--out", "-"]
    assert tuning.main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["recommended"]["stage"] in tuning.DEFAULT_STAGES
    assert {o["stage"] for o in summary["feasible"]} <= set(tuning.DEFAULT_STAGES)
    assert tuning.main([*args, "--stages", "1,2,3"]) == 0
    summary = json.loads(capsys.readouterr().out)   # asked for: listed and ranked; it reduces every micro step
    zero2 = [o for o in summary["rows"] if o["stage"] == 2]
    assert zero2 and all(o["reason"] for o in zero2) and summary["recommended"]["stage"] == 1
    assert tuning.main(["--model", "bert-1.5b", "--accelerator", "gaudi", "--nodes", "1", "--global_batch", "64",
                        "--activation_checkpointing", "on", "--out", "-"]) == 0
    assert "bert_ref.train --activation_checkpointing true" in capsys.readouterr().err  # the report: stderr
