"""Runs NVIDIA DeepLearningExamples' PyTorch BERT create_pretraining_data.py (commit 7a4c4250, the h5 era) on the
corpus of make_corpus.py and writes reference.json: per text shard, the dtype, shape and sha256 of each of the six
arrays NVIDIA's script wrote, with the settings and the exact command. tests/test_bert_prep_nvidia.py checks
`bert-prep shards --nvidia_compat` against them.

Run from a copy of the reference OUTSIDE this repository:
    git --git-dir=<mirror of NVIDIA/DeepLearningExamples> archive 7a4c4250 \
        PyTorch/LanguageModeling/BERT/{create_pretraining_data,tokenization,file_utils}.py | tar -x -C /tmp/ref_nvidia
    python tests/data/nvidia_shards/make_reference.py /tmp/ref_nvidia/PyTorch/LanguageModeling/BERT
Its imports six, boto3, requests and botocore (for downloads the run does not do) are stubbed in a temporary
directory when absent.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_corpus  # noqa: E402

REFERENCE = {"repo": "NVIDIA/DeepLearningExamples", "commit": "7a4c42501ce05ac5b76999e3b9ddadeffd177b1d",
             "file": "PyTorch/LanguageModeling/BERT/create_pretraining_data.py"}
# bertPrep.py's phase-1 settings (its defaults: dupe_factor 5, random_seed 12345); short_seq_prob: the script's 0.1
SETTINGS = {"max_seq_length": 128, "max_predictions_per_seq": 20, "masked_lm_prob": 0.15, "random_seed": 12345,
            "dupe_factor": 5, "short_seq_prob": 0.1}
STUBS = {"six.py": "PY2, PY3 = False, True\n", "boto3.py": "", "requests.py": "", "botocore/__init__.py": "",
         "botocore/exceptions.py": "class ClientError(Exception):\n    pass\n"}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def array_fingerprints(h5_path: Path) -> dict[str, dict]:
    with h5py.File(h5_path, "r") as f:
        return {k: {"dtype": str(f[k].dtype), "shape": list(f[k].shape),
                    "sha256": hashlib.sha256(np.ascontiguousarray(f[k][:]).tobytes()).hexdigest()} for k in sorted(f)}


def main(ref_dir: str) -> None:
    script = Path(ref_dir) / "create_pretraining_data.py"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards, vocab = make_corpus.write(tmp / "corpus")
        for name, text in STUBS.items():
            (tmp / "stubs" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / "stubs" / name).write_text(text)
        out: dict = {"reference": REFERENCE, "settings": SETTINGS, "corpus_seed": make_corpus.SEED,
                     "vocab_sha256": sha256_file(vocab), "shards": {}}
        for shard in shards:
            h5 = tmp / (shard.stem + ".hdf5")
            cmd = [sys.executable, str(script), "--vocab_file", str(vocab), "--input_file", str(shard),
                   "--output_file", str(h5), "--do_lower_case"] + [f"--{k}={v}" for k, v in SETTINGS.items()]
            subprocess.run(cmd, check=True, env={"PYTHONPATH": str(tmp / "stubs"), "PATH": "/usr/bin:/bin"},
                           stdout=subprocess.DEVNULL)
            out["shards"][shard.name] = {"text_sha256": sha256_file(shard), "arrays": array_fingerprints(h5)}
        out["command"] = ("python create_pretraining_data.py --vocab_file vocab.txt --input_file text/<shard> "
                          "--output_file <shard>.hdf5 --do_lower_case " +
                          " ".join(f"--{k}={v}" for k, v in SETTINGS.items()))
    (HERE / "reference.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: {a: v["shape"] for a, v in s["arrays"].items()} for k, s in out["shards"].items()}))


if __name__ == "__main__":
    main(sys.argv[1])
