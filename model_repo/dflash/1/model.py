"""Triton Python model (decoupled): the DFlash draft-verify loop over the built engines.

Requests are served one at a time (Triton queues the rest). Each step's accepted tokens go out as one
response as soon as they are verified; tokens that end inside a multi-byte character are held back so
that the postprocessing model never emits half a character.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from dflash_trt.runtime.loop import GenerationStats, StopCriteria, stream_dflash
from dflash_trt.runtime.repository import load_engine
from dflash_trt.runtime.sampling import RequestError, SamplingParams
from transformers import AutoTokenizer

PREFIX_CONTEXT = 4  # tokens of already-sent text the detokenizer sees again, for tokenizers with context-dependent spacing


def _scalar(request: object, name: str, default: object) -> object:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0].item()


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        params = json.loads(args["model_config"])["parameters"]
        version_dir = Path(args["model_repository"]) / args["model_version"]
        root = Path(args["model_repository"]).parent
        self.engine, self.manifest = load_engine(version_dir / params["engine_dir"]["string_value"])
        self.tokenizer = AutoTokenizer.from_pretrained(root / params["tokenizer_dir"]["string_value"])
        self.eos_ids = tuple(self.manifest["eos_token_ids"])
        labels = {"model": "dflash"}
        families = {
            "draft": ("dflash_draft_tokens_total", "Draft tokens proposed"),
            "accepted": ("dflash_accepted_draft_tokens_total", "Draft tokens accepted by the target"),
            "steps": ("dflash_steps_total", "Draft-verify steps"),
            "tokens": ("dflash_generated_tokens_total", "Tokens generated"),
        }
        # The families must outlive their metrics: keep both.
        self.metric_families = {
            key: pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.COUNTER)
            for key, (name, text) in families.items()
        }
        self.counters = {key: family.Metric(labels=labels) for key, family in self.metric_families.items()}

    def _sampling(self, request: object) -> SamplingParams:
        seed = _scalar(request, "seed", None)
        return SamplingParams(
            temperature=float(_scalar(request, "temperature", 0.0)),  # type: ignore[arg-type]
            top_k=int(_scalar(request, "top_k", 0)),  # type: ignore[call-overload]
            top_p=float(_scalar(request, "top_p", 1.0)),  # type: ignore[arg-type]
            seed=None if seed is None else int(seed),  # type: ignore[call-overload]
        )

    def _stop(self, request: object) -> StopCriteria:
        end_id = _scalar(request, "end_id", None)
        words = pb_utils.get_input_tensor_by_name(request, "stop_words")
        stop_strings = (
            ()
            if words is None
            else tuple(w.decode("utf-8") if isinstance(w, bytes) else str(w) for w in words.as_numpy().reshape(-1))
        )
        eos = self.eos_ids if end_id is None else (int(end_id),)  # type: ignore[call-overload]
        return StopCriteria(eos_token_ids=eos, stop_strings=tuple(s for s in stop_strings if s), decode=self.tokenizer.decode)

    def _response(self, new: list[int], prefix: list[int], stats: GenerationStats, produced: int) -> object:
        tensors = [
            pb_utils.Tensor("output_ids", np.asarray(new, dtype=np.int64)),
            pb_utils.Tensor("prefix_ids", np.asarray(prefix, dtype=np.int64)),
            pb_utils.Tensor("total_draft_tokens", np.asarray([stats.draft_tokens], dtype=np.int64)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.asarray([stats.accepted_draft_tokens], dtype=np.int64)),
            pb_utils.Tensor("acceptance_rate", np.asarray([stats.acceptance_rate], dtype=np.float32)),
            pb_utils.Tensor("total_steps", np.asarray([stats.steps], dtype=np.int64)),
            pb_utils.Tensor("total_output_tokens", np.asarray([produced], dtype=np.int64)),
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _serve(self, request: object) -> None:
        sender = request.get_response_sender()  # type: ignore[attr-defined]
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            prompt = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1).tolist()
            max_tokens = int(_scalar(request, "max_tokens", 0))  # type: ignore[call-overload]
            streaming = bool(_scalar(request, "stream", False))
            stats = GenerationStats(self.engine.block_size)
            pieces = stream_dflash(self.engine, prompt, max_tokens, self._sampling(request), self._stop(request), stats)
            tokens: list[int] = []
            sent = 0
            for piece in pieces:
                tokens.extend(piece)
                if request.is_cancelled():  # type: ignore[attr-defined]
                    break
                if streaming and not self.tokenizer.decode(tokens[sent:]).endswith("\ufffd"):
                    sender.send(self._response(tokens[sent:], tokens[max(0, sent - PREFIX_CONTEXT) : sent], stats, len(tokens)))
                    sent = len(tokens)
            self._count(stats, len(tokens))
            if streaming:
                sender.send(
                    self._response(tokens[sent:], tokens[max(0, sent - PREFIX_CONTEXT) : sent], stats, len(tokens)), flags=final
                )
            else:
                sender.send(self._response(tokens, [], stats, len(tokens)), flags=final)
        except RequestError as error:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))), flags=final)
        except Exception as error:  # never crash the server or lose the request: report it to this client
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"dflash: internal error: {error!r}")), flags=final)

    def _count(self, stats: GenerationStats, tokens: int) -> None:
        self.counters["draft"].increment(stats.draft_tokens)
        self.counters["accepted"].increment(stats.accepted_draft_tokens)
        self.counters["steps"].increment(stats.steps)
        self.counters["tokens"].increment(tokens)

    def execute(self, requests: list) -> None:
        for request in requests:
            self._serve(request)
        return None
