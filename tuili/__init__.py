"""tuili (推理): LLM inference on the hardware you have, with its roofline on every run."""

from tuili.engine.llm import LLM
from tuili.engine.request import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from tuili.pooling import PoolingParams
from tuili.sampling import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "PoolingParams", "EmbeddingRequestOutput"]
__version__ = "0.1.0"
