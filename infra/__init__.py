"""The machinery a real run needs and the algorithm does not: models, decoding, serving, run folders, torchrun, the SFT
warm start, traces; 04's cache and statistics (evaluation), judge, monitors and report. The stage scripts call it;
nothing here imports a stage script.
"""
