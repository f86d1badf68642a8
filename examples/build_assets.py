"""Build the demo assets offline from the docstrings and source of the Python standard library.

    python examples/build_assets.py --out examples/assets

writes
    target/             a BPE tokenizer with a chat template and <|mask|>, and a tiny Qwen3 target
                        trained briefly on the conversations below (bf16 safetensors)
    data/train.jsonl    {"messages": [...]} conversations: short questions, docstrings as answers
    data/heldout.jsonl  the same kind of conversations about modules the target never saw
    build_report.json   versions, sizes, held-out accuracy and perplexity, runtime

Everything is seeded and walked in a fixed order, with torch on 2 threads and deterministic
algorithms, so a rerun with the same Python, torch and tokenizers versions on the same kind of CPU
gives the same files. Docstrings change between Python versions, so other versions give other
(equally good) assets.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import platform
import random
import textwrap
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from dflash_cache.data.tokenize import tokenize_conversation

# Cross-platform modules present from Python 3.10 to 3.13 that import without side effects.
MODULES = tuple(
    """
    abc argparse ast base64 bdb binascii bisect builtins bz2 calendar cmath cmd code codecs codeop
    collections colorsys compileall concurrent.futures configparser contextlib contextvars copy
    copyreg csv dataclasses datetime decimal difflib dis doctest email.message email.utils enum
    filecmp fileinput fnmatch fractions ftplib functools gc getopt gettext glob graphlib gzip
    hashlib heapq hmac html html.parser http.client http.cookies http.server imaplib importlib
    inspect io ipaddress itertools json keyword linecache locale logging logging.handlers lzma
    mailbox marshal math mimetypes modulefinder netrc numbers operator optparse os pathlib pdb
    pickle pickletools pkgutil platform plistlib poplib pprint profile pstats py_compile pyclbr
    pydoc queue quopri random re reprlib rlcompleter runpy sched secrets selectors shelve shlex
    shutil smtplib socketserver sqlite3 stat statistics string stringprep struct subprocess symtable
    sys sysconfig tabnanny tarfile tempfile textwrap threading time timeit token tokenize trace
    traceback tracemalloc types typing unicodedata unittest unittest.mock urllib.parse
    urllib.request uuid warnings wave weakref webbrowser wsgiref.util xml.dom.minidom
    xml.etree.ElementTree xml.sax xmlrpc.client zipapp zipfile zipimport zlib zoneinfo
    """.split()  # noqa: SIM905 (a word list reads better than 150 quoted names)
)
# Conversations about these modules go to heldout.jsonl only; the tokenizer and target never see them.
HELDOUT_MODULES = ("bisect", "calendar", "csv", "fnmatch", "gzip", "heapq", "shlex", "textwrap", "uuid", "zipfile")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SYSTEM_PROMPT = "You answer questions about the Python standard library."
QUESTIONS = {
    "module": (
        "What does the `{}` module do?",
        "Give me an overview of the `{}` module.",
        "What is the `{}` module for?",
    ),
    "function": ("Explain `{}`.", "What does `{}` do?", "How do I use `{}`?", "Describe `{}`."),
    "class": ("What is `{}`?", "Explain the `{}` class.", "Describe `{}`."),
    "method": ("What does the `{}` method do?", "Explain `{}`.", "What is `{}` for?"),
    "source": ("Show me the source of `{}`.", "How is `{}` implemented?"),
}
FOLLOW_UPS = ("And `{}`?", "What about `{}`?", "Now explain `{}`.")


@dataclass
class BuildConfig:
    out: Path = Path("examples/assets")
    seed: int = 0
    max_answer_chars: int = 1200  # keeps nearly every conversation under 512 tokens
    max_follow_up_chars: int = 500
    system_prompt_rate: float = 0.25
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    seq_len: int = 512
    batch_size: int = 4
    steps: int = 600
    lr: float = 1e-3
    warmup_steps: int = 40
    weight_decay: float = 0.1
    threads: int = 2


@dataclass
class DocItem:
    module: str
    name: str  # how a user writes it: "json.dumps", "len", "json"
    kind: str  # "module" | "function" | "class" | "method" | "source"
    text: str


# ---------------------------------------------------------------------------------------------
# Text from the standard library


def import_quietly(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except ImportError:
            return None


def defined_in(obj, module_name: str) -> bool:
    """True for objects that belong to the module (or its C accelerator `_name`), not re-exports."""
    owner = (getattr(obj, "__module__", None) or "").lstrip("_")
    return owner == module_name or owner.startswith(module_name + ".")


def public_members(module) -> list[tuple[str, object]]:
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    members = []
    for name in sorted(set(names)):
        obj = getattr(module, name, None)
        is_api = inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)
        if is_api and defined_in(obj, module.__name__):
            members.append((name, obj))
    return members


def public_methods(cls) -> list[tuple[str, object]]:
    methods = []
    for name, attr in sorted(vars(cls).items()):
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        if not name.startswith("_") and callable(attr):
            methods.append((name, attr))
    return methods


def clean_text(doc: str | None, max_chars: int) -> str | None:
    """The docstring, cut at a paragraph (or else line) boundary; None when too short to teach anything."""
    if not doc:
        return None
    text = inspect.cleandoc(doc).strip()
    if len(text) < 60:
        return None
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n\n", 0, max_chars)
    if cut < max_chars // 3:
        cut = text.rfind("\n", 0, max_chars)
    if cut < max_chars // 3:
        cut = text.rfind(" ", 0, max_chars)
    return text[:cut].rstrip()


def function_source(func, max_chars: int) -> str | None:
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):
        return None
    if not 200 <= len(source) <= max_chars:
        return None
    return "```python\n" + source.rstrip() + "\n```"


def items_of_module(module_name: str, max_chars: int) -> list[DocItem]:
    """The module's own docstring, then each public function and class (with its methods), by name."""
    module = import_quietly(module_name)
    if module is None:
        return []
    candidates = [(module_name, "module", clean_text(module.__doc__, max_chars))]
    for name, obj in public_members(module):
        qualified = name if module_name == "builtins" else f"{module_name}.{name}"
        if inspect.isclass(obj):
            candidates.append((qualified, "class", clean_text(obj.__doc__, max_chars)))
            for method_name, method in public_methods(obj):
                candidates.append((f"{qualified}.{method_name}", "method", clean_text(method.__doc__, max_chars)))
        else:
            candidates.append((qualified, "function", clean_text(obj.__doc__, max_chars)))
            if inspect.isfunction(obj):
                candidates.append((qualified, "source", function_source(obj, max_chars)))
    return [DocItem(module_name, name, kind, text) for name, kind, text in candidates if text]


