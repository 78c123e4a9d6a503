"""specrun: lossless speculative decoding for local LLMs (MLX and llama.cpp)."""

__version__ = "0.1.0"
