"""hf_bpd: blockwise parallel decoding with draft refinement for Hugging Face Transformers.

Module map: `configuration` (what the heads are), `heads` (the drafting heads and their loss), `modeling` (the model
class), `lattice` (a step's top-k lattice), `generation/` (options, drafting, draft trees, the decoding loop),
`rescorers/` (registry, n-gram, neural), `training/`, `evaluation/` (analysis, tuning, bench), `hub/` (base models,
checkpoint files, model cards), `cli`.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration import BlockwiseParallelConfig
from .errors import BaseModelError, BPDConfigError, BPDError, CheckpointError
from .evaluation.tuning import ALPHA_GRID, tune_alpha
from .generation import BlockDrafter, BlockwiseGenerateOutput, BlockwiseGenerationConfig, GenerationStats, sparse_tree
from .heads import DraftHeads
from .hub.base_models import PACKAGED_MODELS, fingerprint, load_base, load_base_model, load_tokenizer
from .lattice import Draft, Lattice
from .modeling import BlockwiseParallelForCausalLM, BlockwiseParallelOutput
from .rescorers import (HeadScoreRescorer, NeuralRescorer, NgramRescorer, Rescorer, available_rescorers,
                        build_ngram, register_rescorer)
from .training.lora import bpd_lora_config

__version__ = "0.1.0"

AutoConfig.register(BlockwiseParallelConfig.model_type, BlockwiseParallelConfig, exist_ok=True)
AutoModelForCausalLM.register(BlockwiseParallelConfig, BlockwiseParallelForCausalLM, exist_ok=True)

__all__ = [
    "ALPHA_GRID", "BPDConfigError", "BPDError", "BaseModelError", "BlockDrafter", "BlockwiseGenerateOutput",
    "BlockwiseGenerationConfig", "BlockwiseParallelConfig", "BlockwiseParallelForCausalLM",
    "BlockwiseParallelOutput", "CheckpointError", "Draft", "DraftHeads", "GenerationStats", "HeadScoreRescorer",
    "Lattice", "NeuralRescorer", "NgramRescorer", "PACKAGED_MODELS", "Rescorer", "available_rescorers",
    "bpd_lora_config", "build_ngram", "fingerprint", "load_base", "load_base_model", "load_tokenizer",
    "register_rescorer", "sparse_tree", "tune_alpha",
]
