"""The generation settings: what a request asks for, and what every output record carries.

A resumed run must ask for what the existing records were made with, or its file would mix two
datasets; `differences` names what changed. The model is not among these settings: it is what the
server (or the target directory) says it is, and is checked against the file as answers arrive.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dflash_cache.errors import DFlashCacheError

REASONING = ("auto", "on", "off")
TURNS = ("all", "last")


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int = 4096
    temperature: float = 0.0
    reasoning: str = "auto"  # auto: the chat template's default; on/off: enable_thinking true/false
    turns: str = "all"  # all: every assistant turn, in order; last: only the last one
    chat_template_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise DFlashCacheError(f"--max-tokens must be at least 1, not {self.max_tokens}")
        if self.temperature < 0:
            raise DFlashCacheError(f"--temperature must be 0 or more, not {self.temperature}")
        if self.reasoning not in REASONING:
            raise DFlashCacheError(f"--reasoning must be one of {', '.join(REASONING)}, not {self.reasoning!r}")
        if self.turns not in TURNS:
            raise DFlashCacheError(f"--turns must be one of {', '.join(TURNS)}, not {self.turns!r}")
        if not isinstance(self.chat_template_kwargs, dict):
            raise DFlashCacheError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
        thinking = self.chat_template_kwargs.get("enable_thinking")
        wanted = {"on": True, "off": False}.get(self.reasoning)
        if thinking is not None and wanted is not None and thinking != wanted:
            raise DFlashCacheError(
                f"--reasoning {self.reasoning} contradicts enable_thinking={thinking} in --chat-template-kwargs; give one of them"
            )

    def template_kwargs(self) -> dict:
        """What the chat template is rendered with: the given kwargs, plus enable_thinking for on/off."""
        kwargs = dict(self.chat_template_kwargs)
        if self.reasoning != "auto":
            kwargs["enable_thinking"] = self.reasoning == "on"
        return kwargs

    def to_dict(self) -> dict:
        return asdict(self)


def differences(recorded: dict, settings: GenerationSettings) -> list[str]:
    """'name: recorded -> now' for each setting that differs from a record's (minus the model)."""
    now = settings.to_dict()
    then = {key: value for key, value in recorded.items() if key != "model"}
    return [
        f"{key}: {then.get(key, '(absent)')!r} -> {now.get(key, '(absent)')!r}"
        for key in sorted(set(now) | set(then))
        if then.get(key) != now.get(key)
    ]
