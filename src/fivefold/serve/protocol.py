"""The OpenAI-compatible request bodies (pydantic, as FastAPI reads them) and the error body; what the server
accepts of OpenAI's API: prompt as text or token ids, messages, max_tokens, temperature, top_p, stop, seed, stream."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # other OpenAI fields (user, logit_bias, ...) are accepted, unused

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionBody(SamplingFields):
    prompt: str | list[int] | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str


class ChatBody(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


def error_body(message: str, param: str | None, kind: str, code: int) -> dict:
    """OpenAI's error object: the client raises BadRequestError, RateLimitError, ... from it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
