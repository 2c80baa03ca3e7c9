"""heron: an LLM inference engine and serving stack in Python."""

from heron.entrypoints.llm import LLM
from heron.outputs import CompletionOutput, RequestOutput
from heron.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
