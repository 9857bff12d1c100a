"""The draft-verify loop: engine protocol, sampling, stop criteria and per-request statistics."""
