"""Triton Python model: text_input -> input_ids with the target's tokenizer (and chat template)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from dflash_trt.runtime.prompts import encode_prompt
from transformers import AutoTokenizer


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        params = json.loads(args["model_config"])["parameters"]
        root = Path(args["model_repository"]).parent
        self.tokenizer = AutoTokenizer.from_pretrained(root / params["tokenizer_dir"]["string_value"])
        self.chat = params["apply_chat_template"]["string_value"] == "true"

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
            if not text:
                error = pb_utils.TritonError("text_input is empty: send at least one character of prompt")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            ids = encode_prompt(self.tokenizer, text, chat=self.chat)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int64))]))
        return responses
