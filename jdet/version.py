# Part of system_fingerprint (jdet/fingerprint.py): bump it whenever a change gives other bits for
# the same request on the same backend. 0.2.0: the CPU's RoPE with exact partial products (2f8bf21)
# and the GPU's one-block RMSNorm for D > 1024 (f2e94f4).
__version__ = "0.2.0"
