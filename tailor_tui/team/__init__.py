"""The processes that do the work: the local worker pool (`workers`), launchers and the multi-node
team (`launch`, `team`, `progress`), and the composer's batch job on a login node (`sbatch`).
"""
