"""DeepSeek-V3-architecture target model and MTP draft layer, with HF-format I/O."""

from specdec.models.deepseek_v3 import DeepseekMTP, DeepseekV3Config, DeepseekV3ForCausalLM
from specdec.models.hf_io import load_deepseek, load_mtp, save_deepseek

__all__ = ["DeepseekMTP", "DeepseekV3Config", "DeepseekV3ForCausalLM", "load_deepseek", "load_mtp", "save_deepseek"]
