"""Model kit: model files. The models that ship with specrun (the demo pair, SmolLM2 and Gemma 3
from PyPI, ``builtin.py``), GGUF and MLX files read, written and converted (``gguf_io.py``,
``hf_io.py``, ``gguf_convert.py``: `specrun models convert`), bench-scale targets derived by
widening with zeros (``widen.py``), and a target's low-bit and layer-skip self-drafts
(``selfdraft.py``, ``layer_choice.py``). Self-drafting heads are specrun/heads/.

Weights travel as a plain ``dict[str, np.ndarray]`` in Hugging Face naming
(``model.layers.0.self_attn.q_proj.weight`` …) together with a
:class:`ModelConfig`; the writers turn that into a GGUF file (llama.cpp) or an
HF-style folder (mlx-lm). Nothing here imports mlx or llama_cpp.
"""
