"""Linear-attention probe: the gated delta rule chunked over the sequence (a trainer's prefill) vs
stepped token by token carrying its recurrent state (an engine's decode), and that state in float32
vs bfloat16.

Part of `mismatch probe` for hybrid models whose linear-attention layers run the gated delta rule
(Qwen3-Next, Qwen3.5, OLMo-hybrid: config `linear_num_value_heads`, `linear_key_head_dim`,
`linear_value_head_dim`). Terms: per head the state S (k_head_dim x v_head_dim) decays by exp(g_t)
and takes the delta update S += k_t (beta_t (v_t - S^T k_t))^T; the output is S^T q_t. The chunked
algorithm computes the same outputs for 64 tokens at a time with matrix products inside each chunk,
so its rounding order differs by construction. Both forms are transformers' own torch code
(models/qwen3_next/modeling_qwen3_next.py: torch_chunk_gated_delta_rule and
torch_recurrent_gated_delta_rule, the trainer's fallback kernels; transformers 5.19), called here as
a trainer and a decoder call them. Each result compares one token's output vectors, fp32 unless
the row says bfloat16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mismatch.probes.result import ProbeResult, measure
from mismatch.probes.shapes import ProbeShapes, randn

FAMILY = "linear_attention"


def probe_family(shapes: ProbeShapes, *, device: torch.device, gen: torch.Generator) -> list[ProbeResult]:
    linear = shapes.linear
    if linear is None:
        return []
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    # Past one 64-token chunk, so a chunk boundary and a carried state are both exercised.
    tokens = shapes.tokens + shapes.tokens // 2
    heads, dk, dv = linear.num_value_heads, linear.key_head_dim, linear.value_head_dim
    q = randn(1, tokens, heads, dk, gen=gen, device=device)
    k = randn(1, tokens, heads, dk, gen=gen, device=device)
    v = randn(1, tokens, heads, dv, gen=gen, device=device)
    # A trained layer's decay is -exp(A_log) * softplus(a + dt_bias) <= 0, and beta a sigmoid.
    g = -F.softplus(randn(1, tokens, heads, gen=gen, device=device))
    beta = torch.sigmoid(randn(1, tokens, heads, gen=gen, device=device))

    def chunked(*inputs: torch.Tensor) -> torch.Tensor:
        return torch_chunk_gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True)[0][0]

    def stepped(*inputs: torch.Tensor, state_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One call per token with the state carried between calls, as a decode step does; the
        state kept in `state_dtype` between steps (an engine's state cache)."""
        state, outputs = None, []
        for t in range(tokens):
            out, state = torch_recurrent_gated_delta_rule(*(x[:, t:t + 1] for x in inputs), initial_state=state,
                                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
            state = state.to(state_dtype).float()
            outputs.append(out[0, 0])
        return torch.stack(outputs)

    op = f"gated delta rule, {heads} heads, k {dk} v {dv}, {tokens} tokens"
    inputs = (q, k, v, g, beta)
    reference = chunked(*inputs)
    bf16_inputs = tuple(x.bfloat16() for x in inputs)
    return [
        measure(stepped(*inputs), reference, family=FAMILY, op=op, source="prefill_decode",
                variation="recurrent decode (float32 state) vs chunked prefill"),
        measure(stepped(*inputs, state_dtype=torch.bfloat16), reference, family=FAMILY, op=op, source="dtype",
                variation="recurrent decode with a bfloat16 state vs chunked prefill (float32 state)"),
        measure(stepped(*bf16_inputs).bfloat16(), chunked(*bf16_inputs), family=FAMILY, op=op,
                source="prefill_decode", variation="recurrent decode vs chunked prefill, bfloat16 in and out "
                                                   "(float32 inside both)"),
    ]
