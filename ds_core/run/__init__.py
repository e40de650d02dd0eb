"""One training run: its set-up (setup.start_run -> a frozen Run), the Trainer and its loop of steps (trainer, loop),
the Trainer's components (checkpointing, evaluation), the divergence verdict, and the used-run-directory rule."""
