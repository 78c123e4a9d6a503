"""Train the demo target/draft pair that ships inside specrun, on CPU, in a fixed wall-clock budget.

The corpus is the Python standard library's own ``.py`` source (``test/`` and
``idlelib/`` are held out for validation). The script trains a byte-level BPE
tokenizer, then three Llama-architecture models in plain torch, one phase each:

1. the target (hidden 384, 6 layers, ~13.8M parameters) on next-token cross-entropy;
2. a plain draft (hidden 192, 2 layers, ~2.5M parameters) on cross-entropy, for comparison;
3. the distilled draft (same shape) on KL(target || draft) mixed with cross-entropy.

Each phase stops at its share of the budget (60% / 15% / 25% of what is left after
the data is prepared) and saves a checkpoint (torch state, ``ModelConfig`` JSON and
``tokenizer.json``) under ``OUT/checkpoints``. The held-out losses, greedy agreement
of each draft with the target, parameter counts, tokens seen and wall times go to
``OUT/report.json``. Finally the target and the distilled draft are exported (F16 and
Q8_0 GGUF, HF folders) to ``OUT/export`` when specrun's model writers are available;
``--export-only`` redoes just that step from saved checkpoints.

Reproduce the shipped pair (seeds are fixed; the step count depends on the machine's
speed because the phases are budgeted in wall-clock time)::

    python tools/train_demo_pair.py --out runs/demo --budget-minutes 48

A quick check that every phase runs::

    python tools/train_demo_pair.py --out runs/smoke --budget-minutes 1.5 --max-files 50

This file is a development tool: it is not part of the wheel and needs torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specrun.modelkit.config import ModelConfig, weight_names, weight_shapes
from specrun.modelkit.tokenizer import BOS_ID, DEMO_CHAT_TEMPLATE, EOS_ID, train_byte_bpe

HELD_OUT_DIRS = ("test", "idlelib")
SKIPPED_DIRS = ("site-packages", "dist-packages", "__pycache__")
PHASE_SHARES = {"target": 0.70, "draft_plain": 0.08, "draft": 0.22}
EVAL_RESERVE_SHARE = 0.04
MIN_BUDGET_SECONDS = 30.0
MIN_PHASE_SECONDS = 5.0
LOG_INTERVAL_SECONDS = 30.0
CHECKPOINT_INTERVAL_SECONDS = 300.0
SHIPPED_F16_LIMIT_BYTES = 40 * 1000 * 1000


class TrainerError(Exception):
    """A problem the user can fix; reported as one line, without a traceback."""


# ---------------------------------------------------------------------------
# Model: Llama architecture with Hugging Face weight names
# ---------------------------------------------------------------------------


def target_config(vocab_size: int) -> ModelConfig:
    """The demo target: hidden 384, 6 layers of 6 heads (head_dim 64), MLP 1024."""
    return ModelConfig(
        arch="llama", vocab_size=vocab_size, hidden_size=384, intermediate_size=1024,
        num_layers=6, num_heads=6, num_kv_heads=6, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )


def draft_config(vocab_size: int) -> ModelConfig:
    """The demo draft: hidden 192, 2 layers of 3 heads (head_dim 64), MLP 512."""
    return ModelConfig(
        arch="llama", vocab_size=vocab_size, hidden_size=192, intermediate_size=512,
        num_layers=2, num_heads=3, num_kv_heads=3, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned per-channel scale (no bias, no mean subtraction)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, shape (seq_len, head_dim), in the HF half-split layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) by position: x·cos + rotate_half(x)·sin."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    """Causal multi-head attention with RoPE; k/v heads are shared when fewer than q heads."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class SwiGLU(nn.Module):
    """The Llama MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embeddings, decoder layers and the final norm (the HF ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaLM(nn.Module):
    """A Llama causal LM whose ``state_dict`` names and shapes are exactly the contract's."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.arch != "llama" or config.tie_embeddings:
            raise ValueError("the demo trainer builds untied Llama models only")
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        """Normal(0, 0.02) everywhere; residual output projections scaled by depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.num_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                continue
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            nn.init.normal_(param, mean=0.0, std=std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq)."""
        cos, sin = rotary_tables(ids.shape[1], self.config.head_dim, self.config.rope_theta)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def numpy_weights(self) -> dict[str, np.ndarray]:
        """Float32 weights in HF naming, checked against the contract's names and shapes."""
        state = {name: t.detach().float().cpu().numpy() for name, t in self.state_dict().items()}
        expected = weight_shapes(self.config)
        if sorted(state) != sorted(weight_names(self.config)) or any(state[n].shape != s for n, s in expected.items()):
            raise AssertionError("model state_dict does not match specrun.modelkit.config.weight_shapes")
        return state


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------
# Corpus and tokens
# ---------------------------------------------------------------------------


