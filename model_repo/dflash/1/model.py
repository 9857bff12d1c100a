"""Triton Python model (decoupled): DFlash with in-flight batching over the built engines.

`execute` only admits: it parses each request into a `Sequence` and hands it to the serving thread. That thread
owns the scheduler: between steps it takes in new requests, runs one batched step for every active sequence,
sends each its verified tokens at once, and retires finished, stopped, failed and cancelled ones (slot freed).
One request's error is that request's alone. Each response carries the new token ids and the text they
complete (tokenizers' DecodeStream: never half a character).

Requests follow tensorrtllm_backend's `tensorrt_llm` model: one sequence per request with a leading batch
dimension of 1 ([1, N] input_ids, [1, 1] scalars), TensorRT-LLM's sampling conventions, and a stop request (the
`stop` input set, with the request id of the request to stop) that cancels a request in flight; the `ensemble`
front model cancels through it, since Triton does not pass a client's cancellation on to a model it calls.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from dflash_trt.runtime.detokenize import TextStream
from dflash_trt.runtime.loop import Sequence, StopCriteria
from dflash_trt.runtime.repository import load_engine
from dflash_trt.runtime.sampling import RequestError, SamplingParams, request_text
from dflash_trt.runtime.scheduler import LOOKUP_LIMIT, PREFILL_CHUNK, AdaptiveVerify, Scheduler
from transformers import AutoTokenizer

IDLE_WAIT_SECONDS = 0.5  # how long the serving thread sleeps on an empty queue before looking again
STEP_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
QUEUE_BUCKETS = [0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0]


def _parameter(params: dict[str, dict[str, str]], key: str, default: str) -> str:
    """A `parameters` entry of config.pbtxt (its string_value), or `default` where the config has none."""
    return params.get(key, {}).get("string_value", default)


def _prefill_chunk(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"prefill_chunk_tokens={value!r} in config.pbtxt: give the prompt tokens to prefill between two steps (e.g. "
            f"{PREFILL_CHUNK}), or set enable_chunked_context to false to prefill whole prompts"
        )
    return int(value)


def _lookup_drafts(value: str, block_size: int) -> int:
    if not value.isdigit() or int(value) >= block_size:
        raise ValueError(
            f"lookup_drafts={value!r} in config.pbtxt: give the most lookup drafts a step verifies, 0 to {block_size - 1} "
            f"on this engine (default {LOOKUP_LIMIT}; 0: none)"
        )
    return int(value)


def _scalar(request: object, name: str, default: object) -> object:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0].item()


def _batch_row(request: object, name: str) -> np.ndarray:
    """The one row of a [1, ...] input (a bare [...] is taken as that row); a missing input or batch > 1 is refused."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise RequestError(f"{name} is missing: a generation request needs input_ids and max_tokens")
    array = tensor.as_numpy()
    if array.ndim > 1 and array.shape[0] != 1:
        raise RequestError(
            f"{name} has batch size {array.shape[0]}: send one sequence per request (the server batches requests in flight)"
        )
    return array.reshape(-1)


@dataclass(frozen=True)
class Stop:
    """A stop request: cancel every request in flight whose request id is `request_id`."""

    request_id: str


@dataclass
class Client:
    """A request in flight: what it asked for, where its responses go, and how much of its output was sent."""

    request: object
    sender: object
    sequence: Sequence
    request_id: str
    streaming: bool
    text: TextStream
    outputs: frozenset[str]  # the output names the request asked for (all of them when it named none)
    arrived: float = field(default_factory=time.perf_counter)
    has_tokens: bool = False  # its first token was generated
    unsent_tokens: list[int] = field(default_factory=list)
    unsent_text: str = ""


