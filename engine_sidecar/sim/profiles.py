"""Named model-on-GPU profiles and the step-time model derived from them.

Rules: every figure here is a public spec-sheet number (parameter count, layer shape, memory
bandwidth, dense tensor FLOPs) or an efficiency factor stated next to it; nothing is fitted to a
measurement. One engine step runs a batch of scheduled tokens; its time is

    t_step = t_fixed + max(flops / (peak_flops * mfu), bytes / (bandwidth * mbu))
    flops  = 2 * params * batched_tokens + 4 * layers * q_width * sum(new_tokens_i * context_i)
    bytes  = weight_bytes + kv_bytes_per_token * sum(context_i)

so prefill (many tokens, one pass over the weights) is compute-bound and decode (one token per
sequence, weights and the whole KV context read every step) is bandwidth-bound, as on a GPU.
Speculative decoding verifies ``k`` extra tokens per sequence (they count in ``batched_tokens``,
so verification is nearly free while a step is bandwidth-bound and costs FLOPs once it is
compute-bound) and adds ``k`` sequential draft-model passes per step, each ``draft_fraction`` of
the target's bandwidth-bound decode pass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    params: float  # parameters of the served model
    weight_bytes_per_param: float  # 2 for BF16, 1 for FP8
    layers: int
    kv_heads: int
    head_dim: int
    q_heads: int
    kv_bytes_per_elem: float  # KV-cache dtype
    gpu_mem_bytes: float
    bandwidth: float  # bytes/s
    peak_flops: float  # dense tensor FLOP/s at the compute dtype
    gpu_memory_utilization: float = 0.90
    activation_reserve_bytes: float = 2e9  # activations, CUDA graphs, allocator slack
    mfu: float = 0.55  # achievable fraction of peak FLOPs in prefill
    mbu: float = 0.80  # achievable fraction of peak bandwidth in decode
    t_fixed: float = 0.004  # scheduler, sampling, kernel launches per step (s)
    draft_fraction: float = 0.08  # one draft-model pass relative to a target decode pass

    @property
    def weight_bytes(self) -> float:
        return self.params * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_elem

    def num_gpu_blocks(self, block_size: int) -> int:
        """KV blocks that fit after weights and reserve, as vLLM's memory profiling finds them."""
        budget = self.gpu_mem_bytes * self.gpu_memory_utilization
        free = budget - self.weight_bytes - self.activation_reserve_bytes
        return max(16, int(free // (self.kv_bytes_per_token * block_size)))

    def step_time(self, batched_tokens: int, context_tokens: int, attn_work: int,
                  draft_len: int = 0) -> float:
        """Seconds for one step (see the module docstring for the formula).

        ``context_tokens``: KV tokens read, summed over scheduled sequences; ``attn_work``: the sum
        over sequences of new tokens times their context (attention FLOPs); ``draft_len``: the
        step's draft length K (the draft model runs K passes, whatever the batch).
        """
        if batched_tokens <= 0:
            return 0.0
        flops = 2.0 * self.params * batched_tokens
        flops += 4.0 * self.layers * self.q_heads * self.head_dim * attn_work
        moved = self.weight_bytes + self.kv_bytes_per_token * context_tokens
        t = max(flops / (self.peak_flops * self.mfu), moved / (self.bandwidth * self.mbu))
        if draft_len:
            decode_pass = self.weight_bytes / (self.bandwidth * self.mbu)
            t += self.draft_fraction * decode_pass * draft_len
        return self.t_fixed + t


_LLAMA70B_H100X4 = Profile(
    name="llama70b-h100x4",
    description="Llama-3.1-70B, BF16, tensor parallel over four H100 SXM",
    params=70.6e9, weight_bytes_per_param=2, layers=80, kv_heads=8, head_dim=128,
    q_heads=64, kv_bytes_per_elem=2, gpu_mem_bytes=320e9, bandwidth=4 * 3.35e12,
    peak_flops=4 * 989e12, mfu=0.45, mbu=0.70, t_fixed=0.006,
)

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="llama8b-l4",
            description="Llama-3.1-8B, BF16 weights and KV cache, one NVIDIA L4 (24 GB, 300 GB/s)",
            params=8.03e9, weight_bytes_per_param=2, layers=32, kv_heads=8, head_dim=128,
            q_heads=32, kv_bytes_per_elem=2, gpu_mem_bytes=24e9, bandwidth=300e9,
            peak_flops=121e12,
        ),
        Profile(
            name="llama1b-l4",
            description="Llama-3.2-1B, BF16 weights and KV cache, one NVIDIA L4 (a draft model "
            "on a cheap GPU)",
            params=1.24e9, weight_bytes_per_param=2, layers=16, kv_heads=8, head_dim=64,
            q_heads=32, kv_bytes_per_elem=2, gpu_mem_bytes=24e9, bandwidth=300e9,
            peak_flops=121e12,
        ),
        Profile(
            name="llama8b-h100",
            description="Llama-3.1-8B, BF16, one NVIDIA H100 SXM (80 GB, 3.35 TB/s)",
            params=8.03e9, weight_bytes_per_param=2, layers=32, kv_heads=8, head_dim=128,
            q_heads=32, kv_bytes_per_elem=2, gpu_mem_bytes=80e9, bandwidth=3.35e12,
            peak_flops=989e12,
        ),
        Profile(
            name="llama70b-h100",
            description="Llama-3.1-70B, FP8 weights and FP8 KV cache, one NVIDIA H100 SXM",
            params=70.6e9, weight_bytes_per_param=1, layers=80, kv_heads=8, head_dim=128,
            q_heads=64, kv_bytes_per_elem=1, gpu_mem_bytes=80e9, bandwidth=3.35e12,
            peak_flops=1979e12, gpu_memory_utilization=0.95,
        ),
        _LLAMA70B_H100X4,
        # The same engine with an FP8 KV cache: twice the tokens in the same memory.
        replace(
            _LLAMA70B_H100X4, name="llama70b-h100x4-kv8", kv_bytes_per_elem=1,
            description="Llama-3.1-70B, BF16 weights, FP8 KV cache, tensor parallel over four "
            "H100 SXM",
        ),
    )
}


def profiles_table(block_size: int = 16) -> str:
    """Markdown table of every profile's derived figures (``sim --list-profiles``)."""
    rows = [
        "| profile | model and GPU | weights (GB) | KV per token (KiB) | KV blocks of "
        f"{block_size} | decode, 1 seq x 1k ctx (ms) | decode, 64 seqs x 1k ctx (ms) | "
        "prefill 2048 tokens (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in PROFILES.values():
        one = p.step_time(1, 1024, 1024)
        batch = p.step_time(64, 64 * 1024, 64 * 1024)
        prefill = p.step_time(2048, 2048, 2048 * 1024)
        rows.append(
            f"| `{p.name}` | {p.description} | {p.weight_bytes / 1e9:.1f} | "
            f"{p.kv_bytes_per_token / 1024:.0f} | {p.num_gpu_blocks(block_size):,} | "
            f"{1000 * one:.1f} | {1000 * batch:.1f} | {1000 * prefill:.1f} |")
    return "\n".join(rows)
