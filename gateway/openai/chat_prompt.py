"""A chat request's prompt: its checks, its tools and response format, and its token ids —
the steps ``/v1/chat/completions`` and ``/v1/responses`` (which serves a chat request,
:mod:`gateway.openai.responses_input`) share before :func:`gateway.openai.respond.respond`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fastapi import Request

from gateway.core.errors import APIError, invalid_request
from gateway.core.security import Principal
from gateway.openai.generation import response_format_param
from gateway.openai.respond import record_refusal
from gateway.openai.schemas import ChatCompletionRequest
from gateway.openai.tools import ToolPlan, call_names, grammar_param, prompt_messages, tool_format, tool_plan
from gateway.openai.translate import (
    requested_logprobs, resolve_model, response_format, template_messages, vllm_format_field,
)
from runtime.interface import Backend, GrammarError, ResponseFormat


def _same(param: str | None) -> str | None:
    return param


@dataclass
class ChatPrompt:
    """What :func:`chat_prompt` found.

    Attributes:
        model: the served model's name (:func:`gateway.openai.translate.resolve_model`).
        prompt_ids: the templated conversation's token ids.
        plan: the request's tools (:func:`gateway.openai.tools.tool_plan`; None: plain text).
        constraint: the runtime format of the reply (tool calls or JSON; None: free text).
        num_top: top logprobs per token (None: no logprobs).
        grammar_param: where a refusal of ``constraint`` points in the request.
    """

    model: str
    prompt_ids: list[int]
    plan: ToolPlan | None
    constraint: ResponseFormat | None
    num_top: int | None
    grammar_param: Callable[[GrammarError], str | None]


def chat_prompt(request: Request, principal: Principal, body: ChatCompletionRequest, backend: Backend,
                endpoint: str = "chat", param_of: Callable[[str | None], str | None] = _same,
                request_id: str | None = None) -> ChatPrompt:
    """Check ``body``'s logprobs, response format, model and tools, and template its messages.

    ``param_of`` rewrites the ``param`` of every error (and of a refused grammar) into the
    caller's request shape; ``endpoint`` and ``request_id`` are those of the ``rejected``
    record a refused tool, ``tool_choice`` or tool message leaves
    (:func:`gateway.openai.respond.record_refusal`).

    Raises:
        APIError: 400 for what :func:`gateway.openai.translate.requested_logprobs`,
            :func:`~gateway.openai.translate.response_format`,
            :func:`~gateway.openai.tools.tool_plan`, :func:`~gateway.openai.tools.call_names` and
            :func:`~gateway.openai.translate.template_messages` refuse, or messages the chat
            template refuses; 404 for an unknown model.
    """
    refusal = False  # while True, a refusal leaves a rejected record (tools, tool_choice, tool messages)
    try:
        num_top = requested_logprobs(body, backend.info)
        structured = response_format(body, backend.info)
        model = resolve_model(body.model, backend.info, [request.app.state.settings.model_name])
        refusal = True
        plan = tool_plan(body)
        names = call_names(body.messages)
        constraint = tool_format(plan, backend.info, structured) if plan is not None else structured
        refusal = False
        messages, tools = prompt_messages(template_messages(body.messages, names), plan, backend.info)
        try:
            prompt_ids = (backend.apply_chat_template(messages) if tools is None
                          else backend.apply_chat_template(messages, tools=tools))
        except ValueError as exc:
            raise invalid_request(f"Invalid messages: {exc}", "messages", "invalid_value") from None
    except APIError as exc:
        old, exc.param = exc.param, param_of(exc.param)
        if old is not None and exc.param != old:  # the message names the param as the caller spells it
            exc.message = exc.message.replace(f"'{old}'", f"'{exc.param}'")
        if refusal:
            record_refusal(request, principal, body, endpoint, exc, request_id)
        raise
    vllm = vllm_format_field(body)
    if plan is not None:
        param = grammar_param(plan)
    elif vllm is not None:  # a vLLM field's schema: its faults point into that field
        def param(exc, vllm=vllm):
            return vllm if exc.param is None or vllm.endswith("json_object") else f"{vllm}.{exc.param}"
    else:
        param = response_format_param
    return ChatPrompt(model, prompt_ids, plan, constraint, num_top, lambda exc: param_of(param(exc)))
