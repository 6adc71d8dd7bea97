"""Stage 1's parts beside 01_annotate.py: the served critic's requests (annotator.py), the responses sampled from a
policy (generation.py: --generate-with), what made an output and its summary (report.py), and the records of a
dataset or of the zero-flag demo, with the demo's inputs for the later stages (inputs.py)."""
