"""The demo pair shipped with specrun (F16 GGUF files), and heads for the demo target: Medusa
(`specrun heads train -t demo-target --backend llama --minutes 3 --draft-vocab 1024`), EAGLE
(`--kind eagle --num-heads 6 --draft-vocab 1024 --minutes 5`) and EAGLE-3, the folder
demo-target.eagle3 (`--kind eagle3 --num-heads 6 --draft-vocab 1024 --minutes 8`). A builtin widened with zeros
(demo-target-xl) has its original's heads of every kind, widened on first use
(modelkit.widened_heads)."""
