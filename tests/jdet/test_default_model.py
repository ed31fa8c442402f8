"""The embedded default model (jdet/default_model/): a trained Qwen3-architecture checkpoint that
transformers loads, that is far better than chance on held-out text, that writes readable text, and
whose export path (examples/train_tiny.py) is exactly the architecture transformers runs."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "jdet" / "default_model"
LN_V = math.log(8192)
# The recorded held-out loss must sit well under the uniform baseline ln V = 9.01 nats.
HELDOUT_BOUND = 0.6 * LN_V
# A 93-document sample (~7k tokens) lands near the full-split figure (measured: sample 3.58 vs
# split 3.54; quarter-samples range 3.34-3.74); a broken export or tokenizer is off by nats.
SAMPLE_SLACK = 0.5


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def training_log():
    return json.loads((MODEL_DIR / "training_log.json").read_text())


def _train_tiny():
    """examples/train_tiny.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "examples" / "train_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_checkpoint_is_bf16_qwen3_with_hf_names_under_size_budget():
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (MODEL_DIR / f).is_file(), f
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 16 * 2**20
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True
    from safetensors import safe_open

    d, e = cfg["hidden_size"], cfg["head_dim"]
    with safe_open(MODEL_DIR / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names  # tied
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [cfg["vocab_size"], d]
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        assert q.dtype == torch.bfloat16
        assert list(q.shape) == [cfg["num_attention_heads"] * e, d]  # torch [out, in]
        assert f.get_slice("model.layers.0.self_attn.k_norm.weight").get_shape() == [e]
    per_layer = 11  # 7 projections + 4 norms
    assert len(names) == 2 + per_layer * cfg["num_hidden_layers"]


def test_transformers_loads_model_and_tokenizer_with_chat_template(hf_model, tokenizer):
    assert hf_model.config.model_type == "qwen3"
    n_params = sum(p.numel() for p in hf_model.parameters())
    assert 5_000_000 < n_params < 30_000_000
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == 0 and len(tokenizer) == 8192
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What does len(obj) do?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat == "<|im_start|>user\nWhat does len(obj) do?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(chat, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2


def test_recorded_heldout_loss_is_far_below_uniform(training_log):
    best = training_log["best"]["heldout_loss"]
    assert best < HELDOUT_BOUND, (best, HELDOUT_BOUND)
    assert training_log["params"] == sum(
        np.prod(s) for s in _shapes_from_config(json.loads((MODEL_DIR / "config.json").read_text()))
    )


def _shapes_from_config(cfg: dict) -> list[tuple[int, ...]]:
    d, f, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    h, k, n = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    layer = [(d, h * e), (d, k * e), (d, k * e), (h * e, d), (d, f), (d, f), (f, d)]
    layer += [(d,), (d,), (e,), (e,)]
    return [(cfg["vocab_size"], d), (d,)] + layer * n


def test_transformers_heldout_loss_agrees_with_training_log(hf_model, tokenizer, training_log):
    """Score the committed held-out sample (documents never trained on) with transformers."""
    docs = json.loads((MODEL_DIR / "heldout_sample.json").read_text())["documents"]
    # The training stream: <|endoftext|> before every document, cut into 512-token windows.
    stream = []
    for d in docs:
        stream += [tokenizer.eos_token_id] + tokenizer(d, add_special_tokens=False).input_ids
    n = (len(stream) - 1) // 512
    ids = torch.tensor([stream[i * 512 : i * 512 + 513] for i in range(n)])
    with torch.no_grad():
        logits = hf_model(ids[:, :-1]).logits.float()
    nll = -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])
    sample_loss = float(nll.mean())
    recorded = training_log["best"]["heldout_loss"]
    assert sample_loss < HELDOUT_BOUND
    assert abs(sample_loss - recorded) < SAMPLE_SLACK, (sample_loss, recorded)


def test_greedy_generation_decodes_to_printable_words(hf_model, tokenizer):
    ids = tokenizer("Return a list of", return_tensors="pt").input_ids
    with torch.no_grad():  # min_new_tokens: no early <|endoftext|>, always 20 tokens to judge
        out = hf_model.generate(
            ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0
        )
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert text.strip(), "empty continuation"
    assert text.replace("\n", " ").replace("\t", " ").isprintable(), repr(text)
    words = [w for w in text.split() if any(c.isalpha() for c in w)]
    assert len(words) >= 5, repr(text)


def test_export_matches_transformers_on_tiny_random_config(tmp_path):
    """The JAX forward trained here and transformers' Qwen3 agree (f32) on what export() wrote:
    weight names, [out, in] layout, q/k norms, rotate-half RoPE and tied embeddings are right."""
    import jax
    import jax.numpy as jnp

    tt = _train_tiny()
    cfg = tt.ModelConfig(
        vocab_size=128,
        hidden_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=80,
    )
    params = tt.init_params(cfg, jax.random.PRNGKey(3))
    # Norm gains off 1 and larger weights, so every weight visibly shapes the logits.
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(4), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    params = jax.tree_util.tree_unflatten(treedef, leaves)
    tt.export(params, cfg, tmp_path, dtype=jnp.float32)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 37))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(jax.jit(tt.forward, static_argnums=1)(params, cfg, jnp.asarray(tokens)))
    assert np.abs(ref - ours).max() < 1e-4, np.abs(ref - ours).max()


def test_jdet_default_load_scores_like_transformers(hf_model, tokenizer):
    """jdet.load() with no argument is this model, and its log-probs match transformers (f32)."""
    jdet = pytest.importorskip("jdet")
    if not hasattr(jdet, "load") or not hasattr(jdet, "LLM"):
        pytest.skip("jdet.load / jdet.LLM not available yet")
    model = jdet.load(dtype="float32")
    llm = jdet.LLM(model, invariance="tp")
    seq = [0] + tokenizer("Return the number of items.", add_special_tokens=False).input_ids
    lp = llm.score([seq])[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([seq])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
    assert lp.shape == ref.shape
    assert np.abs(lp - ref.numpy()).max() < 1e-4, np.abs(lp - ref.numpy()).max()
