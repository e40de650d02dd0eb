"""One rank's process: how it finds its world (rendezvous), starts the process group and the DeepSpeed engine
(engine), holds its run directory's lock (run_lock), stops when its launcher dies (parent_watch) and ends without
interpreter finalisation (process_end). Kept light: process_end and venv are standard library only, imported before
anything heavy."""
