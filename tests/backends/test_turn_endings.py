"""Both backends end generation at the same tokens: llama.cpp finds a model's end-of-turn tokens
by their text whatever its configuration names (llama-vocab.cpp), and the MLX backend reads the
same spellings (specrun/fill_tokens.py), so an MLX answer stops where a llama.cpp one does."""

from __future__ import annotations

import pytest

from model_factory import build_model_with_specials

# ids 512 on, in this order; <|end|> ends a turn unless the harmony format's <|return|> and
# <|call|> stand beside it (there it ends a message), which the second model shows
TURN_ENDS = ("<|eot_id|>", "<end_of_turn>", "<|end|>", "<|im_start|>")
HARMONY = ("<|return|>", "<|call|>", "<|end|>", "<|message|>")
SOLAR = ("<|calls|>", "<|flush|>", "<|end|>")
# Gemma 4: </s> is text beside <|tool_response>
GEMMA4 = ("<|tool_response>", "</s>", "<turn|>")


@pytest.mark.parametrize(("added", "endings"), [(TURN_ENDS, {512, 513, 514}), (HARMONY, {512, 513}),
                                                (SOLAR, {512, 513}), (GEMMA4, {512, 514})],
                         ids=["end-of-turn tokens", "harmony", "solar open", "gemma 4"])
def test_both_backends_end_at_the_end_of_turn_tokens_llama_cpp_finds_by_their_text(tmp_path, added, endings):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    from specrun.backends.llama import LlamaCppBackend
    from specrun.backends.mlx import MlxBackend

    model = build_model_with_specials(tmp_path, added)
    llama = LlamaCppBackend(model.gguf_f32_path, n_threads=1, gpu_layers=0, flash_attn=False)
    mlx = MlxBackend(model.hf_dir)
    try:
        assert llama.vocab.eos_ids == mlx.vocab.eos_ids == {2} | endings  # 2: the tiny vocabulary's end
    finally:
        llama.close()
        mlx.close()
