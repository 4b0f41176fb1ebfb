"""verispec: lossless speculative decoding. Draft cheaply, verify in one target forward, accept by
rejection sampling; the output distribution is exactly the target model's."""
from .llm import LLM, RequestMetrics, RequestOutput
from .core.sampling import SamplingParams
from .drafting.spec_config import SpecConfigError, SpeculativeConfig, SpecMethod

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestMetrics", "SpeculativeConfig", "SpecMethod",
           "SpecConfigError"]
__version__ = "0.1.0"
