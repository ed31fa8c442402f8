"""The architectures jdet runs, and where a new one goes.

One `Architecture` entry per Hugging Face `model_type`; everything that differs between the
architectures of the Llama family is a field here, read by the config mapping (jdet/config.py
`_from_dict` turns it into `ModelConfig` flags) and by the checkpoint writer (jdet/loader.py).
The model code never asks which architecture it runs: the weight table (jdet/params.py
`weight_specs`) and the layer forward (jdet/model.py `layer_forward`) select their variants by the
config flags (`qkv_bias`, `o_bias`, `qk_norm`), so a Llama-family model (same layer, other
biases / norms / RoPE) is one entry below. An architecture with another layer (e.g. Gemma's
post-norms) adds the flags it needs to ModelConfig, its weights to `weight_specs` under those
flags, its branch to `layer_forward`, and its entry here, as the mixtures of experts did
(`moe`: ModelConfig's expert fields, jdet/params.py `moe_specs`, jdet/moe.py).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How one `model_type` maps onto jdet's model (module docstring)."""

    hf_class: str  # transformers class: config.json "architectures", what jdet.save writes
    # q/k/v and o_proj biases: True/False, or None to read config.json's "attention_bias"
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE
    # sliding window read from config.json always (True) or only with "use_sliding_window"
    sliding_window: bool = False
    # mixture-of-experts layout of the checkpoint (jdet/params.py `moe_hf_names`): None for a
    # dense model, "qwen3_moe" (mlp.gate, mlp.experts.{e}.gate_proj/up_proj/down_proj) or
    # "mixtral" (block_sparse_moe.gate, block_sparse_moe.experts.{e}.w1/w3/w2)
    moe: str | None = None


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("LlamaForCausalLM"),
    "mistral": Architecture(
        "MistralForCausalLM", qkv_bias=False, o_bias=False, sliding_window=True
    ),
    "qwen2": Architecture("Qwen2ForCausalLM", qkv_bias=True, o_bias=False),
    "qwen3": Architecture("Qwen3ForCausalLM", qk_norm=True),
    "qwen3_moe": Architecture("Qwen3MoeForCausalLM", qk_norm=True, moe="qwen3_moe"),
    "mixtral": Architecture(
        "MixtralForCausalLM", qkv_bias=False, o_bias=False, sliding_window=True, moe="mixtral"
    ),
}