@dataclass
class Corpus:
    train_texts: list[str]
    val_texts: list[str]
    root: Path


def stdlib_sources() -> Iterator[tuple[tuple[str, ...], str]]:
    """(path parts under the stdlib, text) of every readable, non-empty .py file, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in SKIPPED_DIRS for part in parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield parts, text


def held_out_folder_texts(folder: str) -> list[str]:
    """Every non-empty .py file under one held-out folder of the standard library."""
    return [text for parts, text in stdlib_sources() if parts[0] == folder]


def collect_corpus(max_files: int | None, test_train_share: float = 0.0) -> Corpus:
    """Read the standard library's .py files; ``test/`` and ``idlelib/`` become validation.

    With ``test_train_share`` > 0, that share of ``test/``'s files (every n-th by sorted path,
    so the split is the same on every machine with this Python) moves to training; the rest of
    ``test/`` and all of ``idlelib/`` stay held out.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = [], []
    test_files_seen = 0
    for parts, text in stdlib_sources():
        held_out = parts[0] in HELD_OUT_DIRS
        if held_out and parts[0] == "test" and test_train_share > 0.0:
            test_files_seen += 1
            held_out = int(test_files_seen * test_train_share) == int((test_files_seen - 1) * test_train_share)
        (val if held_out else train).append(text)
    if max_files is not None:
        train, val = train[:max_files], val[: max(2, max_files // 5)]
    if not train or not val:
        raise TrainerError(f"no usable .py files for training and validation under {root}")
    return Corpus(train, val, root)


def encode_documents(tokenizer_json: str, texts: list[str]) -> torch.Tensor:
    """One flat int32 stream: each document as <|bos|> tokens <|eos|>, back to back."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    pieces = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        pieces.append(np.array([BOS_ID, *encoding.ids, EOS_ID], dtype=np.int32))
    return torch.from_numpy(np.concatenate(pieces))


def random_batch(stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """``batch_size`` windows of ``seq_len + 1`` tokens at random offsets into the stream."""
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
    return stream[starts[:, None] + torch.arange(seq_len + 1)].long()


def validation_windows(stream: torch.Tensor, count: int, seq_len: int) -> torch.Tensor:
    """``count`` windows of ``seq_len + 1`` tokens spread evenly over the held-out stream."""
    span = len(stream) - seq_len - 1
    if span <= 0:
        raise TrainerError(f"held-out corpus has {len(stream)} tokens, fewer than one sequence of {seq_len + 1}")
    starts = torch.linspace(0, span, count).long().unique()
    return stream[starts[:, None] + torch.arange(seq_len + 1)].long()


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


@dataclass
class PhaseResult:
    name: str
    steps: int = 0
    tokens_seen: int = 0
    seconds: float = 0.0
    final_train_loss: float = float("nan")
    extra: dict = field(default_factory=dict)


def learning_rate(peak: float, step: int, warmup_steps: int, progress: float) -> float:
    """Linear warmup by steps, then cosine decay to 10% of peak over the phase's wall time."""
    warm = min(1.0, (step + 1) / warmup_steps)
    return peak * warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """Fused AdamW with weight decay on matrices only (not on norm scales)."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def distillation_loss(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor, kd_weight: float
) -> torch.Tensor:
    """kd_weight · KL(target ‖ draft) + (1 − kd_weight) · cross-entropy, per token."""
    vocab = draft_logits.shape[-1]
    draft_logp = F.log_softmax(draft_logits.reshape(-1, vocab), dim=-1)
    target_logp = F.log_softmax(target_logits.reshape(-1, vocab), dim=-1)
    kl = F.kl_div(draft_logp, target_logp, log_target=True, reduction="batchmean")
    if kd_weight >= 1.0:
        return kl
    return kd_weight * kl + (1.0 - kd_weight) * F.nll_loss(draft_logp, labels.reshape(-1))


@dataclass
class TrainSettings:
    seq_len: int
    batch_size: int
    peak_lr: float
    warmup_steps: int = 30
    max_steps: int | None = None


def train_phase(
    name: str,
    model: LlamaLM,
    stream: torch.Tensor,
    settings: TrainSettings,
    seconds: float,
    seed: int,
    checkpoint: "CheckpointStore",
    teacher: LlamaLM | None = None,
    kd_weight: float = 1.0,
) -> PhaseResult:
    """Train until the phase's wall-clock deadline (at least one step); save on the way and at the end.

    With a ``teacher`` the loss is :func:`distillation_loss` against its frozen
    next-token distributions; otherwise plain next-token cross-entropy.
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = make_optimizer(model, settings.peak_lr)
    result = PhaseResult(name)
    start = time.monotonic()
    last_log = last_save = start
    window_tokens, window_loss, window_steps = 0, 0.0, 0
    model.train()
    while True:
        elapsed = time.monotonic() - start
        if result.steps > 0 and (elapsed >= seconds or result.steps == settings.max_steps):
            break
        lr = learning_rate(settings.peak_lr, result.steps, settings.warmup_steps, elapsed / seconds)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = random_batch(stream, settings.batch_size, settings.seq_len, generator)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = model(inputs)
        if teacher is None:
            loss = cross_entropy(logits, labels)
        else:
            with torch.no_grad():
                target_logits = teacher(inputs)
            loss = distillation_loss(logits, target_logits, labels, kd_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

        result.steps += 1
        result.tokens_seen += inputs.numel()
        window_tokens += inputs.numel()
        window_loss += loss.item()
        window_steps += 1
        now = time.monotonic()
        if now - last_log >= LOG_INTERVAL_SECONDS:
            mean_loss = window_loss / window_steps
            result.final_train_loss = mean_loss
            log(f"[{name}] step {result.steps} {window_tokens / (now - last_log):.0f} tok/s "
                f"loss {mean_loss:.4f} lr {lr:.2e} tokens {result.tokens_seen} elapsed {now - start:.0f}s")
            last_log, window_tokens, window_loss, window_steps = now, 0, 0.0, 0
        if now - last_save >= CHECKPOINT_INTERVAL_SECONDS:
            checkpoint.save(name, model, result)
            last_save = now
    if window_steps:
        result.final_train_loss = window_loss / window_steps
    result.seconds = time.monotonic() - start
    log(f"[{name}] done: {result.steps} steps, {result.tokens_seen} tokens in {result.seconds:.0f}s "
        f"({result.tokens_seen / result.seconds:.0f} tok/s), last train loss {result.final_train_loss:.4f}")
    checkpoint.save(name, model, result)
    model.eval()
    return result


# ---------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: LlamaLM, windows: torch.Tensor, batch_size: int = 8) -> tuple[float, torch.Tensor]:
    """Mean held-out next-token loss and the argmax prediction at every position."""
    model.eval()
    losses, predictions = [], []
    for batch in windows.split(batch_size):
        logits = model(batch[:, :-1])
        losses.append(F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none"))
        predictions.append(logits.argmax(-1))
    return torch.cat(losses).mean().item(), torch.cat(predictions)


def expected_tokens_per_step(agreement: float, draft_length: int = 4) -> float:
    """Mean tokens per greedy verify step if each draft token is accepted independently."""
    if agreement >= 1.0:
        return float(draft_length + 1)
    return (1.0 - agreement ** (draft_length + 1)) / (1.0 - agreement)


# ---------------------------------------------------------------------------
# Checkpoints, export, report
# ---------------------------------------------------------------------------


class CheckpointStore:
    """Saves and loads ``OUT/checkpoints/<name>.pt`` plus ``<name>.config.json`` and the tokenizer."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.dir = out_dir / "checkpoints"

    @property
    def tokenizer_path(self) -> Path:
        return self.dir / "tokenizer.json"

    def save_tokenizer(self, tokenizer_json: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer_path.write_text(tokenizer_json, encoding="utf-8")

    def save(self, name: str, model: LlamaLM, result: PhaseResult) -> None:
        """Write atomically, so a run stopped mid-save leaves the previous checkpoint intact."""
        self.dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "config": model.config.to_json(),
            "state_dict": model.state_dict(),
            "steps": result.steps,
            "tokens_seen": result.tokens_seen,
        }
        tmp = self.dir / f"{name}.pt.tmp"
        torch.save(payload, tmp)
        os.replace(tmp, self.dir / f"{name}.pt")
        (self.dir / f"{name}.config.json").write_text(model.config.to_json(), encoding="utf-8")

    def load(self, name: str) -> LlamaLM:
        return self.load_with_tokens(name)[0]

    def load_with_tokens(self, name: str) -> tuple[LlamaLM, int]:
        """The model and the number of training tokens it has seen."""
        path = self.dir / f"{name}.pt"
        if not path.exists():
            raise TrainerError(f"no checkpoint {path}; run training first")
        payload = torch.load(path, map_location="cpu", weights_only=True)
        model = LlamaLM(ModelConfig.from_json(payload["config"]))
        model.load_state_dict(payload["state_dict"])
        return model.eval(), int(payload["tokens_seen"])

    def load_tokenizer(self) -> str:
        if not self.tokenizer_path.exists():
            raise TrainerError(f"no tokenizer {self.tokenizer_path}; run training first")
        return self.tokenizer_path.read_text(encoding="utf-8")


def evaluate_runs(args: argparse.Namespace) -> None:
    """Held-out loss and greedy agreement of several runs' models, on the same windows."""
    stores = [CheckpointStore(run) for run in args.evaluate]
    tokenizer_json = stores[0].load_tokenizer()
    for store in stores[1:]:
        if store.load_tokenizer() != tokenizer_json:
            raise TrainerError(f"{store.out_dir} has another tokenizer than {stores[0].out_dir}: losses would not compare")
    held_out = {
        "idlelib/": held_out_folder_texts("idlelib"),
        f"held out at --test-train-share {args.test_train_share:g}": collect_corpus(None, args.test_train_share).val_texts,
    }
    report: dict = {"windows": args.val_sequences, "seq_len": args.seq_len, "sets": {}}
    for label, texts in held_out.items():
        windows = validation_windows(encode_documents(tokenizer_json, texts), args.val_sequences, args.seq_len)
        rows = report["sets"][label] = {}
        for store in stores:
            target_loss, target_argmax = evaluate(store.load("target"), windows)
            row = rows[str(store.out_dir)] = {"target": target_loss}
            for name in ("draft_plain", "draft"):
                loss, argmax = evaluate(store.load(name), windows)
                row[name] = loss
                row[f"{name}_agreement"] = (argmax == target_argmax).float().mean().item()
            log(f"{label:>40} {store.out_dir}: target {target_loss:.4f}, plain draft {row['draft_plain']:.4f} "
                f"(agreement {row['draft_plain_agreement']:.3f}), distilled draft {row['draft']:.4f} "
                f"(agreement {row['draft_agreement']:.3f})")
    print(json.dumps(report, indent=1))


def export_pair(store: CheckpointStore) -> dict[str, int]:
    """Write GGUF (F16, Q8_0) and HF folders of the target and distilled draft; return file sizes."""
    try:
        from specrun.modelkit.gguf_io import write_gguf
        from specrun.modelkit.hf_io import write_hf_folder
    except ImportError as exc:
        raise TrainerError(f"model writers not available yet ({exc}); export later with --export-only") from None
    tokenizer_json = store.load_tokenizer()
    export_dir = store.out_dir / "export"
    export_dir.mkdir(parents=True, exist_ok=True)
    (export_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    sizes = {}
    for checkpoint_name, stem in (("target", "demo-target"), ("draft", "demo-draft")):
        model = store.load(checkpoint_name)
        weights = model.numpy_weights()
        for dtype in ("F16", "Q8_0"):
            path = export_dir / f"{stem}.{dtype.lower()}.gguf"
            write_gguf(path, model.config, weights, tokenizer_json, chat_template=DEMO_CHAT_TEMPLATE, dtype=dtype)
            sizes[path.name] = path.stat().st_size
        write_hf_folder(export_dir / f"{stem}-hf", model.config, weights, tokenizer_json,
                        chat_template=DEMO_CHAT_TEMPLATE, dtype="float16")
    shipped = sizes["demo-target.f16.gguf"] + sizes["demo-draft.f16.gguf"]
    log(f"exported to {export_dir}: " + ", ".join(f"{n} {s / 1e6:.1f} MB" for n, s in sizes.items()))
    if shipped > SHIPPED_F16_LIMIT_BYTES:
        log(f"WARNING: F16 pair is {shipped / 1e6:.1f} MB, over the {SHIPPED_F16_LIMIT_BYTES / 1e6:.0f} MB limit")
    return sizes


def cpu_description() -> str:
    """The CPU model name and core count, for the report."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()})"


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output directory")
    parser.add_argument("--budget-minutes", type=float, default=48.0,
                        help="wall-clock budget for the whole run, data preparation included")
    parser.add_argument("--max-files", type=int, default=None, help="use only this many training files (smoke tests)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step, all phases")
    parser.add_argument("--target-lr", type=float, default=1.5e-3)
    parser.add_argument("--draft-lr", type=float, default=2e-3)
    parser.add_argument("--kd-weight", type=float, default=0.8,
                        help="weight of KL(target||draft) in the distilled draft's loss; the rest is cross-entropy")
    parser.add_argument("--val-sequences", type=int, default=32, help="held-out sequences for evaluation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=None, help="stop each phase after this many steps")
    parser.add_argument("--export-only", action="store_true", help="export from the checkpoints in --out and exit")
    parser.add_argument("--continue-target", type=Path, default=None,
                        help="start the target from this earlier run's checkpoint (same corpus and tokenizer) "
                             "and train it further; the drafts are trained anew")
    parser.add_argument("--test-train-share", type=float, default=0.0,
                        help="train also on this share of test/'s files (every n-th by sorted path); "
                             "the rest of test/ and idlelib/ stay held out")
    parser.add_argument("--evaluate", type=Path, nargs="+", default=None, metavar="RUN",
                        help="evaluate these runs' checkpoints (same tokenizer) on idlelib/ (held out in "
                             "every split) and on this split's held-out files, and exit")
    parser.add_argument("--bench-steps", type=int, default=0,
                        help="time this many training steps of each model on random tokens and exit")
    args = parser.parse_args(argv)
    if args.export_only or args.evaluate:
        return args
    if not args.budget_minutes * 60 >= MIN_BUDGET_SECONDS and not args.bench_steps:
        raise TrainerError(f"--budget-minutes {args.budget_minutes:g} is too small: need at least "
                           f"{MIN_BUDGET_SECONDS / 60:g} minutes")
    for flag in ("seq_len", "batch_size", "val_sequences", "vocab_size"):
        if getattr(args, flag) <= 0:
            raise TrainerError(f"--{flag.replace('_', '-')} must be positive")
    if args.max_files is not None and args.max_files <= 0:
        raise TrainerError("--max-files must be positive")
    if not 0.0 <= args.test_train_share < 1.0:
        raise TrainerError("--test-train-share must be at least 0 and below 1")
    if not 0.0 <= args.kd_weight <= 1.0:
        raise TrainerError("--kd-weight must be between 0 and 1")
    return args


def bench(args: argparse.Namespace) -> None:
    """Measure training tokens/s of the target, a plain draft and a distillation step."""
    stream = torch.randint(3, args.vocab_size, (1_000_000,), dtype=torch.int32)
    generator = torch.Generator().manual_seed(args.seed)
    target = LlamaLM(target_config(args.vocab_size))
    draft = LlamaLM(draft_config(args.vocab_size))
    for label, model, teacher in (("target", target, None), ("draft", draft, None), ("distill", draft, target)):
        optimizer = make_optimizer(model, 1e-3)
        timings = []
        for _ in range(args.bench_steps + 1):
            began = time.perf_counter()
            batch = random_batch(stream, args.batch_size, args.seq_len, generator)
            logits = model(batch[:, :-1])
            if teacher is None:
                loss = cross_entropy(logits, batch[:, 1:])
            else:
                with torch.no_grad():
                    teacher_logits = teacher.eval()(batch[:, :-1])
                loss = distillation_loss(logits, teacher_logits, batch[:, 1:], args.kd_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            timings.append(time.perf_counter() - began)
        per_step = sorted(timings[1:])[len(timings[1:]) // 2]
        log(f"bench {label}: seq {args.seq_len} batch {args.batch_size}: {per_step:.3f} s/step, "
            f"{args.batch_size * args.seq_len / per_step:.0f} tok/s")


def train(args: argparse.Namespace) -> None:
    """Prepare data, run the three phases, evaluate, write the report, export."""
    run_start = time.monotonic()
    deadline = run_start + args.budget_minutes * 60
    store = CheckpointStore(args.out)
    torch.manual_seed(args.seed)

    corpus = collect_corpus(args.max_files, args.test_train_share)
    log(f"corpus {corpus.root}: {len(corpus.train_texts)} training files, {len(corpus.val_texts)} held-out files")
    if args.continue_target is not None:  # the continued target keeps the tokenizer it was trained with
        tokenizer_json = CheckpointStore(args.continue_target).load_tokenizer()
    else:
        tokenizer_json = train_byte_bpe(corpus.train_texts, args.vocab_size)
    store.save_tokenizer(tokenizer_json)
    vocab_size = len(json.loads(tokenizer_json)["model"]["vocab"])
    train_stream = encode_documents(tokenizer_json, corpus.train_texts)
    val_stream = encode_documents(tokenizer_json, corpus.val_texts)
    windows = validation_windows(val_stream, args.val_sequences, args.seq_len)
    if len(train_stream) <= args.seq_len + 1:
        raise TrainerError(f"training corpus has {len(train_stream)} tokens, fewer than one sequence")
    prep_seconds = time.monotonic() - run_start
    log(f"tokenizer vocab {vocab_size}; {len(train_stream)} training tokens, {len(val_stream)} held-out tokens, "
        f"{windows.numel()} used for evaluation; prepared in {prep_seconds:.0f}s")

    training_seconds = (deadline - time.monotonic()) * (1.0 - EVAL_RESERVE_SHARE)
    shares = {name: share * training_seconds for name, share in PHASE_SHARES.items()}
    if min(shares.values()) < MIN_PHASE_SECONDS:
        raise TrainerError(f"--budget-minutes {args.budget_minutes:g} leaves {training_seconds:.0f}s for training "
                           f"after {prep_seconds:.0f}s of data preparation: too little for every phase")
    log("phase budgets: " + ", ".join(f"{n} {s:.0f}s" for n, s in shares.items()))

    def settings(lr: float) -> TrainSettings:
        return TrainSettings(args.seq_len, args.batch_size, lr, max_steps=args.max_steps)

    phases, models = {}, {}
    tokens_before = 0
    if args.continue_target is not None:
        earlier = CheckpointStore(args.continue_target)
        models["target"], tokens_before = earlier.load_with_tokens("target")
        log(f"[target] continuing from {args.continue_target} after {tokens_before} tokens")
    else:
        models["target"] = LlamaLM(target_config(vocab_size))
    phases["target"] = train_phase("target", models["target"], train_stream, settings(args.target_lr),
                                   shares["target"], args.seed, store)
    target_loss, target_argmax = evaluate(models["target"], windows)
    phases["target"].extra = {"val_loss": target_loss}
    if tokens_before:  # the checkpoint and the report count every token the target has seen
        phases["target"].tokens_seen += tokens_before
        phases["target"].extra.update(continued_from=str(args.continue_target), tokens_before=tokens_before)
        store.save("target", models["target"], phases["target"])
    log(f"[target] held-out loss {target_loss:.4f}")

    for name, teacher in (("draft_plain", None), ("draft", models["target"])):
        torch.manual_seed(args.seed + 1)
        models[name] = LlamaLM(draft_config(vocab_size))
        phases[name] = train_phase(name, models[name], train_stream, settings(args.draft_lr), shares[name],
                                   args.seed + 1, store, teacher=teacher, kd_weight=args.kd_weight)
        loss, argmax = evaluate(models[name], windows)
        agreement = (argmax == target_argmax).float().mean().item()
        phases[name].extra = {"val_loss": loss, "greedy_agreement": agreement,
                              "expected_tokens_per_step_k4_iid": expected_tokens_per_step(agreement)}
        log(f"[{name}] held-out loss {loss:.4f}, greedy agreement with target {agreement:.3f}")

    report = build_report(args, corpus, vocab_size, train_stream, val_stream, windows, phases, models)
    report["total_seconds"] = time.monotonic() - run_start
    try:
        report["export"] = export_pair(store)
    except TrainerError as exc:
        log(str(exc))
        report["export"] = None
    write_report(args.out, report)


def build_report(args, corpus, vocab_size, train_stream, val_stream, windows, phases, models) -> dict:
    """Everything worth knowing about the run, as JSON-ready data."""
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "cpu": cpu_description(),
        # the corpus by what it is, not where this machine keeps it
        "corpus": {"stdlib": f"Python {platform.python_version()} standard library ({corpus.root.name})",
                   "train_files": len(corpus.train_texts),
                   "held_out_files": len(corpus.val_texts), "held_out_dirs": list(HELD_OUT_DIRS),
                   "test_train_share": args.test_train_share,
                   "train_tokens": len(train_stream), "held_out_tokens": len(val_stream),
                   "eval_tokens": windows[:, 1:].numel()},
        "vocab_size": vocab_size,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "kd_weight": args.kd_weight,
        "seed": args.seed,
        "models": {
            name: {"parameters": parameter_count(models[name]), "config": json.loads(models[name].config.to_json()),
                   "steps": result.steps, "tokens_seen": result.tokens_seen, "seconds": round(result.seconds, 1),
                   "last_train_loss": result.final_train_loss, **result.extra}
            for name, result in phases.items()
        },
    }


def write_report(out_dir: Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2)
    (out_dir / "report.json").write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(2)
    try:
        args = parse_args(argv)
        if args.export_only:
            export_pair(CheckpointStore(args.out))
        elif args.evaluate:
            evaluate_runs(args)
        elif args.bench_steps:
            bench(args)
        else:
            train(args)
    except TrainerError as exc:
        print(f"train_demo_pair: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
