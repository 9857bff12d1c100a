"""`dflash-build --draft-vocab N`: the drafter proposes only token ids below N (FR-Spec's and EAGLE-3's smaller draft
vocabularies). Its use of the LM head is cut to the head's first N rows, so each drafted token costs a product with
N rows instead of the whole vocabulary; the target's head is untouched and verifies every token, so outputs do not
change, only which tokens can be drafted. Byte-level BPE tokenizers number their tokens roughly by frequency (merge
order), so the first N ids are the common ones (SmolLM2: ids below 16,384 are 95% of HumanEval's solution tokens).

A graph pass on the exported float graphs, before quantization (which then gives the cut head its LM-head bits)."""

from __future__ import annotations

import onnx_ir as ir
from dflash_trt.builder.quantize import in_target_scope, reads_lm_head

DRAFTING_GRAPHS = ("prefill", "step")  # the graphs that draft a block (GRAPH_NAMES' others only verify or decode)


def check_draft_vocab(draft_vocab: int, vocab_size: int) -> None:
    """`--draft-vocab N` of dflash-build and dflash-train: 0 (all) or in [1, vocab_size]; else a ValueError naming
    the range."""
    if not 0 <= draft_vocab <= vocab_size:
        raise ValueError(
            f"--draft-vocab {draft_vocab} must be in [1, {vocab_size}] (the target's vocabulary), or 0 for all of it"
        )


def cut_draft_head(model: ir.Model, keep: int, graph: str) -> None:
    """In place: the drafter's LM-head MatMuls (outside the target's scope, their weight the head [E, V]) read a new
    weight, the first `keep` columns [E, keep], so their argmax is a token id below `keep`."""
    heads = [
        node
        for node in model.graph
        if node.op_type == "MatMul"
        and reads_lm_head(node.metadata_props.get("pkg.torch.onnx.fx_node", ""))
        and not in_target_scope(node.metadata_props.get("pkg.torch.onnx.name_scopes", ""))
    ]
    if not heads:
        raise ValueError(f"--draft-vocab: no drafter LM head found in the {graph} graph")
    for node in heads:
        weight = node.inputs[1]
        if weight is None or weight.const_value is None:
            raise ValueError(f"--draft-vocab: the drafter LM head {node.name} has no constant weight")
        cut = ir.Value(name=f"{weight.name}_first_{keep}", const_value=ir.tensor(weight.const_value.numpy()[:, :keep]))
        model.graph.register_initializer(cut)
        node.replace_input_with(1, cut)
        _forget_vocab_shapes(node.outputs[0])


def _forget_vocab_shapes(logits: ir.Value) -> None:
    """Drop the recorded shapes of the logits and what is computed from them up to their argmax (their last axis was
    the whole vocabulary; ONNX Runtime infers the cut one)."""
    pending = [logits]
    while pending:
        value = pending.pop()
        value.shape = None
        pending.extend(out for node, _ in value.uses() if node.op_type != "ArgMax" for out in node.outputs)
