"""hf_bpd: blockwise parallel decoding with draft refinement for Hugging Face Transformers."""

from transformers import AutoConfig, AutoModelForCausalLM

from .base_models import PACKAGED_MODELS, fingerprint, load_base, load_base_model, load_tokenizer
from .configuration import BlockwiseParallelConfig
from .errors import BaseModelError, BPDConfigError, BPDError, CheckpointError
from .heads import DraftHeads
from .lora import bpd_lora_config
from .modeling import BlockwiseParallelForCausalLM, BlockwiseParallelOutput

__version__ = "0.1.0"

AutoConfig.register(BlockwiseParallelConfig.model_type, BlockwiseParallelConfig, exist_ok=True)
AutoModelForCausalLM.register(BlockwiseParallelConfig, BlockwiseParallelForCausalLM, exist_ok=True)

__all__ = [
    "BPDConfigError",
    "BPDError",
    "BaseModelError",
    "BlockwiseParallelConfig",
    "BlockwiseParallelForCausalLM",
    "BlockwiseParallelOutput",
    "CheckpointError",
    "DraftHeads",
    "PACKAGED_MODELS",
    "bpd_lora_config",
    "fingerprint",
    "load_base",
    "load_base_model",
    "load_tokenizer",
]
