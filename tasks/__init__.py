"""Task-specific parts, each in its own module: the sandbox for model-written code (sandbox.py, with the two programs it
runs: sandbox_launcher.py and sandbox_test_runner.py), the code task (code.py) and the demo world (demo.py). The stage
scripts import them only where a task needs them."""
