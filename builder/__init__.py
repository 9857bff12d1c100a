"""dflash-build: checkpoints, torch networks with taps, drafter initialisation (and, later, ONNX/engines)."""
