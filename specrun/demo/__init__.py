"""The demo pair shipped with specrun (F16 GGUF files)."""
