"""Hydra's ``hydra/sweeper=vitattn_optuna``: an Optuna study (Optuna >= 4) searched through Hydra's launcher.

The study lives in a storage that outlives the process (SQLite, a journal file on a shared filesystem,
or an RDB URL), so a search can be stopped and continued, and several machines can work on one study.
"""
