"""The target in-process, through transformers: for small jobs and tests.

One replica per device (`--gpus`, or the CPU), each answering requests from a shared queue on its
own thread, one conversation at a time. A request is rendered and generated the way `transformers
serve` does it, so both give the same answers: the chat template with the generation prompt, the
model's own generation config (greedy at temperature 0, its end-of-turn token), and the reply split
into content, reasoning and tool calls by the tokenizer's response template (transformers' fallback
for the model type when the tokenizer has none), or decoded whole when there is neither.
"""

from __future__ import annotations

import copy
import inspect
import json
import queue
import threading
from concurrent.futures import Future
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from dflash_cache.errors import DFlashCacheError, first_line
from dflash_cache.extract.info import read_target_info
from dflash_cache.loading_bars import no_loading_bars
from dflash_cache.regenerate.client import RequestFailed
from dflash_cache.regenerate.conversations import Completion
from dflash_cache.regenerate.settings import GenerationSettings


def _response_template(tokenizer, model) -> dict | None:
    try:  # the per-model-type fallbacks live with transformers serve
        from transformers.cli.serving.utils import get_response_template
    except ImportError:
        return getattr(tokenizer, "response_template", None)
    # Its second parameter was the model, and is the model's config in later transformers releases.
    wants_config = "config" in inspect.signature(get_response_template).parameters
    return get_response_template(tokenizer, model.config if wants_config else model)


class _Stopped(StoppingCriteria):
    """Ends a generation part-way once the run stops, so its thread can be joined."""

    def __init__(self, stop: threading.Event):
        self.stop = stop

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.stop.is_set(), dtype=torch.bool, device=input_ids.device)


class _Replica:
    def __init__(self, path: Path, device: str, stop: threading.Event):
        self.device = device
        self.stop = stop
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        with no_loading_bars():
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype="auto", local_files_only=True).to(device).eval()
        self.template = _response_template(self.tokenizer, self.model)

    @torch.inference_mode()
    def generate(self, messages: list[dict], settings: GenerationSettings, model_name: str) -> Completion:
        inputs = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
            **settings.template_kwargs())
        config = copy.deepcopy(self.model.generation_config)
        config.max_new_tokens = settings.max_tokens
        config.do_sample = settings.temperature > 0
        if config.do_sample:
            config.temperature = settings.temperature
        prompt = inputs["input_ids"].to(self.device)
        output = self.model.generate(input_ids=prompt, attention_mask=inputs["attention_mask"].to(self.device),
                                     generation_config=config, stopping_criteria=StoppingCriteriaList([_Stopped(self.stop)]))
        generated = output[0, prompt.shape[1]:].tolist()
        content, reasoning, tool_calls = self._parse(generated, prompt[0].tolist())
        finish = "tool_calls" if tool_calls else "length" if len(generated) >= settings.max_tokens else "stop"
        return Completion(content, reasoning, tool_calls, finish, len(generated), model_name)

    def _parse(self, generated: list[int], prompt: list[int]) -> tuple[str, str | None, list[dict] | None]:
        if self.template is None:
            return self.tokenizer.decode(generated, skip_special_tokens=True), None, None
        parsed = self.tokenizer.parse_response(generated, self.template, prefix=self.tokenizer.decode(prompt))
        calls = []
        for i, call in enumerate(parsed.get("tool_calls") or []):
            function = call["function"]
            arguments = function["arguments"]
            calls.append({"id": f"call_{i}", "type": "function", "function": {
                "name": function["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
        return parsed.get("content", ""), parsed.get("thinking") or None, calls or None


class LocalTarget:
    def __init__(self, path: str | Path, devices: list[str]):
        self.name = str(path)
        info = read_target_info(path)
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._replicas = [_Replica(info.path, device, self._stop) for device in devices]
        self._threads = [threading.Thread(target=self._serve, args=(replica,), name=f"regenerate-{replica.device}", daemon=True)
                         for replica in self._replicas]
        for thread in self._threads:
            thread.start()

    def _serve(self, replica: _Replica) -> None:
        while (item := self._queue.get()) is not None:
            messages, settings, future = item
            try:
                completion = None if self._stop.is_set() else replica.generate(messages, settings, self.name)
                if self._stop.is_set():  # cut short or never started: not an answer
                    raise RequestFailed(f"{replica.device}: the run was stopped")
                future.set_result(completion)
            except RequestFailed as e:
                future.set_exception(e)
            except (DFlashCacheError, ValueError, TypeError, RuntimeError) as e:  # this conversation's problem
                future.set_exception(RequestFailed(f"{replica.device}: {type(e).__name__}: {first_line(e)}"))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting request, never lost with the thread
                future.set_exception(e)

    def complete(self, messages: list[dict], settings: GenerationSettings, lane: int) -> Completion:
        future: Future = Future()
        self._queue.put((messages, settings, future))
        return future.result()

    def close(self) -> None:
        # A thread left generating when the interpreter exits aborts the process (a C++ "terminate
        # called without an active exception" on Ctrl-C): stop the generations and join the threads.
        self._stop.set()
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
