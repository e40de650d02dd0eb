"""`ds-ckpt` (also `python -m ds_tools.ckpt_cli`): look at and convert a run's checkpoints without starting a run.

  ds-ckpt info RUN_DIR                 steps, latest, ZeRO stage, world size, batch, data position per rank, bytes,
                                       complete / incomplete (and universal conversions)
  ds-ckpt universal RUN_DIR [--tag T]  convert a checkpoint (default: the latest complete) with DeepSpeed's
                                       ds_to_universal into <tag>_universal next to it (what a resize does itself)
  ds-ckpt export-hf RUN_DIR OUT [--tag T]
                                       fp32 weights of any checkpoint (ZeRO-0..3, partitions gathered) through
                                       DeepSpeed's zero_to_fp32, written by save_pretrained as the run's own
                                       export is (model.safetensors + config.json, tied weights once): a
                                       `from_pretrained` of the model's transformers class loads OUT

Runs on one process without torch.distributed; reads only files. Errors name the path and what is wrong (exit 2).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ds_core import checkpoint as ckpt
from ds_core.checkpoint.pretrained import write_pretrained
from ds_core.cli import ArgumentParser, cli_main, json_stdout
from ds_core.errors import ConfigError


def _root(run_dir: str) -> Path:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        raise ConfigError(f"{run_dir}: no checkpoints/ directory (expected RUN_DIR/checkpoints/global_step*/)")
    return root


def _tag(root: Path, tag: str | None) -> str:
    if tag:
        if not (root / tag).is_dir():
            raise ConfigError(f"{root / tag}: no such checkpoint (have: {', '.join(ckpt.step_tags(root)) or 'none'})")
        if not ckpt.is_complete(root, tag):
            raise ConfigError(f"{root / tag}: no {ckpt.COMPLETE} marker: an incomplete checkpoint (a save cut short) "
                              f"is never used")
        return tag
    latest = ckpt.latest_tag(root)
    if latest is None:
        raise ConfigError(f"{root}: no complete checkpoint (a global_step*/{ckpt.COMPLETE} marker)")
    return latest


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def info(run_dir: str) -> dict:
    """What `ds-ckpt info` prints, as a dict (tags newest first). Reads markers as JSON and client files as data
    (weights-only: ds_core.checkpoint.safe_load); a file that is neither is shown as such, never unpickled."""
    root = _root(run_dir)
    named = (root / ckpt.LATEST).read_text().strip() if (root / ckpt.LATEST).is_file() else None
    out: dict[str, Any] = {"checkpoints": str(root), "latest": ckpt.latest_tag(root), "latest_file": named, "tags": []}
    for tag in ckpt.step_tags(root):
        path = root / tag
        entry: dict[str, Any] = {"tag": tag, "complete": ckpt.is_complete(root, tag), "bytes": _bytes(path)}
        if entry["complete"]:
            try:
                meta = ckpt.read_marker(root, tag)
            except ConfigError as e:  # shown, not fatal: info is for looking at broken checkpoints too
                entry.update(complete=False, marker_error=str(e))
                out["tags"].append(entry)
                continue
            fp = meta.get("fingerprint", {})
            entry.update(step=meta.get("step"), zero_stage=fp.get("zero_stage"),
                         world_size=ckpt.saved_world_size(root, tag), batch=meta.get("batch"),
                         optimizer=fp.get("optimizer_class", fp.get("optimizer")))
            entry["data_position"] = [_data_position(f) for f in sorted(
                path.glob("client_rank*.pt"), key=lambda p: int(p.stem[len("client_rank"):]))]
        uni = ckpt_universal(root, tag)
        if uni is not None:
            entry["universal"] = uni
        out["tags"].append(entry)
    if out["latest"] and any(t["tag"] == out["latest"] and "marker_error" in t for t in out["tags"]):
        out["latest"] = next((t["tag"] for t in out["tags"] if t["complete"]), None)  # what a resume would take
    return out


def _data_position(f: Path) -> dict:
    from ds_core.checkpoint.client_state import read_client_state

    try:
        st = read_client_state(f)
        return {"rank": int(f.stem[len("client_rank"):]), "epoch": st.get("epoch"), "data": st.get("data")}
    except Exception as e:  # noqa: BLE001 - shown, not fatal: info is for looking at broken checkpoints too
        return {"rank": f.stem, "error": f"{type(e).__name__}: {e}"}


def ckpt_universal(root: Path, tag: str) -> dict | None:
    from ds_core.checkpoint.resize import universal_dir

    u = universal_dir(root, tag)
    if not u.is_dir():
        return None
    return {"path": str(u), "complete": (u / ckpt.COMPLETE).is_file(), "bytes": _bytes(u)}


def _short(data: Any, limit: int = 160) -> str:
    text = json.dumps(data, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def print_info(d: dict) -> None:
    print(f"{d['checkpoints']}: latest complete {d['latest'] or 'none'}"
          + (f" (`latest` names {d['latest_file']})" if d['latest_file'] != d['latest'] else ""))
    for t in d["tags"]:
        if "marker_error" in t:
            print(f"  {t['tag']}: INCOMPLETE (unreadable {ckpt.COMPLETE}; never loaded): {t['marker_error']}")
            continue
        if not t["complete"]:
            print(f"  {t['tag']}: INCOMPLETE (no {ckpt.COMPLETE}; never loaded), {t['bytes']:,} bytes")
            continue
        b = t.get("batch") or {}
        print(f"  {t['tag']}: step {t['step']}, ZeRO-{t['zero_stage']}, world size {t['world_size']}, global batch "
              f"{b.get('train_batch_size', '?')} (micro {b.get('micro_batch', '?')} x accum {b.get('grad_accum', '?')}"
              f"), optimizer {t.get('optimizer')}, {t['bytes']:,} bytes")
        for r in t["data_position"]:
            print(f"    rank {r['rank']}: " + (r["error"] if "error" in r else
                                               f"epoch {r['epoch']}, data {_short(r['data'])}"))
        if "universal" in t:
            u = t["universal"]
            print(f"    universal: {u['path']} ({'complete' if u['complete'] else 'INCOMPLETE'}, {u['bytes']:,} bytes)")


def universal(run_dir: str, tag: str | None = None) -> Path:
    """DeepSpeed's ds_to_universal of a checkpoint, its files read as data (safe_load.data_only_loads)."""
    from ds_core.checkpoint.resize import convert_to_universal
    from ds_core.checkpoint.safe_load import data_only_loads

    root = _root(run_dir)
    tag = _tag(root, tag)
    with data_only_loads():
        return convert_to_universal(root, tag)


