"""The demo pair shipped with specrun (F16 GGUF files), and Medusa heads for the demo target
(trained with `specrun heads train -t demo-target --backend llama --minutes 3 --draft-vocab 1024`)."""
