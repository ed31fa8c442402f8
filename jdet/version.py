# Part of system_fingerprint (jdet/fingerprint.py): bump it whenever a change gives other bits for
# the same request on the same backend. 0.2.0: the CPU's RoPE with exact partial products (2f8bf21)
# and the GPU's one-block RMSNorm for D > 1024 (f2e94f4). 0.2.1: the CPU's RMSNorm squares f32
# activations exactly (e8cc6ff: f32 models' CPU bits), and a CPU fingerprint names the host CPU.
# 0.2.2: the CPU sampler's top-p cumulative mass in another fixed order (`xla_fixed.prefix_sum`,
# for a faster compile): a row whose mass lands within an ulp of its top_p may keep another set.
# 0.3.0: Hopper runs the Mosaic GPU paged attention (version 2 of its plan: TMA + wgmma,
# 128-token KV blocks, FA3-style exp2 on raw scores): other GPU bits than the Triton kernel.
__version__ = "0.3.0"
