"""Triton model repository templates (ensemble, preprocessing, dflash)."""
