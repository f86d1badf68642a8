"""The target in-process, through transformers: for small jobs and tests.

One replica per device (`--gpus`, or the CPU), each answering requests from a shared queue on its
own thread. Greedy requests are batched continuously: a replica steps its cohorts (cohort.py: a
left-padded batch with its own cache, each row's answer the one it would get alone) in turn, a
token each, and starts a new cohort from the requests waiting as soon as rows that finished leave
room, so a long answer no longer holds back the requests behind it. Sampling, and greedy decoding
under a generation config that adjusts the logits, run through `generate`, a batch at a time, whose
batch keeps every row to the end. A request is rendered and generated the way `transformers serve`
does it: the chat template with the generation prompt and the model's own generation config
(greedy at temperature 0, its end-of-turn token). The reply is split into content, reasoning and
tool calls by the tokenizer's response template where it has one; otherwise a leading
`<think>...</think>` block, where the vocabulary has those tokens, is the reasoning and the rest the
content.
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
from dflash_cache.regenerate.cohort import Cohort, left_padded
from dflash_cache.regenerate.conversations import Completion
from dflash_cache.regenerate.settings import GenerationSettings
from dflash_cache.target.info import read_target_info
from dflash_cache.target.loading_bars import no_loading_bars
from dflash_cache.target.precision import generation_dtype

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
                AutoModelForCausalLM.from_pretrained(path, dtype=generation_dtype(device), local_files_only=True)
                .to(device)
                .eval()
            )
        vocab = self.tokenizer.get_vocab()
        self.think = tuple(vocab.get(token) for token in THINK)

    def prompt(self, messages: list[dict], settings: GenerationSettings) -> list[int]:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, **settings.template_kwargs()
        )["input_ids"]

    def config(self, settings: GenerationSettings) -> tuple[GenerationConfig, set[int]]:
        """The model's own generation config under `settings`, and its end-of-turn tokens."""
        config = copy.deepcopy(self.model.generation_config)
        config.max_new_tokens = settings.max_tokens
        config.do_sample = settings.temperature > 0
        if config.do_sample:
            config.temperature = settings.temperature
        stops = _ids(config.eos_token_id) | _ids(self.tokenizer.eos_token_id)
        if config.pad_token_id is None:
            config.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(stops)
        return config, stops

    def greedy(self, settings: GenerationSettings) -> bool:
        """Whether `settings` is greedy decoding of the logits as they are: what a cohort does."""
        config, _ = self.config(settings)
        return not config.do_sample and _plain_greedy(config)

    def cohort(self, prompts: list[list[int]], settings: GenerationSettings) -> Cohort:
        config, stops = self.config(settings)
        return Cohort(self.model, prompts, config.pad_token_id, settings.max_tokens, stops)

    def completion(
        self, generated: list[int], prompt: list[int], settings: GenerationSettings, model_name: str
    ) -> Completion:
        content, reasoning, tool_calls = self._parse(generated, prompt)
        finish = "tool_calls" if tool_calls else "length" if len(generated) >= settings.max_tokens else "stop"
        return Completion(content, reasoning, tool_calls, finish, len(generated), model_name)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        settings: GenerationSettings,
        model_name: str,
        on_answer: Callable[[int, Completion], None] = lambda i, completion: None,
    ) -> list[Completion]:
        """Every prompt answered, as one left-padded batch; `on_answer(i, completion)` as soon as prompt i's is.
        A stopped run hands over nothing more."""
        completions: dict[int, Completion] = {}

        def done(i: int, generated: list[int]) -> None:
            completions[i] = self.completion(generated, prompts[i], settings, model_name)
            on_answer(i, completions[i])

        if self.greedy(settings):
            cohort = self.cohort(prompts, settings)
            while cohort.size and not self.stop.is_set():
                for i, generated in cohort.step():
                    done(i, generated)
            return [completions[i] for i in sorted(completions)]
        config, stops = self.config(settings)
        ids, mask = left_padded(prompts, config.pad_token_id, self.device)
        output = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([_Stopped(self.stop)]),
        )
        for i, row in enumerate(output[:, ids.shape[1] :].tolist()):
            done(i, _until(row, stops))
        return [completions[i] for i in sorted(completions)]

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


@dataclass
class _Running:
    cohort: Cohort
    requests: list[tuple[_Request, list[int]]]  # with its prompt, by the cohort's row index


class LocalTarget:
    def __init__(
        self,
        path: str | Path,
        devices: list[str],
        max_batch: int = MAX_BATCH,
        on_tokens: Callable[[int], None] = lambda n: None,
    ):
        """`on_tokens(n)` from a replica's thread each time it has generated n more tokens."""
        self.name = str(path)
        self.max_batch = max_batch
        self.on_tokens = on_tokens
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

    def _take(self, room: int, wait: bool) -> list[_Request] | None:
        """Up to `room` requests: with `wait`, the next one and every other one arriving within GATHER_S
        of the last; without, those waiting now (maybe none). None at the end."""
        taken = []
        if wait:
            if (first := self._queue.get()) is None:
                return None
            taken.append(first)
        while len(taken) < room:
            try:
                item = self._queue.get(timeout=GATHER_S) if wait else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:  # an end mark for a replica: left for the next take
                self._queue.put(None)
                break
            taken.append(item)
        return taken

    def _serve(self, replica: _Replica) -> None:
        running: list[_Running] = []
        try:
            self._loop(replica, running)
            error: BaseException = RequestFailed(f"{replica.device}: the run was stopped")
        except BaseException as e:  # noqa: BLE001 - handed to the waiting requests, never lost with the thread
            error = _failure(replica.device, e)
        for cohort in running:
            _fail(cohort.requests, error)

    def _loop(self, replica: _Replica, running: list[_Running]) -> None:
        """Continuous batching: the cohorts stepped in turn, a token each, and a new cohort started from
        the requests waiting whenever it can be half a batch (each cohort costs a forward a step), or
        whenever none runs."""
        while not self._stop.is_set():
            room = self.max_batch - sum(r.cohort.size for r in running)
            if not running or room >= max(1, self.max_batch // 2):
                taken = self._take(room, wait=not running)
                if taken is None:
                    return
                self._start(replica, taken, running)
            running[:] = [r for r in running if self._step(replica, r)]

    def _start(self, replica: _Replica, taken: list[_Request], running: list[_Running]) -> None:
        ready = []
        for request in taken:
            try:
                ready.append((request, replica.prompt(request.messages, request.settings)))
            except (DFlashCacheError, ValueError, TypeError, RuntimeError) as e:  # this conversation's problem
                request.future.set_exception(_failure(replica.device, e))
        if not ready:
            return
        settings = ready[0][0].settings
        if not replica.greedy(settings):  # through `generate`, the whole batch at once
            return self._answer(replica, ready)
        try:
            running.append(_Running(replica.cohort([prompt for _, prompt in ready], settings), ready))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting requests, never lost with the thread
            _fail(ready, _failure(replica.device, e))

    def _step(self, replica: _Replica, running: _Running) -> bool:
        """A token for each row of the cohort, its finished rows answered; whether rows are left."""
        try:
            generating = running.cohort.size
            finished = running.cohort.step()
            self.on_tokens(generating)
            for i, generated in finished:
                request, prompt = running.requests[i]
                completion = replica.completion(generated, prompt, request.settings, self.name)
                if not self._stop.is_set():
                    request.future.set_result(completion)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting requests, never lost with the thread
            _fail(running.requests, _failure(replica.device, e))
            return False
        return running.cohort.size > 0

    def _answer(self, replica: _Replica, batch: list[tuple[_Request, list[int]]]) -> None:
        def answer(i: int, completion: Completion) -> None:
            self.on_tokens(completion.completion_tokens)
            if not self._stop.is_set():
                batch[i][0].future.set_result(completion)

        try:
            replica.generate([prompt for _, prompt in batch], batch[0][0].settings, self.name, answer)
            if self._stop.is_set():  # cut short: not an answer
                raise RequestFailed(f"{replica.device}: the run was stopped")
        except BaseException as e:  # noqa: BLE001 - handed to the waiting requests, never lost with the thread
            _fail(batch, _failure(replica.device, e))

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


def _failure(device: str, error: BaseException) -> BaseException:
    """What the requests of a failed generation are told: one line naming the device, for the errors
    a conversation or the model can cause; anything else as it is."""
    if isinstance(error, (DFlashCacheError, ValueError, TypeError, RuntimeError)):
        return RequestFailed(f"{device}: {type(error).__name__}: {first_line(error)}")
    return error


def _fail(batch: list[tuple[_Request, list[int]]], error: BaseException) -> None:
    for request, _ in batch:
        if not request.future.done():  # an answer handed over before the failure stands
            request.future.set_exception(error)
