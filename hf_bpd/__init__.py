"""hf_bpd: blockwise parallel decoding with draft refinement for Hugging Face Transformers."""

from transformers import AutoConfig, AutoModelForCausalLM

from .base_models import PACKAGED_MODELS, fingerprint, load_base, load_base_model, load_tokenizer
from .configuration import BlockwiseParallelConfig
from .errors import BaseModelError, BPDConfigError, BPDError, CheckpointError
from .drafting import BlockDraftCandidateGenerator, BlockDrafter, GenerationStats
from .heads import DraftHeads
from .lattice import Draft, Lattice
from .lora import bpd_lora_config
from .modeling import BlockwiseParallelForCausalLM, BlockwiseParallelOutput
from .neural import NeuralRescorer
from .ngram import NgramRescorer, build_ngram
from .rescoring import HeadScoreRescorer, Rescorer
from .tree import sparse_tree
from .tuning import ALPHA_GRID, tune_alpha

__version__ = "0.1.0"

AutoConfig.register(BlockwiseParallelConfig.model_type, BlockwiseParallelConfig, exist_ok=True)
AutoModelForCausalLM.register(BlockwiseParallelConfig, BlockwiseParallelForCausalLM, exist_ok=True)

__all__ = [
    "BlockDraftCandidateGenerator",
    "BlockDrafter",
    "Draft",
    "GenerationStats",
    "HeadScoreRescorer",
    "Lattice",
    "NeuralRescorer",
    "NgramRescorer",
    "Rescorer",
    "sparse_tree",
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
    "build_ngram",
    "tune_alpha",
    "fingerprint",
    "load_base",
    "load_base_model",
    "load_tokenizer",
]
