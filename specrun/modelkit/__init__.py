"""Model kit: write and derive the small models specrun tests and demos with.

Weights travel as a plain ``dict[str, np.ndarray]`` in Hugging Face naming
(``model.layers.0.self_attn.q_proj.weight`` …) together with a
:class:`ModelConfig`; the writers turn that into a GGUF file (llama.cpp) or an
HF-style folder (mlx-lm). Nothing here imports mlx or llama_cpp.
"""
