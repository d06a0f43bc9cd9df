"""msgspec types of the OpenAI-compatible API: request bodies, responses, stream chunks, errors.

Request fields are optional and nullable where the OpenAI API allows it; unknown fields are
ignored, as OpenAI-compatible servers do. Defaults are applied in `server.sampling`.

Response fields typed `... | UnsetType = UNSET` are left out of the JSON unless set: choices
carry `draft_logprobs` only for requests that ask for them.
"""

from __future__ import annotations

from typing import Any

import msgspec

# ----------------------------------------------------------------------------------- requests


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False


class SpeculativeOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The body field `speculative`: this request's own speculation setting."""

    num_speculative_tokens: int | None = None  # null: the server's number; 0: no speculation


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields both generation endpoints share: sampling, stopping, penalties, vLLM's extras,
    `speculative` and `include_draft_logprobs`."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    speculative: SpeculativeOptions | None = None
    include_draft_logprobs: bool | None = None  # each choice lists its drafts' logprobs (`draft_logprobs`)


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions."""

    # A string, a list of strings, a list of token ids or a list of lists of token ids.
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16  # null: up to the context length
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # null: up to the context length
    max_completion_tokens: int | None = None  # takes precedence over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None


# ---------------------------------------------------------------------------------- responses


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculateMetricsInfo(msgspec.Struct):
    """What speculation did for a response, all its choices (and prompts) together."""

    num_steps: int  # decode steps through the verifier
    num_draft_tokens: int
    num_accepted_tokens: int  # accepted drafts
    num_emitted_tokens: int  # accepted drafts plus bonus tokens
    acceptance_rate: float  # accepted / drafted
    mean_acceptance_length: float  # emitted / steps
    accepted_per_position: list[int]  # accepted drafts at each draft position


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for the first prompt token when echoing
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # character offset of each token in the choice's text


class CompletionDraftLogprobs(CompletionLogprobs):
    """Proposed drafts in the legacy format, with the verifier's verdict on each and, where a draft
    model (an MTP head) made them, its own logprob of each (None for a draft it did not make)."""

    accepted: list[bool]
    draft_token_logprobs: list[float | None] | msgspec.UnsetType = msgspec.UNSET


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    draft_logprobs: CompletionDraftLogprobs | msgspec.UnsetType = msgspec.UNSET  # when asked for


class CompletionResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str  # "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculate_metrics: SpeculateMetricsInfo | None = None  # only when the server speculates


class CompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str  # "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # only on the final usage chunk
    speculate_metrics: SpeculateMetricsInfo | None = None  # only on the stream's last chunk


# One of each per emitted token and top alternative: gc=False makes them cheaper to create, and
# they hold no reference cycles (strings, floats and the shared byte lists of TokenText).
class TopLogprob(msgspec.Struct, gc=False):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct, gc=False):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: msgspec.Raw  # [ChatTokenLogprob, ...], rendered by the engine (cupyspec/logprobs/logprob_json.py)


class ChatDraftTokenLogprob(ChatTokenLogprob):
    """A proposed draft token with the verifier's verdict and, where a draft model (an MTP head)
    made it, the draft model's own logprob of it."""

    accepted: bool
    draft_logprob: float | msgspec.UnsetType = msgspec.UNSET


class ChatDraftLogprobs(msgspec.Struct):
    content: list[ChatDraftTokenLogprob]


class AssistantMessage(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    draft_logprobs: ChatDraftLogprobs | msgspec.UnsetType = msgspec.UNSET  # when asked for


class ChatCompletionResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str  # "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculate_metrics: SpeculateMetricsInfo | None = None  # only when the server speculates


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    draft_logprobs: ChatDraftLogprobs | msgspec.UnsetType = msgspec.UNSET  # when asked for


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str  # "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only on the final usage chunk
    speculate_metrics: SpeculateMetricsInfo | None = None  # only on the stream's last chunk


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "cupyspec"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo
