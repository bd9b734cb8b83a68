"""gpt-oss's HF state-dict adapter, for the unquantized (bf16 or fp32) layout that HF
transformers' `GptOssForCausalLM` and vLLM's loader read.

    .venv/bin/python -m pytest tests/unit/test_tiny_checkpoint.py

torchtitan 0.3.0's `GptOssStateDictAdapter` maps the experts to names the model does not have
(`mlp1_weight` for `mlp1_weight_EGD`, ...) and to the MXFP4 checkpoint's `*_blocks` names: its
`to_hf` drops the experts and its `from_hf` cannot fill them (measured: `to_hf` of the tiny
model has no expert tensor). This adapter keeps its other names and maps the experts to HF's
unquantized ones, transposed as HF stores them (x @ W, not W x):

    gate_up_proj [E, D, 2F]  <->  mlp1_weight_EGD [E, 2F, D]   (gate and up interleaved)
    down_proj    [E, F, D]   <->  mlp2_weight_EDF [E, D, F]

An MXFP4 checkpoint (the released gpt-oss-20b and -120b) is not read: dequantize it to bf16
first (docs/moe.md).
"""

import re
from typing import Any

from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter

_EXPERTS = "model.layers.{}.mlp.experts."
_OURS = "layers.{}.moe.routed_experts.inner_experts."
# HF name -> (our name, transposed)
_EXPERT_TENSORS = {
    _EXPERTS + "gate_up_proj": (_OURS + "mlp1_weight_EGD", True),
    _EXPERTS + "gate_up_proj_bias": (_OURS + "mlp1_bias_EG", False),
    _EXPERTS + "down_proj": (_OURS + "mlp2_weight_EDF", True),
    _EXPERTS + "down_proj_bias": (_OURS + "mlp2_bias_ED", False),
}
_TRANSPOSED = {ours for ours, transposed in _EXPERT_TENSORS.values() if transposed}
_TRANSPOSED |= {hf for hf, (_, transposed) in _EXPERT_TENSORS.items() if transposed}


class GptOssAdapter(GptOssStateDictAdapter):
    def __init__(self, model_config, hf_assets_path: str | None):
        super().__init__(model_config, hf_assets_path)
        self.from_hf_map = {
            hf: ours for hf, ours in self.from_hf_map.items() if not hf.startswith(_EXPERTS)
        }
        self.from_hf_map |= {hf: ours for hf, (ours, _) in _EXPERT_TENSORS.items()}

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return super().to_hf(_transposed(state_dict))

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return super().from_hf(_transposed(hf_state_dict))


def _transposed(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with the expert matrices that HF stores transposed swapped in their last two
    dims (views: a DCP load into the HF-named tensors fills the model's own)."""
    out = {}
    for key, value in state.items():
        abstract = re.sub(r"(\d+)", "{}", key, count=1)
        out[key] = value.transpose(-2, -1) if abstract in _TRANSPOSED else value
    return out
