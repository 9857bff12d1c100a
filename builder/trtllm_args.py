"""A typed mirror of the TensorRT-LLM LLM arguments `dflash-build --backend trtllm` writes, pinned to one release.

TensorRT-LLM cannot be installed here (its `llm_args` module imports its C++/CUDA bindings), and its fields drift
between releases (DFlashDecodingConfig gained moe_backend, spec_dec_variant, context_recompute_tail and
skip_ctx_buffer_budget_check between 1.3.0rc27 and 1.4.0rc1). So the fields we emit are mirrored here, as the
pinned release documents them, refusing unknown keys and bad values the way its pydantic models do:

- LLM / TorchLlmArgs: https://nvidia.github.io/TensorRT-LLM/1.4.0rc1/llm-api/reference/LLM.html
- DFlashDecodingConfig: https://nvidia.github.io/TensorRT-LLM/1.4.0rc1/llm-api/reference/DFlashDecodingConfig.html
- the llmapi Triton model's `triton_config` (model.yaml in triton_backend/all_models/llmapi/tensorrt_llm/1/)

`trtllm_api/tensorrt_llm-<release>.json` keeps the names the release publishes, with sources; the tests check every
emitted key against it. Moving to another release means re-reading those pages and changing both.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

TRTLLM_RELEASE = "1.4.0rc1"
TRTLLM_CONTAINER = "nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3"  # the Triton release that bundles it


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KvCacheConfig(Strict):
    free_gpu_memory_fraction: float = Field(gt=0.0, le=1.0)  # of the memory free after the weights load


class DFlashDecodingConfig(Strict):
    """The DFlash fields we set; mask_token_id and target_layer_ids are left to the drafter's own config.json."""

    decoding_type: Literal["DFlash"]
    max_draft_len: int = Field(ge=1)  # drafts per step: block size - 1
    speculative_model: str = Field(min_length=1)  # the drafter: a hub id or a path inside the container


class LlmArgs(Strict):
    """LLM(**args): the trtllm-serve --config file and Dynamo's --extra-engine-args."""

    model: str = Field(min_length=1)
    backend: Literal["pytorch"]
    tensor_parallel_size: int = Field(ge=1)
    pipeline_parallel_size: int = Field(ge=1)
    moe_expert_parallel_size: int | None = Field(default=None, ge=1)
    max_batch_size: int = Field(ge=1)
    max_seq_len: int = Field(ge=1)
    max_num_tokens: int = Field(ge=1)
    kv_cache_config: KvCacheConfig
    speculative_config: DFlashDecodingConfig

    @model_validator(mode="after")
    def _experts_divide_tensor_parallel(self) -> LlmArgs:
        ep = self.moe_expert_parallel_size
        if ep is not None and self.tensor_parallel_size % ep:
            raise ValueError(f"moe_expert_parallel_size {ep} must divide tensor_parallel_size {self.tensor_parallel_size}")
        return self


class TritonConfig(Strict):
    max_batch_size: int = Field(ge=0)  # 0: the llmapi model takes one request per call (its template's value)
    decoupled: bool


class LlmapiModelYaml(LlmArgs):
    """The llmapi Triton model's model.yaml: the LLM arguments plus `triton_config` (removed before LLM(**args))."""

    triton_config: TritonConfig


def validated(model: type[Strict], values: dict[str, Any], what: str) -> dict[str, Any]:
    """`values` checked against the mirror, as plain data (unset optional fields left out); a clear error otherwise."""
    try:
        return model.model_validate(values).model_dump(exclude_none=True)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}" for e in error.errors())
        raise ValueError(f"{what} is not valid for TensorRT-LLM {TRTLLM_RELEASE}: {problems}") from None
