"""Decoding with drafting heads: options (`config`), drafting (`drafting`), draft trees and their attention masks
(`tree`), the one decoding loop (`decoding`), stopping inside a block (`stopping`) and statistics (`stats`)."""

from .config import BlockwiseGenerationConfig
from .decoding import blockwise_decoding
from .drafting import BlockDrafter
from .stats import BlockwiseGenerateOutput, GenerationStats
from .tree import DraftTree, sparse_tree

__all__ = ["BlockDrafter", "BlockwiseGenerateOutput", "BlockwiseGenerationConfig", "DraftTree", "GenerationStats",
           "blockwise_decoding", "sparse_tree"]
