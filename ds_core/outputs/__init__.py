"""What a run writes: the one clock and MFU (metrics), sampled step-phase timing (phases), transformers Trainer-style
results files and the fp32 model (results), Trainer's trainer_state.json and checkpoint-N links (hf_trainer), the
audit log of the samples each rank trained on (sample_log), the `--report_to` monitors (monitors), and where a step's
time went (profile: torch.profiler over a few steps)."""