def fp32_from_universal(root: Path, tag: str) -> dict:
    """{parameter name: fp32 tensor} from the universal conversion of `tag`
    (ds_core.checkpoint.resize.convert_to_universal: <tag>_universal/zero/<name>/fp32.pt, each {"param": tensor})."""
    from deepspeed.checkpoint.constants import PARAM

    from ds_core.checkpoint.resize import convert_to_universal
    from ds_core.checkpoint.safe_load import data_only_loads, load

    with data_only_loads():
        zero = convert_to_universal(root, tag) / "zero"
    return {d.name: load(d / "fp32.pt", deepspeed=True)[PARAM].float()
            for d in sorted(zero.iterdir()) if (d / "fp32.pt").is_file()}


def export_hf(run_dir: str, out_dir: str, tag: str | None = None) -> Path:
    """fp32 weights of a checkpoint as a transformers model directory (model.safetensors + config.json).

    The class and config come from the checkpoint's hf_model.json (written by ds_core.checkpoint.save). A parameter
    the model keeps in another shape than transformers' (BridgeTower's logit_scale, [1] under DeepSpeed, 0-dim in
    transformers) is reshaped to the class's own shape when the element count matches."""
    import transformers
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ds_core.checkpoint.safe_load import NotPlainData, data_only_loads, load
    from ds_core.compat.hf import set_config_dtype
    from ds_core.compat.torch_releases import meta_device

    root = _root(run_dir)
    tag = _tag(root, tag)
    meta_file = root / tag / ckpt.HF_MODEL
    if not meta_file.is_file():
        raise ConfigError(f"{meta_file}: missing: the checkpoint does not record its transformers class and config "
                          f"(saved before export-hf existed, or the model is not a transformers model)")
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as e:
        raise ConfigError(f"{meta_file}: not JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise ConfigError(f"{meta_file}: expected a JSON object with \"class\" and a \"config\" object")
    cls = getattr(transformers, str(meta.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ConfigError(f"{meta_file}: class {meta.get('class')!r} is not a model class of transformers "
                          f"{transformers.__version__}")
    config = cls.config_class.from_dict(meta["config"])
    config.architectures = [meta["class"]]
    set_config_dtype(config, "float32")  # the file holds fp32 master weights, whatever the run trained in
    try:
        with data_only_loads():  # DeepSpeed's reader, its torch.loads made weights-only (files are data)
            state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    except NotPlainData as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:
        # zero_to_fp32 reads ZeRO optimizer files only; bf16 with fp32 gradient accumulation (the shipped configs on
        # a bf16 machine) saves BF16_Optimizer's bf16_zero_pp_rank_* files, which DeepSpeed's ds_to_universal does
        # convert: read the fp32 master weights from that conversion (made once, kept beside the checkpoint)
        if "is not a zero checkpoint" not in str(e) or not list((root / tag).glob("bf16_zero_pp_rank_*")):
            raise
        state = fp32_from_universal(root, tag)
    with meta_device():
        skeleton = cls(config)  # the class and config save_pretrained writes with; its weights are never read
    expected = {k: v.shape for k, v in skeleton.state_dict().items()}
    missing = [k for k in expected if k not in state]
    if missing:
        # zero_to_fp32 rebuilds trained parameters from the optimizer's fp32 partitions and frozen ones only where
        # DeepSpeed stored them (ZeRO >= 2); under ZeRO-0/1 a frozen parameter (BridgeTower's text pooler) is in the
        # module state of mp_rank_00 alone, in the dtype the run trained in (bf16-rounded under bf16)
        module_file = root / tag / "mp_rank_00_model_states.pt"
        if module_file.is_file():
            module = load(module_file, deepspeed=True).get("module") or {}
            for k in missing:
                if k in module and module[k].numel() == expected[k].numel():
                    state[k] = module[k].float()
    for k, v in list(state.items()):
        if k in expected and v.shape != expected[k] and v.numel() == expected[k].numel():
            state[k] = v.reshape(expected[k])
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise ConfigError(f"{root / tag}: {len(unknown)} weight(s) that {meta['class']} does not have, e.g. "
                          f"{unknown[:3]}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not empty; export-hf never overwrites a directory")
    # the writer of the run's own exports (safetensors through save_pretrained, tied weights written once, the
    # config's dtype float32: ds_core.checkpoint.pretrained)
    return write_pretrained(skeleton, {k: v.contiguous() for k, v in state.items()}, out)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="ds-ckpt", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("info", help="steps, ZeRO stage, world size, data position, sizes")
    a.add_argument("run_dir")
    a.add_argument("--json", action="store_true", help="print JSON instead of text")
    a = sub.add_parser("universal", help="convert to DeepSpeed's universal checkpoint")
    a.add_argument("run_dir")
    a.add_argument("--tag", default=None, help="global_step{N}; default the latest complete one")
    # `export-hf` is the spelling the docs use; `export_hf` matches the underscore style of our flags
    a = sub.add_parser("export-hf", aliases=["export_hf"], help="fp32 weights as a transformers model directory")
    a.add_argument("run_dir")
    a.add_argument("out")
    a.add_argument("--tag", default=None, help="global_step{N}; default the latest complete one")
    return p


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "info" and args.json:
        with json_stdout() as out:  # stdout is the JSON only: what a library logs or prints meanwhile goes to stderr
            print(json.dumps(info(args.run_dir), indent=2, default=str), file=out)
    elif args.cmd == "info":
        print_info(info(args.run_dir))
    elif args.cmd == "universal":
        print(f"universal checkpoint: {universal(args.run_dir, args.tag)}")
    else:
        print(f"exported: {export_hf(args.run_dir, args.out, args.tag)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from ds_core.checkpoint.safe_load import NotPlainData

    return cli_main(argv, build_parser, _run, (ConfigError, OSError, NotPlainData), subcommand="cmd")


if __name__ == "__main__":
    sys.exit(main())
