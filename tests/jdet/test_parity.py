"""Parity with Hugging Face transformers (PyTorch, CPU) on random-weight checkpoints of every
supported architecture, loaded through the real safetensors path, in float32."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import jdet
from tests.conftest import ARCH_CONFIGS

PARITY_TOL = 1e-4


def hf_logprobs(model_dir, seq):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        lg = hf(torch.tensor([seq])).logits[0].float()
    lp = torch.log_softmax(lg, -1)
    return lp[torch.arange(len(seq) - 1), torch.tensor(seq[1:])].numpy()


@pytest.mark.parametrize("invariance", ["none", "tp"])
@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_score_matches_transformers(hf_checkpoints, arch, invariance):
    model = jdet.load(hf_checkpoints[arch], dtype="float32")
    # budget 8 forces chunked prefill of the 37-token sequence, in one score shape on a CPU
    # (its smallest token bucket; each shape is a compile of 10-30 s there)
    llm = jdet.LLM(model, invariance=invariance, max_num_batched_tokens=8)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (37, 5)]
    for seq, lp in zip(seqs, llm.score(seqs), strict=True):
        ref = hf_logprobs(hf_checkpoints[arch], seq)
        assert lp.shape == ref.shape
        assert np.abs(lp - ref).max() < PARITY_TOL, (arch, np.abs(lp - ref).max())


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_greedy_continuation_matches_transformers(hf_checkpoints, arch):
    model = jdet.load(hf_checkpoints[arch], dtype="float32")
    llm = jdet.LLM(model, invariance="none", max_num_batched_tokens=8)  # one step shape on a CPU
    prompt = np.random.default_rng(2).integers(0, model.cfg.vocab_size, 9).tolist()
    out = llm.generate(
        [prompt], jdet.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )[0]
    hf = AutoModelForCausalLM.from_pretrained(hf_checkpoints[arch], dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, 9:].tolist()
    assert out.token_ids == ref


def test_rope_tables_match_transformers(hf_checkpoints):
    """Each RoPE variant in the fixtures (default, llama3, yarn) gives transformers' cos/sin."""
    import jax.numpy as jnp
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jdet.model import rope_tables

    for arch, d in hf_checkpoints.items():
        model = jdet.load(d, dtype="float32")
        hcfg = AutoConfig.from_pretrained(d)
        rtype = hcfg.rope_parameters.get("rope_type", "default")
        if rtype == "default":
            continue
        inv, scale = ROPE_INIT_FUNCTIONS[rtype](hcfg, "cpu")
        ours, our_scale = model.cfg.rope_inv_freq()
        np.testing.assert_allclose(ours, inv.numpy(), rtol=1e-6, err_msg=arch)
        assert abs(our_scale - scale) < 1e-7, arch
        cos, _ = rope_tables(model.cfg, jnp.arange(5))
        assert cos.shape == (5, model.cfg.head_dim)
