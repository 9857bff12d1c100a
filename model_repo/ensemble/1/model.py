"""Triton Python model `ensemble`: tensorrtllm_backend's text interface in front of the token-level `dflash` model,
or (a --backend trtllm repository) of TensorRT-LLM's `llmapi` model, named `tensorrt_llm` (parameter `engine_model`).

`execute` checks each request, tokenizes its prompt (chat template per the build) and hands it to a thread that
runs it on `dflash` through BLS and forwards what comes back: each step's text when streaming, the whole text at
the end otherwise (with the prompt in front unless `exclude_input_in_output`, as tensorrtllm_backend does).
A watcher thread sees a client's cancellation or disconnect and sends `dflash` a stop request for that request's
id, which frees its slot before the next step: Triton does not pass cancellation on to models called from a model
or from a Triton ensemble, which is why this front is a model. The same code serves the decoupled configuration
(streaming) and the unary one (`configs/unary.pbtxt`: one response per request, so `infer` works).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from dflash_trt.runtime.prompts import encode_prompt
from dflash_trt.runtime.sampling import RequestError, SamplingParams, request_text, shown
from transformers import AutoTokenizer

WATCH_SECONDS = 0.01  # how often the watcher looks for cancelled requests
BLS_GRACE_SECONDS = 10.0  # how long a BLS call's responses are kept once it ended (see `HeldCalls`)
FORWARDED = ("max_tokens", "temperature", "top_k", "top_p", "random_seed", "end_id", "stop_words")
STATS = (
    "total_draft_tokens", "total_accepted_draft_tokens", "acceptance_rate", "total_steps", "total_output_tokens",
    "reused_prompt_tokens",  # of the prompt's tokens, those whose rows a slot held (prompt prefix reuse)
)  # fmt: skip
STAT_DTYPES = {name: np.float32 if name == "acceptance_rate" else np.int64 for name in STATS}  # as config.pbtxt says
NOT_REPORTED = -1  # a statistic the engine model does not report (llmapi: total_steps, total_output_tokens, reused_...)
# llmapi (TensorRT-LLM's Triton model): our input -> (its input, its dtype); its inputs are [1] (max_batch_size 0)
LLMAPI_INPUTS = {
    "max_tokens": ("sampling_param_max_tokens", np.int32),
    "random_seed": ("sampling_param_seed", np.uint64),
    "stop_words": ("sampling_param_stop", np.object_),
}  # temperature, top_k, top_p: see _llmapi_inputs
LLMAPI_STATS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
# tensorrtllm_backend inputs this model accepts only at their neutral value: input -> (allowed values, why not).
NEUTRAL: dict[str, tuple[tuple[object, ...], str]] = {
    "beam_width": ((1,), "beam search is not supported (DFlash verifies one sequence per request); use 1"),
    "num_return_sequences": ((1,), "send one request per sequence wanted (they are batched on the server)"),
    "repetition_penalty": ((1.0,), "penalties are not supported; use 1.0"),
    "presence_penalty": ((0.0,), "penalties are not supported; use 0.0"),
    "frequency_penalty": ((0.0,), "penalties are not supported; use 0.0"),
    "min_length": ((0, 1), "a minimum length is not supported; use 0 or 1"),
    "return_log_probs": ((False,), "log probabilities are not returned; use false"),
    "return_context_logits": ((False,), "logits are not returned; use false"),
    "return_generation_logits": ((False,), "logits are not returned; use false"),
    "num_draft_tokens": ((0,), "DFlash drafts inside the engine (block size fixed at build, verify length chosen by load)"),
    "use_draft_logits": ((False,), "DFlash drafts inside the engine; use false"),
    "lora_task_id": ((), "LoRA adapters are not supported"),
    "guided_decoding_guide_type": ((), "guided decoding is not supported"),
    "guided_decoding_guide": ((), "guided decoding is not supported"),
}
EMPTY_LISTS = {
    "bad_words": "bad words are not supported",
    "embedding_bias_words": "embedding bias is not supported",
    "embedding_bias_weights": "embedding bias is not supported",
}


def _input(request: object, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _scalar(request: object, name: str, default: object) -> object:
    array = _input(request, name)
    return default if array is None else array.reshape(-1)[0].item()


def _check_neutral(request: object) -> None:
    for name, (allowed, reason) in NEUTRAL.items():
        value = _scalar(request, name, None)
        if value is not None and value not in allowed:
            raise RequestError(f"{name}={shown(value)} is not supported: {reason}")
    for name, reason in EMPTY_LISTS.items():
        array = _input(request, name)
        if array is not None and any(v not in (b"", "") for v in array.reshape(-1)):
            raise RequestError(f"{name} is not supported: {reason}; leave it out")


def _prompt_text(request: object) -> str:
    array = _input(request, "text_input")
    assert array is not None  # a required input: Triton refuses a request without it
    if array.ndim > 1 and array.shape[0] != 1:
        raise RequestError(
            f"text_input has batch size {array.shape[0]}: send one prompt per request (the server batches requests in "
            "flight); tensorrtllm_backend's --batch-inputs is not supported"
        )
    value = array.reshape(-1)[0]
    text = request_text(value, "text_input")
    if not text:
        raise RequestError("text_input is empty: send at least one character of prompt")
    return text


def _internal_error(error: Exception) -> str:
    """Log an unexpected failure with its traceback on the server; the message for the request it ended."""
    pb_utils.Logger.log_error(f"ensemble: internal error: {error!r}\n{traceback.format_exc()}")
    return f"ensemble: internal error: {error!r} (logged on the server)"


def _refuse(sender: object, message: str) -> None:
    refusal = pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
    sender.send(refusal, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # type: ignore[attr-defined]


def _llmapi_inputs(request: object, text: str, streaming: bool) -> list:
    """The request in llmapi's names and dtypes ([1] each). Sampling is read as `dflash` reads it (TensorRT-LLM's
    conventions: neither top_k nor top_p set is greedy at any temperature, top_p 0 is off) and sent explicitly:
    greedy as top_k 1, otherwise only the limits that are on."""
    if _input(request, "end_id") is not None:
        raise RequestError(
            "end_id is not an input of TensorRT-LLM's llmapi model (the model's own end tokens end a turn); leave it out"
        )
    sampling = SamplingParams.from_request(
        _scalar(request, "temperature", None), _scalar(request, "top_k", None), _scalar(request, "top_p", None), None
    )
    values: dict[str, tuple[object, type]] = {
        "text_input": (text.encode("utf-8"), np.object_),
        "streaming": (streaming, np.bool_),
        "sampling_param_exclude_input_from_output": (True, np.bool_),  # the echo is added here
        "sampling_param_return_perf_metrics": (True, np.bool_),  # llmapi sends its draft counters only then
    }
    if sampling.greedy:
        values["sampling_param_top_k"] = (1, np.int32)
    else:
        values["sampling_param_temperature"] = (sampling.temperature, np.float32)
        if sampling.top_k > 0:
            values["sampling_param_top_k"] = (sampling.top_k, np.int32)
        if sampling.top_p < 1:
            values["sampling_param_top_p"] = (sampling.top_p, np.float32)
    inputs = [pb_utils.Tensor(name, np.array([value], dtype=dtype)) for name, (value, dtype) in values.items()]
    for name, (llmapi_name, dtype) in LLMAPI_INPUTS.items():
        array = _input(request, name)
        if array is not None:
            inputs.append(pb_utils.Tensor(llmapi_name, array.reshape(-1).astype(dtype)))
    return inputs


def _stat(response: object, name: str) -> np.ndarray:
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    return np.array([NOT_REPORTED]) if tensor is None else tensor.as_numpy()


@dataclass
class Job:
    """One client request on its way through `dflash`."""

    request: object
    sender: object
    key: str  # the request id of its `dflash` request, which a stop request names
    streaming: bool
    echo: str  # text sent before the completion (the prompt, in non-streaming mode unless excluded)
    outputs: frozenset[str]  # the output names the client asked for (all of them when it named none)
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: bool = False


class HeldCalls:
    """BLS response iterators kept alive for a while, then dropped by the watcher thread (which holds the GIL).

    Triton's Python backend r24.10 (the one nvidia-pytriton bundles) also keeps each BLS call's iterator, and drops
    it on a thread of its own without the GIL once the call ended; when it drops the last reference, the numpy arrays
    of the call's responses are freed there, which corrupted the stub's heap under load (python_backend#390 fixed
    it upstream). Held here until well after that, the iterator is freed by Python, with the GIL.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.held: deque[tuple[float, object]] = deque()  # (when it may go, iterator), in that order
        self.lock = threading.Lock()

    def hold(self, iterator: object) -> None:
        with self.lock:
            self.held.append((time.monotonic() + self.seconds, iterator))

    def release_due(self) -> None:
        due = []
        with self.lock:
            while self.held and self.held[0][0] <= time.monotonic():
                due.append(self.held.popleft())
        del due  # freed here, outside the lock


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = config["parameters"]
        root = Path(args["model_repository"]).parent
        self.engine = params.get("engine_model", {}).get("string_value") or "dflash"
        if self.engine == "dflash":
            self.tokenizer = AutoTokenizer.from_pretrained(root / params["tokenizer_dir"]["string_value"])
        self.chat = params["apply_chat_template"]["string_value"] == "true"
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.ids = (f"ensemble-{os.getpid()}-{n}" for n in itertools.count())
        self.jobs: dict[str, Job] = {}
        self.jobs_lock = threading.Lock()
        self.finished_calls = HeldCalls(BLS_GRACE_SECONDS)
        self.running = True
        self.watcher = threading.Thread(target=self._watch, name="ensemble-cancel-watcher", daemon=True)
        self.watcher.start()

    def execute(self, requests: list) -> None:
        """Decoupled: start each request's thread and return. Unary: the same, then wait for this batch's threads
        (a unary answer sent after `execute` returned was once never delivered; Triton's dynamic batcher groups the
        requests that arrive meanwhile into the next call)."""
        threads = []
        for request in requests:
            sender = request.get_response_sender()
            try:
                job, call = self._job(request, sender)
            except RequestError as error:
                _refuse(sender, str(error))
                continue
            except Exception as error:  # one malformed request fails alone, never the others of this call
                _refuse(sender, _internal_error(error))
                continue
            with self.jobs_lock:
                self.jobs[job.key] = job
            threads.append(threading.Thread(target=self._run, args=(job, call), name=job.key, daemon=True))
            threads[-1].start()
        if not self.decoupled:
            for thread in threads:
                thread.join()
        return None

    def finalize(self) -> None:
        self.running = False
        self.watcher.join(timeout=5)

    # --- admission ---------------------------------------------------------------------------------------------

    def _job(self, request: object, sender: object) -> tuple[Job, object]:
        _check_neutral(request)
        streaming = bool(_scalar(request, "stream", False))
        if streaming and not self.decoupled:
            raise RequestError(
                "stream=true needs the decoupled ensemble: this server runs the unary configuration "
                "(dflash-serve --unary); send stream=false, or serve without --unary to stream"
            )
        text = _prompt_text(request)
        echo = "" if streaming or _scalar(request, "exclude_input_in_output", False) else text
        outputs = frozenset(request.requested_output_names())  # type: ignore[attr-defined]
        job = Job(request, sender, next(self.ids), streaming, echo, outputs)
        if self.engine == "dflash":
            inputs, wanted = self._dflash_inputs(request, text, streaming), ["text_output", *STATS]
        else:
            inputs, wanted = _llmapi_inputs(request, text, streaming), ["text_output", *LLMAPI_STATS]
        call = pb_utils.InferenceRequest(model_name=self.engine, inputs=inputs, requested_output_names=wanted, request_id=job.key)
        return job, call

    def _dflash_inputs(self, request: object, text: str, streaming: bool) -> list:
        ids = encode_prompt(self.tokenizer, text, chat=self.chat)
        inputs = [pb_utils.Tensor("input_ids", np.asarray([ids], dtype=np.int64))]
        inputs.append(pb_utils.Tensor("stream", np.array([[streaming]])))  # not streaming: one response at the end
        for name in FORWARDED:
            array = _input(request, name)
            if array is not None:
                inputs.append(pb_utils.Tensor(name, array.reshape(1, -1)))
        return inputs

    # --- one request's thread ----------------------------------------------------------------------------------

    def _run(self, job: Job, call: object) -> None:
        pieces: list[str] = [job.echo]
        stats: list[object] = []
        so_far = ""  # llmapi: each streamed response holds the whole text so far (RequestOutput's `text`)
        responses = None
        try:
            if job.finished:  # cancelled before its request went out: nothing to run
                return
            responses = call.exec(decoupled=True)  # type: ignore[attr-defined]
            for response in responses:
                if response.has_error():
                    self._end(job, pb_utils.InferenceResponse(error=response.error()))
                    return
                text = pb_utils.get_output_tensor_by_name(response, "text_output")
                if text is None:  # an empty final response
                    continue
                piece = b"".join(text.as_numpy().reshape(-1)).decode("utf-8")
                if self.engine != "dflash":  # only what is new, as TensorRT-LLM's own text_diff does
                    piece, so_far = piece[len(so_far) :], piece
                stats = [_stat(response, name) for name in STATS]
                if job.streaming:
                    self._send(job, self._response(job, piece, stats))
                else:
                    pieces.append(piece)
            if job.streaming:
                self._end(job, None)
            else:
                self._end(job, self._response(job, "".join(pieces), stats))
        except Exception as error:  # this request ends with the error; the model and other requests go on
            self._end(job, pb_utils.InferenceResponse(error=pb_utils.TritonError(_internal_error(error))))
        finally:
            with self.jobs_lock:
                self.jobs.pop(job.key, None)
            if responses is not None:
                self.finished_calls.hold(responses)

    def _response(self, job: Job, text: str, stats: list[object]) -> object:
        """Only the outputs the client asked for: see `dflash`'s model (the backend frees the others without the GIL)."""
        arrays = {"text_output": np.array([text.encode("utf-8")], dtype=object)}  # [1], as tensorrtllm_backend
        arrays |= {name: np.asarray(value, STAT_DTYPES[name]).reshape(1, 1) for name, value in zip(STATS, stats, strict=True)}
        tensors = [pb_utils.Tensor(name, array) for name, array in arrays.items() if name in job.outputs]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _send(self, job: Job, response: object) -> None:
        with job.lock:
            if not job.finished:
                job.sender.send(response)  # type: ignore[attr-defined]

    def _end(self, job: Job, response: object | None) -> None:
        """The request's last response (or only the final flag); a request already ended (cancelled) gets nothing."""
        with job.lock:
            if job.finished:
                return
            job.finished = True
            final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            if response is None:
                job.sender.send(flags=final)  # type: ignore[attr-defined]
            else:
                job.sender.send(response, flags=final)  # type: ignore[attr-defined]

    # --- cancellation ------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while self.running:
            with self.jobs_lock:
                jobs = list(self.jobs.values())
            for job in jobs:
                if self._cancelled(job):
                    self._stop(job.key)
                    error = pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
                    self._end(job, pb_utils.InferenceResponse(error=error))
            self.finished_calls.release_due()
            time.sleep(WATCH_SECONDS)

    def _cancelled(self, job: Job) -> bool:
        """Whether the client cancelled `job`, asked only while its request is open: the backend frees a request's
        response factory with its final response, and asking after that reads freed memory (tritonserver died with
        SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled when this check raced the job's final response)."""
        with job.lock:  # `_end` sends the final response under the same lock
            return not job.finished and bool(job.request.is_cancelled())  # type: ignore[attr-defined]

    def _stop(self, key: str) -> None:
        """Ask the engine model to cancel the request with id `key` (`dflash` frees its slot before its next step)."""
        if self.engine == "dflash":
            inputs, wanted = [pb_utils.Tensor("stop", np.array([[True]]))], ["output_ids"]
        else:  # llmapi: text_input is required even in a stop request
            inputs = [pb_utils.Tensor("text_input", np.array([b""], dtype=np.object_)), pb_utils.Tensor("stop", np.array([True]))]
            wanted = ["text_output"]
        stop = pb_utils.InferenceRequest(model_name=self.engine, inputs=inputs, requested_output_names=wanted, request_id=key)
        responses = stop.exec(decoupled=True)
        stopped = pb_utils.TritonError.CANCELLED if self.engine != "dflash" else None  # llmapi's answer when it stopped
        for response in responses:
            if response.has_error() and response.error().code() != stopped:
                pb_utils.Logger.log_warn(f"ensemble: stopping {key} on {self.engine} failed: {response.error().message()}")
        self.finished_calls.hold(responses)
