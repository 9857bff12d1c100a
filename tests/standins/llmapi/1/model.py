"""STAND-IN for TensorRT-LLM's llmapi `tensorrt_llm` model, for tests only (TensorRT-LLM cannot run here).

It has llmapi's inputs and outputs (config.pbtxt) and makes up its answer from what it received, so a test can see
what our ensemble sent: a header naming each sampling input it got ("[top_k=1 max_tokens=8]"), then the prompt's
words in reverse, one word per streamed response, cut at max_tokens pieces. Each response carries the draft
counters llmapi reports (INT32): 15 drafts and 2 accepted per piece.
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

SAMPLING = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop")  # sampling_param_<name>, in header order
DRAFTS_PER_PIECE, ACCEPTED_PER_PIECE = 15, 2


def _value(request: object, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _text(array: np.ndarray) -> str:
    return "|".join(v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1))


def _header(request: object) -> tuple[str, int | None]:
    received = {}
    for name in SAMPLING:
        array = _value(request, f"sampling_param_{name}")
        if array is not None:
            received[name] = _text(array) if name == "stop" else array.reshape(-1)[0].item()
    parts = [f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}" for name, value in received.items()]
    limit = received.get("max_tokens")
    return "[" + " ".join(parts) + "]", int(limit) if limit is not None else None


def _response(piece: str, count: int) -> object:
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("text_output", np.array([piece.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("total_draft_tokens", np.array([DRAFTS_PER_PIECE * count], dtype=np.int32)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.array([ACCEPTED_PER_PIECE * count], dtype=np.int32)),
            pb_utils.Tensor("acceptance_rate", np.array([ACCEPTED_PER_PIECE / DRAFTS_PER_PIECE], dtype=np.float32)),
        ]
    )


class TritonPythonModel:
    def execute(self, requests: list) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            stop = _value(request, "stop")
            if stop is not None and bool(stop.reshape(-1)[0]):
                sender.send(flags=final)
                continue
            exclude = _value(request, "sampling_param_exclude_input_from_output")
            if exclude is None or not bool(exclude.reshape(-1)[0]):
                error = pb_utils.TritonError("stand-in: the ensemble must send sampling_param_exclude_input_from_output=true")
                sender.send(pb_utils.InferenceResponse(error=error), flags=final)
                continue
            header, limit = _header(request)
            prompt = _text(_value(request, "text_input"))
            pieces = [" " + word for word in [header, *reversed(prompt.split())]][:limit]
            streaming = _value(request, "streaming")
            if streaming is not None and bool(streaming.reshape(-1)[0]):
                for count, piece in enumerate(pieces, start=1):
                    sender.send(_response(piece, count))
                sender.send(flags=final)
            else:
                sender.send(_response("".join(pieces), len(pieces)), flags=final)
        return None
