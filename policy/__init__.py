"""Stage 3's parts beside 03_train_policy.py: its command line and --task presets (cli.py)."""
