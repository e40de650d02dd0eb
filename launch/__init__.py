"""Multi-node launch: hostfiles, fabric env profiles, run wrapper, preflight, AWS Batch / Slurm / MPI entry."""
