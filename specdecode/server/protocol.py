"""OpenAI request schemas, their validation into :class:`SamplingParams`, and the error shape.

Requests are validated strictly: unknown fields, wrong JSON types (``"1"`` or ``true`` for a
number) and out-of-range values are rejected with a 400 naming the parameter, in OpenAI's error
shape ``{"error": {"message", "type", "param", "code"}}``. Parameters we do not implement
(``echo``, ``best_of``) are accepted only at their neutral value.

``n`` (1..``MAX_CHOICES``): that many independent samples of the prompt, as that many requests to the
scheduler, which together get one request's share of the slots (:func:`specdecode.server.scheduler.fair_pick`;
those admitted together, the target prefills the prompt once and copies its cache to the others:
:meth:`Engine.prefill`); with a ``seed``, choice ``i`` draws with ``seed + i``, so the choices differ and
each is reproducible alone. Greedy choices are identical.

Log-probabilities as OpenAI's: completions ``logprobs`` (0..5), chat ``logprobs: true`` with ``top_logprobs``
(0..20); the target's, under the law of :mod:`specdecode.logprobs`.

``logit_bias`` (token ids as strings -> [-100, 100]; an id outside the vocabulary is the engine's 400),
``presence_penalty`` and ``frequency_penalty`` ([-2, 2], over the generated tokens) work as OpenAI's,
under speculation too, exactly (:mod:`specdecode.processors`).

Extensions beyond the OpenAI API (vLLM's names): ``min_p`` ([0, 1]; 0 = off), ``repetition_penalty``
([0.5, 2], over prompt + generated tokens; 1 = off), ``top_k`` (``0`` or ``-1`` = off; any value at or above the
vocabulary size keeps every token, as off), ``ignore_eos``, ``speculation: false`` to decode this
request without a draft, ``sampler`` (``rejection`` | ``coupled``: how this sampled request draws,
by default the server's ``--sampler``; coupled makes a seeded request's tokens independent of the
drafter and the batch, see :mod:`specdecode.verify.coupled`), and on completions ``fim_stop`` (``none`` | ``line`` | ``block``: an editor's
stop rule for a fill-in-the-middle request, ``block`` when it names none, see :mod:`specdecode.fim`). A ``temperature`` below
``sampling.GREEDY_TEMPERATURE`` (1e-5) is greedy.

Structured outputs (:mod:`specdecode.grammar`, exact under speculation): OpenAI's ``response_format``
(``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema",
"strict"}}``), or the extensions ``regex`` (the whole output matches it) and ``grammar`` (llguidance's Lark-like
syntax or a llama.cpp GBNF grammar): at most one of them (a ``text`` response_format counts as none), not with
``ignore_eos``; ``json_whitespace`` (``bounded``, the default: llama.cpp's one space or 1-2 newlines and up to 20
indent characters between JSON tokens; ``flexible``; ``compact``) with a JSON response_format only. A spec the
engine cannot compile, or one over a bound of :class:`specdecode.grammar_bounds.GrammarLimits`, is a 400 naming its
field (code ``invalid_grammar``), with the engine's message or the bound.

A completions request with a ``suffix`` (any string, ``""`` included: the cursor at the end of a
file) is fill-in-the-middle: ``prompt`` is the text before the cursor (``""`` allowed: the start of a
file), ``suffix`` the text after it; without ``suffix`` (or ``null``) it is a plain completion.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from specdecode.grammar import GrammarError, GrammarSpec
from specdecode.logprobs import LOGPROBS_MAX
from specdecode.sampling import SamplingError, SamplingParams
from specdecode.text import MAX_STOP_CHARS

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n: every choice is a request of its own in the scheduler
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint


class APIError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # default 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Any = None  # str | list[str]; checked by stop_strings() for a clear message
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None  # checked by logit_bias() for a clear message
    min_p: float | None = None
    repetition_penalty: float | None = None
    user: str | None = None
    ignore_eos: bool = False
    speculation: bool = True
    sampler: Literal["rejection", "coupled"] | None = None  # None: the server's --sampler
    response_format: Any = None  # OpenAI's object; checked by grammar_spec() for a clear message
    regex: str | None = None  # extension: the output matches this regex
    grammar: str | None = None  # extension: a Lark-like or GBNF grammar the output follows
    json_whitespace: Literal["bounded", "flexible", "compact"] | None = None  # extension: JSON outputs' whitespace

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Any  # str | list[int] | [str] | [list[int]]; checked by prompt_input()
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None  # set: fill-in-the-middle (see fim_input)
    fim_stop: Literal["none", "line", "block"] | None = None  # with a suffix, None is fim.DEFAULT_FIM_STOP


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(x) for x in err["loc"]]
        param = ".".join(loc) if loc else None
        if err["type"] == "missing":
            raise bad_request(f"missing required parameter {param!r}", param) from None
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unrecognized request argument {param!r}", param) from None
        raise bad_request(f"invalid value for {param!r}: {err['msg']}", param) from None


# -- prompts ------------------------------------------------------------------------------------
def _is_token_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def prompt_input(prompt: Any) -> str | list[int]:
    """The one prompt of a completions request: text, or token ids (range-checked by the engine)."""
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_token_list(prompt[0])):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("the prompt is empty", "prompt")
        return prompt
    if _is_token_list(prompt):
        if not prompt:
            raise bad_request("the prompt is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("batched prompts are not supported: send one prompt per request", "prompt")
    raise bad_request("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


def fim_input(req: CompletionRequest) -> tuple[str, str] | None:
    """``(prefix, suffix)`` of a fill-in-the-middle request (one with a ``suffix``), else None."""
    if req.suffix is None:
        if req.fim_stop not in (None, "none"):
            raise bad_request(
                "'fim_stop' applies to fill-in-the-middle requests: send 'suffix' too ('' at the end of a file)",
                "fim_stop",
            )
        return None
    prompt = req.prompt[0] if isinstance(req.prompt, list) and len(req.prompt) == 1 else req.prompt
    if not isinstance(prompt, str):
        raise bad_request("with 'suffix', 'prompt' must be the text before the cursor (a string)", "prompt")
    return prompt, req.suffix


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    if not req.messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    return [{"role": m.role, "content": m.text()} for m in req.messages]


# -- sampling -----------------------------------------------------------------------------------
def _unsupported(req: SamplingFields) -> None:
    neutral = {}
    if isinstance(req, CompletionRequest):
        neutral |= {"echo": (req.echo, (None, False)), "best_of": (req.best_of, (None, 1))}
    for name, (value, allowed) in neutral.items():
        if value not in allowed:
            shown = " or ".join(repr(a) for a in allowed if a is not None) or "null"
            raise bad_request(
                f"'{name}' is not supported by this server (only {shown} is accepted)", name, "unsupported"
            )


def stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are supported", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def logit_bias(bias: dict[str, Any] | None) -> tuple[tuple[int, Any], ...]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys, strings) -> values, checked by SamplingParams
    ([-100, 100])."""
    out = []
    for key, value in (bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            tok = -1
        if tok < 0 or str(tok) != key.strip():
            raise bad_request(
                f"'logit_bias' keys must be token ids (integers >= 0 as strings), got {key!r}", "logit_bias"
            )
        out.append((tok, value))
    return tuple(out)


GRAMMAR_PARAMS = {"json_schema": "response_format", "regex": "regex", "grammar": "grammar"}  # GrammarSpec.kind -> field


def grammar_spec(req: SamplingFields) -> GrammarSpec | None:
    """The request's structured-output spec: ``response_format``, ``regex`` or ``grammar`` (at most one).
    Shape errors are 400s here; compile errors are the engine's (:func:`grammar_param` names the field)."""
    given = [
        name
        for name in ("response_format", "regex", "grammar")
        if getattr(req, name) is not None
        and not (
            name == "response_format"
            and isinstance(req.response_format, dict)
            and req.response_format.get("type") == "text"
        )
    ]
    if len(given) > 1:
        raise bad_request(
            f"at most one of 'response_format', 'regex' and 'grammar' may be given, got "
            f"{' and '.join(repr(g) for g in given)}",
            given[-1],
        )
    if not given:
        if req.json_whitespace is not None:
            raise bad_request("'json_whitespace' applies to a JSON response_format only", "json_whitespace")
        return None
    name = given[0]
    whitespace = req.json_whitespace or "bounded"
    build = {
        "response_format": lambda obj: GrammarSpec.from_response_format(obj, whitespace),
        "regex": GrammarSpec.regex,
        "grammar": GrammarSpec.grammar,
    }[name]
    try:
        spec = build(getattr(req, name))
    except GrammarError as exc:
        raise bad_request(str(exc), name) from None
    if req.json_whitespace is not None and spec.kind != "json_schema":
        raise bad_request("'json_whitespace' applies to a JSON response_format only", "json_whitespace")
    if req.ignore_eos:
        raise bad_request(
            "'ignore_eos' cannot be combined with a structured output (response_format, regex or "
            "grammar): the output ends where the grammar is complete",
            "ignore_eos",
        )
    return spec


def grammar_param(spec: GrammarSpec) -> str:
    """The request field a spec came from (``json_schema`` specs: ``response_format``)."""
    return GRAMMAR_PARAMS[spec.kind]


def choices(req: SamplingFields) -> int:
    """``n``, checked: how many choices the request asks for."""
    if req.n is None:
        return 1
    if isinstance(req.n, bool) or not 1 <= req.n <= MAX_CHOICES:
        raise bad_request(f"'n' must be an integer in [1, {MAX_CHOICES}], got {req.n!r}", "n")
    return req.n


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The parameters of each of ``n`` choices: choice ``i`` of a seeded request draws with ``seed + i``
    (wrapped into the 64-bit range), an unseeded one with fresh entropy each."""
    if params.seed is None:
        return [params] * n
    return [
        replace(params, seed=params.seed + i if params.seed + i < 2**64 else params.seed + i - 2**64) for i in range(n)
    ]


def sampling_params(
    req: SamplingFields, max_tokens: int | None, default_max_tokens: int, fim: dict | None = None
) -> SamplingParams:
    """Validated :class:`SamplingParams` for a request (context length is checked by the engine);
    ``fim``: a fill-in-the-middle request's stop fields (:func:`specdecode.fim.stop_fields`), whose
    stop strings join the request's."""
    _unsupported(req)
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    if top_k < 0:
        raise bad_request(f"'top_k' must be an integer >= 0 (0 or -1 = off), got {req.top_k}", "top_k")
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif max_tokens < 1:
        raise bad_request(f"'max_tokens' must be an integer >= 1, got {max_tokens}", "max_tokens")
    # the numbers' ranges are SamplingParams' (one validator for the library, the CLI and the server): an
    # absent field is its default (temperature 1, as OpenAI), a present one is passed as sent
    given = {name: getattr(req, name) for name in _SAMPLING_NUMBERS if getattr(req, name) is not None}
    processing = {
        "logit_bias": logit_bias(req.logit_bias),
        "logprobs": requested_logprobs(req),  # (what is reported, not a processor)
    }
    fim = dict(fim or {})
    stop = stop_strings(req.stop)
    stop += tuple(s for s in fim.pop("stop", ()) if s not in stop)
    grammar = grammar_spec(req)
    try:
        return SamplingParams(
            **({"temperature": 1.0} | given),
            top_k=top_k,
            seed=req.seed,
            max_new_tokens=max_tokens,
            stop=stop,
            ignore_eos=req.ignore_eos,
            sampler=req.sampler,
            grammar=grammar,
            speculation=req.speculation,
            **processing,
            **fim,
        )
    except SamplingError as exc:  # a 400 naming the request's field
        raise bad_request(str(exc), _SAMPLING_PARAM.get(exc.param, exc.param)) from None


# request fields passed to SamplingParams as sent (its validator checks them), and its field names that differ
_SAMPLING_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_SAMPLING_PARAM = {"max_new_tokens": "max_tokens", "stop_token_ids": "suffix", "stop_dedent": "fim_stop"}


COMPLETIONS_MAX_LOGPROBS = 5  # OpenAI's legacy completions range; chat's top_logprobs goes to LOGPROBS_MAX (20)


def requested_logprobs(req: SamplingFields) -> int | None:
    """How many top entries to report per token (None: no logprobs): completions ``logprobs`` in [0, 5];
    chat ``top_logprobs`` in [0, 20], which needs ``logprobs: true`` (OpenAI's rule)."""
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None and not 0 <= req.logprobs <= COMPLETIONS_MAX_LOGPROBS:
            raise bad_request(
                f"'logprobs' must be an integer in [0, {COMPLETIONS_MAX_LOGPROBS}], got {req.logprobs}", "logprobs"
            )
        return req.logprobs
    top = req.top_logprobs
    if top is not None and not 0 <= top <= LOGPROBS_MAX:
        raise bad_request(f"'top_logprobs' must be an integer in [0, {LOGPROBS_MAX}], got {top}", "top_logprobs")
    if not req.logprobs:
        if top:  # (0 is accepted without it, as vLLM does)
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def requested_max_tokens(req: SamplingFields) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise bad_request("'max_tokens' and 'max_completion_tokens' disagree", "max_completion_tokens")
        return req.max_completion_tokens
    return req.max_tokens
