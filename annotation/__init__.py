"""Stage 1's parts beside 01_annotate.py: the served critic's requests (annotator.py), the responses sampled from a
policy (generation.py: --generate-with), and what made an output and its summary (report.py)."""
