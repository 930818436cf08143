"""Model families the engine runs (Llama for now)."""
from engine.model.llama import LayerWeights, LlamaModel

__all__ = ["LlamaModel", "LayerWeights"]
