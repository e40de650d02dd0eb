"""One training run: its set-up (setup.start_run -> a frozen Run), THE loop (trainer.Trainer.fit) and the parts it
calls: the step around the engine (step), the delayed read-back of each step's values (readback), checkpointing,
evaluation, callbacks, stop requests (stop), the data contract (data), the divergence verdict (divergence) and the
used-run-directory rule (run_dir)."""
