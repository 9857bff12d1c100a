"""Triton Python model: incremental detokenization of streamed token ids.

Each response carries the new tokens (output_ids) and the tokens before them that are still needed for
context (prefix_ids). The text is decode(prefix + new) minus decode(prefix); the dflash model holds back
tokens that end inside a multi-byte character, so no response carries half a character.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        params = json.loads(args["model_config"])["parameters"]
        root = Path(args["model_repository"]).parent
        self.tokenizer = AutoTokenizer.from_pretrained(root / params["tokenizer_dir"]["string_value"])

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            new = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy().reshape(-1).tolist()
            prefix = pb_utils.get_input_tensor_by_name(request, "prefix_ids").as_numpy().reshape(-1).tolist()
            before = self.tokenizer.decode(prefix, skip_special_tokens=True)
            text = self.tokenizer.decode(prefix + new, skip_special_tokens=True)[len(before) :]
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object))])
            )
        return responses
