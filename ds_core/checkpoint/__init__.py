"""Checkpoints through the DeepSpeed engine on every rank, made "latest" only once complete: save.py writes,
load.py reads back (resume, a new phase, the export), fingerprint.py says what is compared; this module gathers
their names.

Layout under run_dir/checkpoints/:
  global_step{N}/            DeepSpeed's files (module, ZeRO partitions) written by engine.save_checkpoint
  global_step{N}/client_rank{r}.pt   per-rank client state: step, epoch, data position, RNG states, fingerprint
  global_step{N}/COMPLETE    written by rank 0 after every rank finished (barrier); JSON with the fingerprint and
                             the batch numbers (train_batch_size, micro batch, accumulation, data-parallel size)
  global_step{N}/hf_model.json   the module's transformers class and config (rank 0), for `ds-ckpt export-hf`
  global_step{N}/MANIFEST.json   every file's size and XXH3 checksum, written before COMPLETE and verified on resume
                             (ds_core.checkpoint.manifest); a checkpoint that fails is moved aside as
                             global_step{N}.corrupt
  global_step{N}_universal/  the same step converted by DeepSpeed's ds_to_universal, made on a resume onto another
                             data-parallel size (ds_core.checkpoint.resize); COMPLETE once the conversion finished
  latest                     tag of the newest COMPLETE checkpoint, replaced atomically

DeepSpeed's own client_state is saved by data-parallel rank 0 only, but the data position and RNG streams differ per
rank, so each rank writes its own file. A kill -9 during a save leaves a tag without COMPLETE and `latest` still
naming the previous checkpoint.
"""
from __future__ import annotations

from ds_core.checkpoint.client_state import CheckpointError, read_client_states, rng_state, set_rng_state
from ds_core.checkpoint.fingerprint import (
           HF_MODEL,
           MODEL_ORDER,
           NOT_COMPARED,
           batch_layout,
           describe_mismatch,
           hf_model_info,
           model_fingerprint,
)
from ds_core.checkpoint.load import export_hf, init_from, load, saved_world_size, select_resume_tag
from ds_core.checkpoint.save import prune, save, trim_metrics
from ds_core.checkpoint.tags import COMPLETE, LATEST, is_complete, latest_tag, read_marker, step_tags, tag_for

__all__ = ["CheckpointError", "read_client_states", "rng_state", "set_rng_state", "HF_MODEL", "MODEL_ORDER",
           "NOT_COMPARED", "batch_layout", "describe_mismatch", "hf_model_info", "model_fingerprint", "export_hf",
           "init_from", "load", "saved_world_size", "select_resume_tag", "prune", "save", "trim_metrics", "COMPLETE",
           "LATEST", "is_complete", "latest_tag", "read_marker", "step_tags", "tag_for"]
