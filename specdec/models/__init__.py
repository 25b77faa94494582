"""DeepSeek-V3-architecture target model and MTP (EAGLE) draft layer, with HF-format I/O.

config.py: DeepseekV3Config, DeepseekV32Config. deepseek.py: the target (absorbed MLA through an attn
backend, MoE). deepseek_v32.py: DeepSeek-V3.2's sparse attention (the indexer) on top of it, target
and MTP layer.
mtp.py: the MTP draft layer. loader.py: load/save in the public checkpoint layout.
"""

from specdec.models.config import DeepseekV32Config, DeepseekV3Config
from specdec.models.deepseek import DeepseekV3ForCausalLM, softmax_scale, validate_token_ids
from specdec.models.deepseek_v32 import DeepseekV32ForCausalLM, DeepseekV32MTP
from specdec.models.loader import CheckpointError, load_deepseek, load_mtp, save_deepseek
from specdec.models.mtp import DeepseekMTP

__all__ = [
    "CheckpointError", "DeepseekMTP", "DeepseekV32Config", "DeepseekV32ForCausalLM", "DeepseekV32MTP",
    "DeepseekV3Config", "DeepseekV3ForCausalLM", "load_deepseek", "load_mtp", "save_deepseek", "softmax_scale",
    "validate_token_ids",
]
