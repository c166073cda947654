"""A small Llama-architecture checkpoint made deterministically on first use.

No weights can be downloaded where this project is tested, so the default model is made here:
random weights from a fixed seed, a byte-level BPE tokenizer trained on the paragraphs below,
a chat template, and a `config.json` that both SGLang and transformers load. It is written
into a cache folder once (atomically, so concurrent first launches are safe) and reused.
The answers it gives are noise; it exists so that the whole serving path runs anywhere.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from sgl_kvc.model.cache import build_once, default_cache_dir

DEMO_MODEL_NAME = "sgl-kvc-demo-llama-random-weights"

# Paragraphs the tokenizer is trained on. Varied on purpose so that BPE finds a few thousand merges.
_CORPUS = """
A language model reads a prompt and writes an answer one token at a time. For every token it has
seen, each attention layer keeps a key and a value vector, so that the next token can look back at
all the earlier ones without computing them again. This store is called the KV cache, and on a busy
server it is where the memory goes: a long prompt, a long chain of thought or many users at once
fill it long before the arithmetic units are busy.

Serving engines share the cache between requests that start with the same words. A radix tree maps
token prefixes to the slots that hold their keys and values, so a long system prompt is computed
once and reused by every conversation that begins with it. When memory runs short the engine evicts
the least recently used branches of the tree, and when even that is not enough it pauses a running
request, frees its cache and computes it again later.

Compression keeps more requests in flight. Storing keys and values in eight-bit floating point
halves the bytes per token, provided the scales are chosen from the data so that outliers do not
saturate. Eviction goes further: most tokens receive almost no attention once they are old, and a
policy that scores tokens by the attention they receive, by their redundancy with other tokens or by
their position can drop them and keep a fixed budget per request.

Reasoning models think aloud for thousands of tokens. Much of that text repeats itself: the same
intermediate result restated, the same check performed twice. Redundancy-aware eviction measures
how similar each key is to the others and prefers to keep tokens that are both important and
distinct. Heavy hitters, attention sinks and a window of recent tokens are simpler rules that work
surprisingly well.

The weather was mild in the valley that spring. Farmers planted barley and beans along the river,
children walked to the village school across the old stone bridge, and in the evenings the baker
sold warm bread with honey. Travellers arriving from the mountains told stories of snow that lasted
until June, of wolves near the pass, and of a monastery whose library held ten thousand books.

Mathematics rewards patience. To add two fractions, bring them to a common denominator; to solve a
quadratic equation, complete the square or use the formula; to prove a statement for every natural
number, check the first case and show that each case implies the next. Seven times eight is fifty
six, twelve squared is one hundred forty four, and the sum of the first hundred integers is five
thousand and fifty.

Good software is small, tested and honest about what it does not do. Each module has one concern,
each public function says what it takes and returns, and each error message tells the user what to
change. Benchmarks compare alternatives side by side on the same machine and record their numbers in
files, so that a claim can be checked later by anyone who runs the same command.

The orchestra tuned its instruments while the audience found their seats. Violins, violas, cellos
and double basses sat in a half circle; flutes, oboes, clarinets and bassoons behind them; horns,
trumpets, trombones and a tuba at the back, with timpani and a harp to one side. The conductor raised
her baton, the hall fell silent, and the first quiet notes of the symphony began.

Question: what is the capital of France? Answer: Paris. Question: how many legs does a spider have?
Answer: eight. Question: which planet is closest to the sun? Answer: Mercury. Question: what colour
do you get by mixing blue and yellow? Answer: green. Question: who wrote the play about a prince of
Denmark? Answer: William Shakespeare.
"""

_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]


@dataclass(frozen=True)
class DemoModelSpec:
    """Shape of the demo model. Small enough for a 2-core CPU, Llama/GQA like real models."""

    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 16384
    vocab_size: int = 4096
    rope_theta: float = 10000.0
    initializer_range: float = 0.08  # larger than the usual 0.02: peakier logits, stabler greedy picks
    seed: int = 0
    torch_dtype: str = "bfloat16"

    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True) + _CORPUS + _CHAT_TEMPLATE
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_demo_model(cache_dir: Path | None = None, spec: DemoModelSpec = DemoModelSpec()) -> Path:
    """Return the folder of the demo checkpoint, creating it on first use."""
    target = (cache_dir or default_cache_dir()) / f"demo-llama-{spec.digest()}"
    return build_once(target, lambda folder: _write_model(folder, spec))


def _train_tokenizer(spec: DemoModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=1,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Each line also trained lower-cased and capitalised, to reach a vocabulary of a few thousand.
    lines = [ln.strip() for ln in _CORPUS.splitlines() if ln.strip()]
    variants = lines + [ln.lower() for ln in lines] + [ln.upper() for ln in lines]
    tok.train_from_iterator(variants, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def _write_model(folder: Path, spec: DemoModelSpec) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer(spec)
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=spec.torch_dtype,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, spec.torch_dtype))
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "sgl_kvc_demo.json").write_text(
        json.dumps({"name": DEMO_MODEL_NAME, "spec": asdict(spec)}, indent=2)
    )