def collect_items(modules: tuple[str, ...], max_chars: int) -> list[DocItem]:
    """Every documented item of the modules, in a fixed order, each text kept once."""
    seen: set[str] = set()
    items = []
    for module_name in modules:
        for item in items_of_module(module_name, max_chars):
            if item.text not in seen:
                seen.add(item.text)
                items.append(item)
    return items


# ---------------------------------------------------------------------------------------------
# Conversations


def ask(item: DocItem, rng: random.Random) -> str:
    return rng.choice(QUESTIONS[item.kind]).format(item.name)


def single_turn(item: DocItem, rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": ask(item, rng)}, {"role": "assistant", "content": item.text}]


def multi_turn(overview: DocItem, members: list[DocItem], config: BuildConfig, rng: random.Random) -> list[dict]:
    """A module overview, then one or two follow-up questions about its members, all kept short."""
    messages = [
        {"role": "user", "content": ask(overview, rng)},
        {"role": "assistant", "content": clean_text(overview.text, config.max_follow_up_chars)},
    ]
    for member in rng.sample(members, k=min(len(members), rng.choice((1, 2)))):
        messages.append({"role": "user", "content": rng.choice(FOLLOW_UPS).format(member.name)})
        messages.append({"role": "assistant", "content": clean_text(member.text, config.max_follow_up_chars)})
    return messages


def make_conversations(items: list[DocItem], config: BuildConfig, rng: random.Random) -> list[dict]:
    """One single-turn conversation per item, one multi-turn per module, shuffled, some with a system turn."""
    conversations = [single_turn(item, rng) for item in items]
    by_module: dict[str, list[DocItem]] = {}
    for item in items:
        by_module.setdefault(item.module, []).append(item)
    for group in by_module.values():
        overview = [item for item in group if item.kind == "module"]
        members = [item for item in group if item.kind in ("function", "class")]
        if overview and members:
            conversations.append(multi_turn(overview[0], members, config, rng))
    rng.shuffle(conversations)
    system = {"role": "system", "content": SYSTEM_PROMPT}
    return [{"messages": ([system] if rng.random() < config.system_prompt_rate else []) + c} for c in conversations]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(conversations: list[dict], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (as in Qwen) trained on the message texts and role names."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [f"{m['role']}\n{m['content']}" for c in conversations for m in c["messages"]]
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=2048,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tokenize(conversations: list[dict], tokenizer: PreTrainedTokenizerFast) -> list[tuple[list[int], list[int]]]:
    """Token ids and assistant-token mask of each conversation, as `extract` makes them."""
    return [tokenize_conversation(tokenizer, c["messages"]) for c in conversations]


# ---------------------------------------------------------------------------------------------
# Target


def make_target(config: BuildConfig, tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    model_config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(config.seed)
    return Qwen3ForCausalLM(model_config)


def packed_rows(sequences: list[list[int]], seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """One epoch: the conversations in a fresh order, concatenated and cut into rows of seq_len."""
    order = torch.randperm(len(sequences), generator=generator).tolist()
    stream = torch.tensor([t for i in order for t in sequences[i]])
    rows = len(stream) // seq_len
    return stream[: rows * seq_len].view(rows, seq_len)


def lr_at(step: int, config: BuildConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_target(model: Qwen3ForCausalLM, sequences: list[list[int]], config: BuildConfig) -> list[float]:
    """AdamW on packed rows of the training conversations (every token, as in pretraining)."""
    generator = torch.Generator().manual_seed(config.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.95),
    )
    model.train()
    rows, cursor, losses = packed_rows(sequences, config.seq_len, generator), 0, []
    for step in range(config.steps):
        if cursor + config.batch_size > len(rows):
            rows, cursor = packed_rows(sequences, config.seq_len, generator), 0
        batch = rows[cursor : cursor + config.batch_size]
        cursor += config.batch_size
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 100 == 0 or step == config.steps - 1:
            print(f"  step {step:4d}  loss {loss.item():.3f}  lr {lr_at(step, config):.2e}", flush=True)
    model.eval()
    return losses


@torch.no_grad()
def evaluate(model, tokenizer, conversations: list[dict]) -> dict:
    """Teacher-forced greedy next-token accuracy and perplexity on the assistant tokens."""
    correct = count = 0
    nll = 0.0
    for ids, assistant in tokenize(conversations, tokenizer):
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        labels = torch.tensor(ids[1:])
        mask = torch.tensor(assistant[1:], dtype=torch.bool)
        correct += (logits.argmax(-1) == labels)[mask].sum().item()
        nll += torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum").item()
        count += mask.sum().item()
    return {"accuracy": correct / count, "perplexity": math.exp(nll / count), "tokens": count}


# ---------------------------------------------------------------------------------------------


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build_conversations(config: BuildConfig) -> tuple[list[dict], list[dict]]:
    """Train and held-out conversations, split by module, written as JSONL."""
    rng = random.Random(config.seed)
    items = collect_items(MODULES, config.max_answer_chars)
    train = make_conversations([item for item in items if item.module not in HELDOUT_MODULES], config, rng)
    heldout = make_conversations([item for item in items if item.module in HELDOUT_MODULES], config, rng)
    write_jsonl(config.out / "data" / "train.jsonl", train)
    write_jsonl(config.out / "data" / "heldout.jsonl", heldout)
    print(f"  {len(train)} train and {len(heldout)} held-out conversations from {len(items)} items", flush=True)
    return train, heldout


def save_target(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def data_stats(train: list[dict], heldout: list[dict], sequences: list[list[int]]) -> dict:
    lengths = sorted(len(s) for s in sequences)
    return {
        "train_conversations": len(train),
        "heldout_conversations": len(heldout),
        "heldout_modules": list(HELDOUT_MODULES),
        "train_tokens": sum(lengths),
        "median_tokens": lengths[len(lengths) // 2],
        "share_under_512_tokens": sum(n < 512 for n in lengths) / len(lengths),
    }


@torch.no_grad()
def greedy_answer(model, tokenizer, question: str, max_new_tokens: int = 48) -> str:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    output = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, prompt["input_ids"].shape[1] :])


def target_stats(directory: Path, train: list[dict], heldout: list[dict], losses: list[float]) -> dict:
    """Measured on the saved bf16 target, loaded back as a user would load it."""
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    question = heldout[0]["messages"][-2]["content"]
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "heldout": evaluate(model, tokenizer, heldout),
        "train_sample": evaluate(model, tokenizer, train[:200]),
        "chance_accuracy": 1 / len(tokenizer),
        "greedy_sample": {"question": question, "answer": greedy_answer(model, tokenizer, question)},
    }


def build(config: BuildConfig) -> dict:
    started = time.time()
    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)

    print("collecting docstrings ...", flush=True)
    train, heldout = build_conversations(config)

    print("training the tokenizer ...", flush=True)
    tokenizer = train_tokenizer(train, config.vocab_size)
    sequences = [ids for ids, _ in tokenize(train, tokenizer)]

    print(f"training the target on {sum(map(len, sequences))} tokens ...", flush=True)
    train_started = time.time()
    model = make_target(config, tokenizer)
    losses = train_target(model, sequences, config)
    train_s = time.time() - train_started
    save_target(model, tokenizer, config.out / "target")

    print("evaluating the saved target ...", flush=True)
    report = {
        "command": f"python examples/build_assets.py --out {config.out}",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "data": data_stats(train, heldout, sequences),
        "target": target_stats(config.out / "target", train, heldout, losses),
        "train_s": round(train_s, 1),
        "runtime_s": round(time.time() - started, 1),
        "cpu_time_s": round(time.process_time(), 1),
    }
    report["assets_bytes"] = folder_bytes(config.out)
    (config.out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def parse_args(argv: list[str] | None = None) -> BuildConfig:
    defaults = BuildConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=defaults.out, help="folder to write (default: %(default)s)")
    parser.add_argument(
        "--seed", type=int, default=defaults.seed, help="seed for data order and weights (default: %(default)s)"
    )
    parser.add_argument(
        "--steps", type=int, default=defaults.steps, help="target training steps (default: %(default)s)"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=defaults.vocab_size, help="BPE vocabulary size (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    return BuildConfig(out=args.out, seed=args.seed, steps=args.steps, vocab_size=args.vocab_size)


def main(argv: list[str] | None = None) -> None:
    report = build(parse_args(argv))
    heldout = report["target"]["heldout"]
    print(
        f"done in {report['runtime_s']} s: held-out accuracy {heldout['accuracy']:.3f}, "
        f"perplexity {heldout['perplexity']:.1f}; {report['assets_bytes'] / 1e6:.1f} MB in {report['config']['out']}"
    )


if __name__ == "__main__":
    main()
