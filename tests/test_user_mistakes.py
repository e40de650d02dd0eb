"""A user's mistake in a training command is one line, said once: `python -m bert_ref.train: error: <what>` from rank 0,
exit status 2 on every rank, no traceback (ds_core.rank.process_end.run_main). The mistakes: a misspelt flag, a bad
value, an unknown --recipe, an --input_dir that is not there, a bad DeepSpeed JSON, a preset without a JSON of its own,
and BridgeTower's data set or model missing from the offline caches. Each is found before distributed init.

In-process for the messages (main() raises the ConfigError that run_main turns into the line); small subprocesses for
run_main itself; one 2-rank launch (slow) for "once" through a real launcher."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import bert_ref.train as bert_train
import ds_core.run.setup
from conftest import REPO, dist_env, run_deepspeed
from ds_core.errors import ConfigError

pytestmark = pytest.mark.stack  # a user's mistake is one line, on every stack


def _stop_at_init(*_a, **_k):
    raise AssertionError("the mistake was not found before distributed init")


@pytest.fixture
def no_init(monkeypatch):
    monkeypatch.setattr(ds_core.run.setup, "init_distributed", _stop_at_init)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "debug", "--input_dir", "{tmp}", "--learning_rte", "1e-3"],
     "unknown command-line argument(s): '--learning_rte' (did you mean '--learning_rate'?)"),
    (["--preset", "debug", "--input_dir", "{tmp}", "--max_steps", "x"], "--max_steps/--max-steps: invalid int value"),
    (["--recipe", "habana_1p5b", "--input_dir", "{tmp}"], "--recipe 'habana_1p5b': unknown; expected one of"),
    (["--preset", "debug", "--input_dir", "{tmp}/nowhere"], "--input_dir {tmp}/nowhere: no such directory"),
    (["--preset", "debug", "--input_dir", "{tmp}", "--deepspeed_config", "{tmp}/bad.json"],
     "unknown top-level key(s) 'zero_optimisation' (did you mean 'zero_optimization'?)"),
    (["--preset", "debug", "--input_dir", "{tmp}", "--report_to", "mlflow"], "--report_to 'mlflow': expected one of"),
])
def test_bert_mistakes_are_config_errors_naming_the_thing(argv, message, tmp_path, no_init):
    (tmp_path / "bad.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 4,
                                                   "zero_optimisation": {"stage": 1}}))
    with pytest.raises(ConfigError) as e:
        bert_train.main([a.format(tmp=tmp_path) for a in argv] + ["--run_dir", str(tmp_path / "run")])
    assert message.format(tmp=tmp_path) in str(e.value)
    assert "'1e-3'" not in str(e.value)  # a misspelt flag's value is not a second unknown argument
    assert not (tmp_path / "run").exists()


def test_each_preset_brings_its_json_or_the_run_refuses(tmp_path, monkeypatch, no_init):
    import ds_configs
    from bert_ref.configs import PRESETS, BertArgs

    assert set(ds_configs.DEFAULT_JSON["bert_ref.train"]["preset"]) == set(PRESETS) | {""}
    assert ds_configs.preset_json("bert_ref.train", "") == ds_configs.preset_json("bert_ref.train", BertArgs().preset)
    assert ds_configs.preset_json("bert_ref.train", "bert_1p5b") == "bert_1p5b_zero1_bf16.json"  # not BERT-Large's
    from bert_ref.recipes import RECIPES

    for name, run in RECIPES.items():  # a recipe's JSON as launch.run --dry_run names it is the one its flags set
        assert ds_configs.DEFAULT_JSON["bert_ref.train"]["recipe"][name] == \
            run.flags[run.flags.index("--deepspeed_config") + 1]
    monkeypatch.setitem(ds_configs.DEFAULT_JSON["bert_ref.train"]["preset"], "bert_1p5b", "")
    with pytest.raises(ConfigError, match=r"--preset bert_1p5b has no DeepSpeed JSON of its own .*: give "
                                          "--deepspeed_config"):
        bert_train.main(["--preset", "bert_1p5b", "--input_dir", str(tmp_path), "--run_dir", str(tmp_path / "r")])


def test_bridgetower_model_missing_is_a_config_error(tmp_path, no_init):
    import bridgetower_ds.train as bt_train

    (tmp_path / "d.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"--model_name_or_path .*nowhere: no such directory"):
        bt_train.main(["--do_train", "--dataset_path", str(tmp_path / "d.jsonl"), "--model_name_or_path",
                       str(tmp_path / "nowhere"), "--run_dir", str(tmp_path / "r")])


RAISES = ("import ds_core.rank.process_end as pe\n"
          "from ds_core.errors import ConfigError\n"
          "pe.MISTAKE_LINGER_S = 0.1\n"
          "def main():\n"
          "    print('started', flush=True)\n"
          "    raise ConfigError('--input_dir d: no such directory')\n"
          "pe.run_main(main)\n")


@pytest.mark.parametrize("rank, local, said", [("0", "0", "error: --input_dir d"),
                                               ("3", "0", "error: (rank 3) --input_dir d"), ("5", "2", "")])
def test_run_main_says_a_mistake_once_and_exits_2(rank, local, said):
    """Rank 0 says it; another rank only after a wait that rank 0's exit cuts short through the launcher (here
    nothing kills it: a mistake rank 0 did not make is said by the first rank of the node, naming the rank)."""
    env = {**dist_env(), "RANK": rank, "LOCAL_RANK": local, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", RAISES], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == "started\n", proc
    assert "Traceback" not in proc.stderr
    if said:
        assert proc.stderr.splitlines() == [f"python -c: {said}: no such directory"], proc.stderr
    else:
        assert proc.stderr == ""


@pytest.mark.slow
def test_a_mistake_on_two_ranks_is_one_line(tmp_path):
    """Through the documented local launcher: every rank makes the mistake, one line says it, exit status 2."""
    proc = run_deepspeed(["--module", "bert_ref.train", "--preset", "debug", "--input_dir", str(tmp_path / "none"),
                          "--run_dir", str(tmp_path / "run")], check=False, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "error" in line.lower()]
    assert lines == [f"python -m bert_ref.train: error: --input_dir {tmp_path / 'none'}: no such directory"], \
        proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout
