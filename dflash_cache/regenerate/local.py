"""The target in-process, through transformers: for small jobs and tests.

One replica per device (`--gpus`, or the CPU), each answering requests from a shared queue on its
own thread. A replica takes every request waiting (up to `MAX_BATCH`) and generates them together:
prompts of like length are grouped and left-padded, the attention mask and position ids leaving
each row's answer the one that row would get alone. Greedy decoding drops each row from the batch
as it finishes (sampling, and greedy decoding under a generation config that adjusts the logits,
run through `generate`, whose batch keeps every row to the end). A request
is rendered and generated the way `transformers serve` does it: the chat template with the
generation prompt and the model's own generation config (greedy at temperature 0, its end-of-turn
token). The reply is split into content, reasoning and tool calls by the tokenizer's response
template where it has one; otherwise a leading `<think>...</think>` block, where the vocabulary has
those tokens, is the reasoning and the rest the content.
"""

from __future__ import annotations

import copy
import json
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, StoppingCriteria, StoppingCriteriaList

from dflash_cache.errors import DFlashCacheError, first_line
from dflash_cache.regenerate.client import RequestFailed
from dflash_cache.regenerate.conversations import Completion
from dflash_cache.regenerate.settings import GenerationSettings
from dflash_cache.target.info import read_target_info
from dflash_cache.target.kvcache import cache_kwargs, returned_cache
from dflash_cache.target.loading_bars import no_loading_bars

MAX_BATCH = 16  # conversations generated together by one replica
GATHER_S = 0.05  # how long a replica waits for more requests to batch (the run's lanes send them one by one)
THINK = ("<think>", "</think>")
# Generation settings that change which token greedy decoding picks (through `generate`'s logits processors).
LOGITS_SETTINGS = (
    "repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "min_length",
    "min_new_tokens",
    "suppress_tokens",
    "begin_suppress_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "sequence_bias",
    "exponential_decay_length_penalty",
    "encoder_repetition_penalty",
    "encoder_no_repeat_ngram_size",
    "guidance_scale",
    "renormalize_logits",
)


class _Stopped(StoppingCriteria):
    """Ends a generation part-way once the run stops, so its thread can be joined."""

    def __init__(self, stop: threading.Event):
        self.stop = stop

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.stop.is_set(), dtype=torch.bool, device=input_ids.device)


@dataclass
class _Request:
    messages: list[dict]
    settings: GenerationSettings
    future: Future


class _Replica:
    def __init__(self, path: Path, device: str, stop: threading.Event):
        self.device = device
        self.stop = stop
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        with no_loading_bars():
            self.model = (
                AutoModelForCausalLM.from_pretrained(path, dtype="auto", local_files_only=True).to(device).eval()
            )
        vocab = self.tokenizer.get_vocab()
        self.think = tuple(vocab.get(token) for token in THINK)

    def prompt(self, messages: list[dict], settings: GenerationSettings) -> list[int]:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, **settings.template_kwargs()
        )["input_ids"]

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        settings: GenerationSettings,
        model_name: str,
        on_answer: Callable[[int, Completion], None] = lambda i, completion: None,
    ) -> list[Completion]:
        """Every prompt answered, as one left-padded batch; `on_answer(i, completion)` as soon as prompt i's is."""
        config = copy.deepcopy(self.model.generation_config)
        config.max_new_tokens = settings.max_tokens
        config.do_sample = settings.temperature > 0
        if config.do_sample:
            config.temperature = settings.temperature
        stops = _ids(config.eos_token_id) | _ids(self.tokenizer.eos_token_id)
        if config.pad_token_id is None:
            config.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(stops)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[config.pad_token_id] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        completions: dict[int, Completion] = {}

        def done(i: int, generated: list[int]) -> None:
            content, reasoning, tool_calls = self._parse(generated, prompts[i])
            finish = "tool_calls" if tool_calls else "length" if len(generated) >= settings.max_tokens else "stop"
            completions[i] = Completion(content, reasoning, tool_calls, finish, len(generated), model_name)
            on_answer(i, completions[i])

        if config.do_sample or not _plain_greedy(config):
            output = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=config,
                stopping_criteria=StoppingCriteriaList([_Stopped(self.stop)]),
            )
            for i, row in enumerate(output[:, width:].tolist()):
                done(i, _until(row, stops))
        else:
            self._greedy(ids, mask, settings.max_tokens, stops, done)
        return [completions[i] for i in sorted(completions)]

    def _greedy(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new: int,
        stops: set[int],
        done: Callable[[int, list[int]], None],
    ) -> None:
        """Greedy decoding as `generate` does it (positions counted from each row's first real token,
        padding masked out), except that a row that has finished leaves the batch and its cache, and
        is handed to `done(row, tokens)` at once: the others no longer wait on the longest answer's
        steps at the full batch size. A stopped run hands over nothing more."""
        rows: list[list[int]] = [[] for _ in range(ids.shape[0])]
        alive = torch.arange(ids.shape[0], device=ids.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        cache = returned_cache(out)
        while True:
            tokens = out.logits[:, -1].argmax(-1)
            keep = []
            if self.stop.is_set():
                return
            for i, (row, token) in enumerate(zip(alive.tolist(), tokens.tolist())):
                rows[row].append(token)
                if token not in stops and len(rows[row]) < max_new:
                    keep.append(i)
                else:
                    done(row, rows[row])
            if not keep:
                return
            if len(keep) < len(alive):
                kept = torch.tensor(keep, device=ids.device)
                cache.batch_select_indices(kept)
                alive, tokens, mask, positions = alive[kept], tokens[kept], mask[kept], positions[kept]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=positions,
                logits_to_keep=1,
                **cache_kwargs(self.model, cache),
            )

    def _parse(self, generated: list[int], prompt: list[int]) -> tuple[str, str | None, list[dict] | None]:
        template = getattr(self.tokenizer, "response_template", None)
        if template is None:
            return self._split_thinking(generated)
        parsed = self.tokenizer.parse_response(generated, template, prefix=self.tokenizer.decode(prompt))
        calls = []
        for i, call in enumerate(parsed.get("tool_calls") or []):
            function = call["function"]
            arguments = function["arguments"]
            calls.append(
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {
                        "name": function["name"],
                        "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                    },
                }
            )
        return parsed.get("content", ""), parsed.get("thinking") or None, calls or None

    def _split_thinking(self, generated: list[int]) -> tuple[str, str | None, None]:
        opener, closer = self.think
        if closer is None or closer not in generated:
            return self.tokenizer.decode(generated, skip_special_tokens=True), None, None
        end = generated.index(closer)
        start = 1 if generated[:1] == [opener] else 0
        reasoning = self.tokenizer.decode(generated[start:end], skip_special_tokens=True).strip()
        content = self.tokenizer.decode(generated[end + 1 :], skip_special_tokens=True).strip()
        return content, reasoning or None, None


