"""STAND-IN for TensorRT-LLM's llmapi `tensorrt_llm` model, for tests only (TensorRT-LLM cannot run here).

It has llmapi's inputs and outputs (config.pbtxt) and makes up its answer from what it received, so a test can see
what our ensemble sent: a header naming each sampling input it got ("[top_k=1 max_tokens=8]"), then the prompt's
words in reverse, one word per step, cut at max_tokens pieces. It answers the way llmapi's model.py does (read,
not copied): a streamed response holds the whole text so far (RequestOutput.text), the prompt comes first unless
sampling_param_exclude_input_from_output is true (its default is false), the draft counters (15 drafts and 2
accepted per piece) come only with sampling_param_return_perf_metrics, and a stop request (by request id) ends
that request's stream, its own answer a CANCELLED error. Streamed pieces go out from a thread, PIECE_SECONDS apart;
where $STANDIN_LLMAPI_LOG names a file, each stop ("stop ID") and each stream cut short ("cut ID N") is appended.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

SAMPLING = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop")  # sampling_param_<name>, in header order
DRAFTS_PER_PIECE, ACCEPTED_PER_PIECE = 15, 2
PIECE_SECONDS = 0.02


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


def _flag(request: object, name: str) -> bool:
    array = _value(request, name)
    return array is not None and bool(array.reshape(-1)[0])


def _response(text: str, count: int, counters: bool) -> object:
    tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
    if counters:
        tensors += [
            pb_utils.Tensor("total_draft_tokens", np.array([DRAFTS_PER_PIECE * count], dtype=np.int32)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.array([ACCEPTED_PER_PIECE * count], dtype=np.int32)),
            pb_utils.Tensor("acceptance_rate", np.array([ACCEPTED_PER_PIECE / DRAFTS_PER_PIECE], dtype=np.float32)),
        ]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _log(line: str) -> None:
    path = os.environ.get("STANDIN_LLMAPI_LOG")
    if path:
        with open(path, "a") as log:
            log.write(line + "\n")


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.stopped: set[str] = set()
        self.lock = threading.Lock()

    def execute(self, requests: list) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            if _flag(request, "stop"):
                with self.lock:
                    self.stopped.add(request.request_id())
                _log(f"stop {request.request_id()}")
                cancelled = pb_utils.TritonError("Request cancelled by client", pb_utils.TritonError.CANCELLED)
                sender.send(pb_utils.InferenceResponse(error=cancelled), flags=final)
                continue
            header, limit = _header(request)
            prompt = _text(_value(request, "text_input"))
            pieces = [" " + word for word in [header, *reversed(prompt.split())]][:limit]
            start = "" if _flag(request, "sampling_param_exclude_input_from_output") else prompt
            counters = _flag(request, "sampling_param_return_perf_metrics")
            if _flag(request, "streaming"):
                answer = (request.request_id(), sender, start, pieces, counters)
                threading.Thread(target=self._stream, args=answer, daemon=True).start()
            else:
                sender.send(_response(start + "".join(pieces), len(pieces), counters), flags=final)
        return None

    def _stream(self, key: str, sender: object, start: str, pieces: list[str], counters: bool) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for count in range(1, len(pieces) + 1):
            with self.lock:
                stopped = key in self.stopped
            if stopped:
                _log(f"cut {key} {count - 1}")
                return
            flags = final if count == len(pieces) else 0
            sender.send(_response(start + "".join(pieces[:count]), count, counters), flags=flags)
            time.sleep(PIECE_SECONDS)
