"""The runtime every training rank imports, shared by every model, in rooms:

  config/      the typed settings (TrainConfig, OptimArgs), CLI + JSON parsing, DeepSpeed JSON validation
  schedule/    learning-rate schedules and weight-decay groups (published.py: NVIDIA's and Habana's BERT schedules)
  run/         one run: set-up, the Trainer and its loop, checkpointing / evaluation components, run directory
  rank/        one rank's process: rendezvous, process group (dist), shared-memory leftovers (shm), DeepSpeed engine
               (engine), compile policy (compile), parent watch, how it ends
  compat/      what the toolkit changes or reads inside DeepSpeed and transformers: one list, applied per stage
  device/      the accelerator: peak table, precision rule, DeepSpeed's compiled ops
  outputs/     metrics (the one clock, MFU), phase timing, results files, Trainer's files, sample log
  checkpoint/  save, verified resume, resize onto another world size
  cli.py       what every command line shares
  log.py       the one console logger (rank 0's lines, "[ds_core] ..."); files.py: files written whole or not at all

Offline tools (scaling reports, ZeRO tuning, studies, checkpoint inspection) are in ds_tools, which no rank imports."""
