"""Triton model repository templates (ensemble, dflash)."""