class Metrics:
    """Counters, gauges and histograms on Triton's metrics port (label model="dflash")."""

    FAMILIES = {
        "draft": ("dflash_draft_tokens_total", "Draft tokens verified by the target (drafter and lookup)", "COUNTER"),
        "accepted": ("dflash_accepted_draft_tokens_total", "Draft tokens accepted by the target (drafter and lookup)", "COUNTER"),
        "steps": ("dflash_steps_total", "Batched draft-verify steps", "COUNTER"),
        "tokens": ("dflash_generated_tokens_total", "Tokens generated", "COUNTER"),
        "prompt": ("dflash_prompt_tokens_total", "Prompt tokens of finished requests", "COUNTER"),
        "reused": ("dflash_reused_prompt_tokens_total", "Prompt tokens whose rows were reused, not prefilled", "COUNTER"),
        # The three gauges of the Gateway API Inference Extension's model-server protocol (queued, running, KV
        # usage), which autoscalers and gateways read: Triton's own queue metrics stop at execute()'s hand-off.
        "running": ("dflash_running_requests", "Requests holding a slot (generating, or prefilling in chunks)", "GAUGE"),
        "waiting": ("dflash_waiting_requests", "Requests received and waiting for a slot", "GAUGE"),
        "slot_usage": ("dflash_slot_usage_ratio", "Fraction of state-pool (KV) slots in use, 0 to 1", "GAUGE"),
        "free_slots": ("dflash_free_slots", "Free state-pool slots", "GAUGE"),
        "verify_width": ("dflash_verify_width", "Tokens per row the last step verified (1 + drafts)", "GAUGE"),
        "batch": ("dflash_batch_size", "Rows per batched step", "HISTOGRAM"),
        "step_seconds": ("dflash_step_seconds", "Seconds per batched step (graph call)", "HISTOGRAM"),
        "queue_seconds": ("dflash_queue_seconds", "Seconds from arrival to the first token", "HISTOGRAM"),
    }
    BUCKETS = {"batch": [1, 2, 4, 8, 16, 32, 64, 128], "step_seconds": STEP_BUCKETS, "queue_seconds": QUEUE_BUCKETS}

    def __init__(self) -> None:
        labels = {"model": "dflash"}
        kinds = {"COUNTER": pb_utils.MetricFamily.COUNTER, "GAUGE": pb_utils.MetricFamily.GAUGE}
        kinds["HISTOGRAM"] = pb_utils.MetricFamily.HISTOGRAM
        # The families must outlive their metrics: keep both.
        self.families = {
            key: pb_utils.MetricFamily(name=name, description=text, kind=kinds[kind])
            for key, (name, text, kind) in self.FAMILIES.items()
        }
        self.metrics = {
            key: family.Metric(labels=labels, buckets=self.BUCKETS[key]) if key in self.BUCKETS else family.Metric(labels=labels)
            for key, family in self.families.items()
        }

    def add(self, key: str, value: float) -> None:
        self.metrics[key].increment(value)

    def set(self, key: str, value: float) -> None:
        self.metrics[key].set(value)

    def observe(self, key: str, value: float) -> None:
        self.metrics[key].observe(value)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        params = json.loads(args["model_config"])["parameters"]
        version_dir = Path(args["model_repository"]) / args["model_version"]
        root = Path(args["model_repository"]).parent
        reuse = _parameter(params, "enable_kv_cache_reuse", "true").lower() == "true"
        chunked = _parameter(params, "enable_chunked_context", "true").lower() == "true"
        chunk = _prefill_chunk(_parameter(params, "prefill_chunk_tokens", str(PREFILL_CHUNK))) if chunked else 0
        self.engine, self.manifest = load_engine(version_dir / params["engine_dir"]["string_value"], reuse_prefixes=reuse)
        self.tokenizer = AutoTokenizer.from_pretrained(root / params["tokenizer_dir"]["string_value"])
        self.eos_ids = tuple(self.manifest["eos_token_ids"])
        lookup = _lookup_drafts(_parameter(params, "lookup_drafts", str(LOOKUP_LIMIT)), self.engine.block_size)
        self.scheduler = Scheduler(self.engine, AdaptiveVerify.calibrated(self.engine, lookup), prefill_chunk=chunk)
        self.metrics = Metrics()
        self.inbox: queue.Queue[Client | Stop] = queue.Queue()  # in arrival order: a stop never overtakes its request
        self.clients: dict[int, Client] = {}  # id(sequence) -> client
        self._record_state()
        self.running = True
        self.thread = threading.Thread(target=self._serve, name="dflash-scheduler", daemon=True)
        self.thread.start()

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                if _scalar(request, "stop", False):
                    self.inbox.put(self._stop_request(request))
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    continue
                self.inbox.put(self._client(request, sender))
            except RequestError as error:
                self._fail(sender, str(error))
            except Exception as error:  # a malformed request must not take the model down
                self._internal_error(sender, error)
        return None

    def finalize(self) -> None:
        self.running = False
        self.thread.join(timeout=10)

    # --- admission ---------------------------------------------------------------------------------------------

    def _stop_request(self, request: object) -> Stop:
        request_id = request.request_id()  # type: ignore[attr-defined]
        if not request_id:
            raise RequestError("a stop request needs the id of the request to stop: set its request_id")
        return Stop(request_id)

    def _client(self, request: object, sender: object) -> Client:
        prompt = _batch_row(request, "input_ids").tolist()
        max_tokens = int(_batch_row(request, "max_tokens")[0])
        sequence = Sequence(prompt, max_tokens, self._sampling(request), self._stop_criteria(request))
        streaming = bool(_scalar(request, "stream", False))
        outputs = frozenset(request.requested_output_names())  # type: ignore[attr-defined]
        return Client(request, sender, sequence, request.request_id(), streaming, TextStream(self.tokenizer), outputs)  # type: ignore[attr-defined]

    def _sampling(self, request: object) -> SamplingParams:
        seed = _scalar(request, "random_seed", None)
        return SamplingParams.from_request(
            temperature=_scalar(request, "temperature", None),  # type: ignore[arg-type]
            top_k=_scalar(request, "top_k", None),  # type: ignore[arg-type]
            top_p=_scalar(request, "top_p", None),  # type: ignore[arg-type]
            seed=None if seed is None else int(seed),  # type: ignore[call-overload]
        )

    def _stop_criteria(self, request: object) -> StopCriteria:
        end_id = _scalar(request, "end_id", None)
        words = pb_utils.get_input_tensor_by_name(request, "stop_words")
        stop_strings = (
            ()
            if words is None
            else tuple(request_text(w, f"stop_words[{i}]") for i, w in enumerate(words.as_numpy().reshape(-1)))
        )
        eos = self.eos_ids if end_id is None else (int(end_id),)  # type: ignore[call-overload]
        return StopCriteria(eos_token_ids=eos, stop_strings=tuple(s for s in stop_strings if s), decode=self.tokenizer.decode)

    # --- the serving thread ------------------------------------------------------------------------------------

    def _serve(self) -> None:
        while self.running:
            self._take_new(block=not self.scheduler.busy)
            self._drop_cancelled()
            if self.scheduler.busy:
                self._step()
            else:
                self._record_state()  # (idle: a cancel or a failure may have freed slots)

    def _step(self) -> None:
        try:
            began = time.perf_counter()
            emitted = self.scheduler.step()
            self._record_step(time.perf_counter() - began)
        except Exception as error:  # an engine failure fails the batch it hit, never the server
            self._fail_all(error)
            return
        finally:
            self._record_state()  # before any response: a client that sees its tokens sees the gauges they imply
        for sequence, tokens in emitted:
            client = self.clients.get(id(sequence))
            if client is None:
                continue
            try:
                self._deliver(client, tokens)
            except Exception as error:  # a response that cannot be sent ends that request alone
                pb_utils.Logger.log_error(f"dflash: could not send to a client: {error!r}; its request is dropped")
                self.scheduler.cancel(sequence)
                self.clients.pop(id(sequence), None)

    def _take_new(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=IDLE_WAIT_SECONDS) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, Stop):
                for client in [c for c in self.clients.values() if c.request_id == item.request_id]:
                    self._end_stopped(client)
            else:
                try:
                    self.scheduler.submit(item.sequence)
                    self.clients[id(item.sequence)] = item
                except RequestError as error:
                    self._fail(item.sender, str(error))
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _drop_cancelled(self) -> None:
        # Only open requests are asked (a client leaves `clients` before its final response, on this thread): asking
        # after the final response reads the backend's freed response factory.
        for client in list(self.clients.values()):
            if client.request.is_cancelled():  # type: ignore[attr-defined]
                self._cancel(client)

    def _cancel(self, client: Client) -> None:
        """The client cancelled or left: the sequence leaves now and the request ends with a CANCELLED error."""
        self.scheduler.cancel(client.sequence)
        self._finish(client)
        error = pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
        client.sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # type: ignore[attr-defined]

    def _end_stopped(self, client: Client) -> None:
        """A stop request named it: the sequence leaves now and the request ends with a final response carrying
        what was generated and not yet sent (as TensorRT-LLM answers a stopped request; a model calling through BLS
        also only ever sees a final response that is not an error)."""
        self.scheduler.cancel(client.sequence)
        self._finish(client)
        response = self._response(client, client.unsent_tokens, client.unsent_text)
        client.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # type: ignore[attr-defined]

    def _deliver(self, client: Client, new: list[int]) -> None:
        """Send what is ready: each step's tokens and text when streaming, everything at the end otherwise."""
        sequence = client.sequence
        if new and not client.has_tokens:
            self.metrics.observe("queue_seconds", time.perf_counter() - client.arrived)
            client.has_tokens = True
        client.unsent_tokens += new
        client.unsent_text += client.text.push(new)
        if not (sequence.finished or (client.streaming and client.unsent_tokens)):
            return
        response = self._response(client, client.unsent_tokens, client.unsent_text)
        client.unsent_tokens, client.unsent_text = [], ""
        if sequence.finished:
            self._finish(client)
            client.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # type: ignore[attr-defined]
        else:
            client.sender.send(response)  # type: ignore[attr-defined]

    def _finish(self, client: Client) -> None:
        self.clients.pop(id(client.sequence), None)
        stats = client.sequence.stats
        self.metrics.add("draft", stats.verified_drafts)  # the drafter's and lookup drafts
        self.metrics.add("accepted", stats.accepted_drafts)
        self.metrics.add("tokens", len(client.sequence.tokens))
        self.metrics.add("prompt", len(client.sequence.prompt))
        self.metrics.add("reused", stats.reused_prompt_tokens)

    def _record_state(self) -> None:
        pool = self.engine.pool
        self.metrics.set("running", len(self.scheduler.active))
        self.metrics.set("waiting", len(self.scheduler.waiting) + self.inbox.qsize())
        self.metrics.set("slot_usage", 1.0 - pool.free_slots / pool.slots)
        self.metrics.set("free_slots", pool.free_slots)

    def _record_step(self, seconds: float) -> None:
        if self.scheduler.last_batch:
            self.metrics.add("steps", 1)
            self.metrics.set("verify_width", self.scheduler.last_width)
            self.metrics.observe("batch", self.scheduler.last_batch)
            self.metrics.observe("step_seconds", seconds)

    def _response(self, client: Client, new: list[int], text: str) -> object:
        """A response holding only the outputs the request asked for. Triton's Python backend (r24.10, the one
        nvidia-pytriton bundles) drops unrequested outputs in `send` with the GIL released, and freeing their numpy
        arrays there corrupted the stub's heap under load (fixed upstream in python_backend#390)."""
        stats, sequence = client.sequence.stats, client.sequence
        arrays = {  # each [1, ...]: the request's one batch row
            "output_ids": np.asarray([new], dtype=np.int64),
            "text_output": np.array([[text.encode("utf-8")]], dtype=object),
            "total_draft_tokens": np.asarray([[stats.verified_drafts]], dtype=np.int64),  # the drafter's and lookup's
            "total_accepted_draft_tokens": np.asarray([[stats.accepted_drafts]], dtype=np.int64),
            "acceptance_rate": np.asarray([[stats.accepted_drafts / max(stats.verified_drafts, 1)]], dtype=np.float32),
            "total_steps": np.asarray([[stats.steps]], dtype=np.int64),
            "total_output_tokens": np.asarray([[len(sequence.tokens)]], dtype=np.int64),
            "reused_prompt_tokens": np.asarray([[stats.reused_prompt_tokens]], dtype=np.int64),
        }
        tensors = [pb_utils.Tensor(name, array) for name, array in arrays.items() if name in client.outputs]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    # --- errors ------------------------------------------------------------------------------------------------

    def _fail(self, sender: object, message: str) -> None:
        error = pb_utils.TritonError(message)
        sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # type: ignore[attr-defined]

    def _internal_error(self, sender: object, error: Exception) -> None:
        pb_utils.Logger.log_error(f"dflash: internal error: {error!r}\n{traceback.format_exc()}")
        self._fail(sender, f"dflash: internal error: {error!r} (logged on the server)")

    def _fail_all(self, error: Exception) -> None:
        """The step failed: every sequence in it gets the error and leaves; the scheduler starts clean."""
        for client in list(self.clients.values()):
            self.scheduler.cancel(client.sequence)
            self._finish(client)
            self._internal_error(client.sender, error)