def _plain_greedy(config: GenerationConfig) -> bool:
    """Whether greedy decoding under `config` is the argmax of the logits as they are: no setting
    that `generate` turns into a logits processor differs from its default."""
    default = GenerationConfig()
    return all(getattr(config, name, None) == getattr(default, name, None) for name in LOGITS_SETTINGS)


def _until(row: list[int], stops: set[int]) -> list[int]:
    """A generated row up to its end-of-turn token: what follows is padding of the batch."""
    return row[: next((i + 1 for i, token in enumerate(row) if token in stops), len(row))]


def _ids(value) -> set[int]:
    values = value if isinstance(value, (list, tuple, set)) else [value]
    return {int(v) for v in values if v is not None}


class LocalTarget:
    def __init__(self, path: str | Path, devices: list[str], max_batch: int = MAX_BATCH):
        self.name = str(path)
        self.max_batch = max_batch
        info = read_target_info(path)
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._replicas = [_Replica(info.path, device, self._stop) for device in devices]
        self._threads = [
            threading.Thread(target=self._serve, args=(replica,), name=f"regenerate-{replica.device}", daemon=True)
            for replica in self._replicas
        ]
        for thread in self._threads:
            thread.start()

    def _take(self) -> list[_Request] | None:
        """The next request and every other one arriving within GATHER_S of the last, up to max_batch;
        None at the end."""
        first = self._queue.get()
        if first is None:
            return None
        taken = [first]
        while len(taken) < self.max_batch:
            try:
                item = self._queue.get(timeout=GATHER_S)
            except queue.Empty:
                break
            if item is None:  # an end mark for a replica: left for the next take
                self._queue.put(None)
                break
            taken.append(item)
        return taken

    def _serve(self, replica: _Replica) -> None:
        while (taken := self._take()) is not None:
            ready = []
            for request in taken:
                try:
                    ready.append((request, replica.prompt(request.messages, request.settings)))
                except (DFlashCacheError, ValueError, TypeError, RuntimeError) as e:  # this conversation's problem
                    request.future.set_exception(
                        RequestFailed(f"{replica.device}: {type(e).__name__}: {first_line(e)}")
                    )
            ready.sort(key=lambda pair: len(pair[1]))  # like lengths together: less padding
            for start in range(0, len(ready), self.max_batch):
                self._answer(replica, ready[start : start + self.max_batch])

    def _answer(self, replica: _Replica, batch: list[tuple[_Request, list[int]]]) -> None:
        try:
            if self._stop.is_set():
                raise RequestFailed(f"{replica.device}: the run was stopped")

            def answer(i: int, completion: Completion) -> None:
                if not self._stop.is_set():
                    batch[i][0].future.set_result(completion)

            replica.generate([prompt for _, prompt in batch], batch[0][0].settings, self.name, answer)
            if self._stop.is_set():  # cut short: not an answer
                raise RequestFailed(f"{replica.device}: the run was stopped")
        except RequestFailed as e:
            return _fail(batch, e)
        except (DFlashCacheError, ValueError, TypeError, RuntimeError) as e:
            return _fail(batch, RequestFailed(f"{replica.device}: {type(e).__name__}: {first_line(e)}"))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting requests, never lost with the thread
            return _fail(batch, e)

    def complete(self, messages: list[dict], settings: GenerationSettings, lane: int) -> Completion:
        future: Future = Future()
        self._queue.put(_Request(messages, settings, future))
        return future.result()

    def close(self) -> None:
        # A thread left generating when the interpreter exits aborts the process (a C++ "terminate
        # called without an active exception" on Ctrl-C): stop the generations and join the threads.
        self._stop.set()
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()


def _fail(batch: list[tuple[_Request, list[int]]], error: BaseException) -> None:
    for request, _ in batch:
        if not request.future.done():  # an answer handed over before the failure stands
            request.future.set_exception(error)
