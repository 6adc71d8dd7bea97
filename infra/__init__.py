"""The machinery a real run needs and the algorithm does not: models, decoding, serving, run folders, torchrun, the SFT
warm start, traces and reports. The stage scripts call it; nothing here imports a stage script.
"""
