# Part of system_fingerprint (jdet/fingerprint.py): bump it whenever a change gives other bits for
# the same request on the same backend. 0.2.0: the CPU's RoPE with exact partial products (2f8bf21)
# and the GPU's one-block RMSNorm for D > 1024 (f2e94f4). 0.2.1: the CPU's RMSNorm squares f32
# activations exactly (e8cc6ff: f32 models' CPU bits), and a CPU fingerprint names the host CPU.
# 0.2.2: the CPU sampler's top-p cumulative mass in another fixed order (`xla_fixed.prefix_sum`,
# for a faster compile): a row whose mass lands within an ulp of its top_p may keep another set.
__version__ = "0.2.2"
