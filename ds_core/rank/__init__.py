"""One rank's process: how it finds its world (rendezvous), starts its process group (dist), cleans up what DeepSpeed
leaves in shared memory (shm), builds the DeepSpeed engine (engine_build), decides and runs the compile (compile),
holds its run directory's lock (run_lock), stops when its launcher dies (parent_watch) and ends without interpreter
finalisation (process_end). Kept light: process_end and venv are standard library only, imported before anything
heavy."""
