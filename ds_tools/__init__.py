"""Offline tools: ds-tune (tuning), ds-scaling-report (scaling), ds-study (study/), ds-ckpt (ckpt_cli).

They read run directories, checkpoints and model presets; they may import ds_core, launch and the model packages'
presets, and no training process imports them (their plotting and table dependencies stay out of every rank).
"""
