"""A tiny random Qwen3 checkpoint (D=64, 2 layers, vocab 320) with a byte-level BPE tokenizer
and a chat template, written with transformers `save_pretrained` once per test session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

VOCAB = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Tell me about Richard Feynman, the physicist who loved bongo drums and safecracking.",
    "Deterministic inference means the same request gives the same bits, whatever the load.",
    "hello world, hello there, general kenobi. 0123456789 +-*/ = ; : ! ?",
]


def write_tiny_model(d: Path, *, with_chat_template: bool = True, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.add_special_tokens({"additional_special_tokens": specials[1:]})
    if with_chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(d))
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=0,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # larger than default init, so greedy outputs vary with the input
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.ndim > 1 else 1.0)
    model.to(torch.bfloat16).save_pretrained(str(d))
    assert json.loads((d / "config.json").read_text())["vocab_size"] == VOCAB
    return d


@pytest.fixture(scope="session")
def serving_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def serving_model(serving_model_dir: Path):
    import jdet

    return jdet.load(serving_model_dir, dtype="float32")
