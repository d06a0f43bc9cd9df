"""Request bodies to engine inputs: SamplingParams, prompts and chat messages, with the checks
the engine does not make (unsupported OpenAI features, field combinations)."""

from __future__ import annotations

from cupyspec.errors import InvalidRequestError
from cupyspec.sampling.params import SamplingParams
from cupyspec.server.errors import APIError
from cupyspec.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields

Prompt = str | list[int]

# OpenAI's roles and the ones the chat template understands; `developer` is the newer `system`.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _invalid(message: str, param: str) -> APIError:
    return APIError(400, message, param)


def _sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None = None, render_logprobs: bool = False) -> SamplingParams:
    """The shared fields of both endpoints; SamplingParams raises InvalidRequestError on bad values."""
    if req.logit_bias:
        raise _invalid("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise _invalid("stream_options is only allowed when stream is true", "stream_options")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        n=1 if req.n is None else req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_draft_logprobs=bool(req.include_draft_logprobs),
        render_logprobs=render_logprobs,
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
    )


def completion_params(req: CompletionRequest) -> SamplingParams:
    """SamplingParams of a completions request; `echo` with `logprobs` asks for prompt logprobs."""
    if req.suffix:
        raise _invalid("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != (1 if req.n is None else req.n):
        raise _invalid("best_of must be absent or equal to n", "best_of")
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    return _sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)


def completion_prompts(req: CompletionRequest) -> list[Prompt]:
    """The prompts of a completions request, each a string or a list of token ids."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise _invalid("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    if all(isinstance(p, list) for p in prompt):
        if not all(prompt):
            raise _invalid("a token-id prompt must not be empty", "prompt")
        return list(prompt)  # type: ignore[arg-type]
    raise _invalid("prompt must be a string, a list of strings, a list of token ids "
                   "or a list of lists of token ids", "prompt")


def chat_params(req: ChatCompletionRequest) -> SamplingParams:
    """SamplingParams of a chat request; `logprobs` + `top_logprobs` become SamplingParams.logprobs."""
    if req.top_logprobs is not None and not req.logprobs:
        raise _invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise _invalid("response_format other than text is not supported", "response_format")
    if req.tools:
        raise _invalid("tools are not supported", "tools")
    if req.tool_choice not in (None, "none", "auto"):
        raise _invalid("tool_choice is not supported", "tool_choice")
    use_completion_tokens = req.max_completion_tokens is not None
    max_tokens = req.max_completion_tokens if use_completion_tokens else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    try:
        return _sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, render_logprobs=True)
    except InvalidRequestError as exc:  # name the chat field the client used
        renamed = {"logprobs": "top_logprobs",
                   "max_tokens": "max_completion_tokens" if use_completion_tokens else "max_tokens"}
        param = renamed.get(exc.param or "", exc.param)
        raise InvalidRequestError(str(exc).replace(exc.param or "", param or "", 1), param) from None


def _message_text(message: ChatMessage, param: str) -> str:
    content = message.content
    if content is None:
        if message.role == "assistant":
            return ""
        raise _invalid(f"a {message.role} message needs content", f"{param}.content")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise _invalid(f"content parts of type {part.type!r} are not supported (only text)",
                           f"{param}.content[{j}].type")
        if part.text is None:
            raise _invalid("a text content part needs text", f"{param}.content[{j}].text")
        texts.append(part.text)
    return "".join(texts)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The conversation as `{"role", "content"}` dicts for the chat template."""
    if not req.messages:
        raise _invalid("messages must not be empty", "messages")
    messages = []
    for i, message in enumerate(req.messages):
        param = f"messages[{i}]"
        role = _ROLES.get(message.role)
        if role is None:
            raise _invalid(f"role {message.role!r} is not supported (system, developer, user, assistant)",
                           f"{param}.role")
        messages.append({"role": role, "content": _message_text(message, param)})
    return messages
