"""Tools and reasoning for /v1/chat/completions: how a request's tools reach the prompt and the
grammar, and how the output is split back into content, reasoning_content and tool_calls.

- Prompt: the tools go to the chat template (`tools=`); a template that ignores them gets a
  system prompt describing them in the format the tool-call parser reads (hermes or llama3).
- tool_choice "none": tools are neither shown nor parsed. "auto": parsed from free text.
  "required" / a named function: a JSON-schema grammar forces `[{"name", "arguments"}, ...]`
  (one call unless parallel_tool_calls), parsed as such.
- Output: reasoning first (with --reasoning-parser), then tool calls in what remains.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaMessage,
    FunctionCall,
    NamedToolChoice,
    TextContentPart,
    Tool,
    ToolCall,
)
from radixserve.entrypoints.openai.reasoning import ReasoningStream, reasoning_token_count, split_reasoning
from radixserve.entrypoints.openai.tool_calls import (
    HERMES_END,
    HERMES_START,
    ToolCallStream,
    parse_tool_calls,
    resolve_parser,
)


@dataclass
class ChatPlan:
    """What the chat handler decided for one request."""

    input_ids: list[int]
    tool_format: str | None = None  # hermes | llama3 | json_array; None: no tool parsing
    reasoning_parser: str | None = None
    sampling_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. the forcing grammar


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ----------------------------------------------------------------------------- request side
def plan_chat(req: ChatCompletionRequest, tokenizer: Any, server_args: Any) -> tuple[str, ChatPlan]:  # noqa: ANN401
    """(prompt text, plan). Raises ValueError (-> 400) on an inconsistent tool request."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise ValueError("tool_choice needs 'tools'.")
    active = tools if choice != "none" else []
    fmt = resolve_parser(server_args.tool_call_parser) if active else None
    plan = ChatPlan(input_ids=[], tool_format=fmt)
    if req.separate_reasoning and server_args.reasoning_parser:
        plan.reasoning_parser = server_args.reasoning_parser
    if active and (choice == "required" or isinstance(choice, NamedToolChoice)):
        if req.response_format is not None or req.regex or req.ebnf or req.json_schema or req.structural_tag:
            raise ValueError(
                "tool_choice 'required' or a named function cannot be combined with another grammar."
            )
        schema = forced_calls_schema(active, choice, req.parallel_tool_calls)
        plan.sampling_overrides["json_schema"] = json.dumps(schema)
        plan.tool_format = "json_array"
    messages = [_message_dict(m) for m in req.messages]
    prompt = render_prompt(
        tokenizer, messages, active, fmt, req.add_generation_prompt, req.continue_final_message
    )
    return prompt, plan


def forced_calls_schema(tools: list[Tool], choice: Any, parallel: bool) -> dict[str, Any]:  # noqa: ANN401
    """A JSON schema for `[{"name": <tool>, "arguments": <its parameters>}, ...]`."""
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name")
        tools = [t for t in tools if t.function.name == name]
        if not tools:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in 'tools'.")
        parallel = False
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": _template_content(m)}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        d["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments_obj(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    return d


def _template_content(m: ChatMessage) -> str | list[dict[str, Any]]:
    """A message's content as chat templates take it: a string, or (with images) the parts in
    order, each image as {"type": "image"} (what a VLM's template, e.g. Qwen2.5-VL's, renders as
    its image placeholder; the image itself travels in image_data)."""
    if not m.image_urls():
        return m.text()
    assert isinstance(m.content, list)
    return [
        {"type": "text", "text": p.text} if isinstance(p, TextContentPart) else {"type": "image"}
        for p in m.content
    ]


def _arguments_obj(arguments: str | None) -> Any:  # noqa: ANN401
    # Templates (Qwen, Llama 3) render arguments with tojson: a dict renders as JSON, not a quoted string.
    try:
        return json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return arguments


def render_prompt(
    tokenizer: Any,  # noqa: ANN401
    messages: list[dict[str, Any]],
    tools: list[Tool],
    fmt: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("The model has no chat template; pass --chat-template.")

    def render(msgs: list[dict[str, Any]], tool_dicts: list[dict[str, Any]] | None) -> str:
        return tokenizer.apply_chat_template(
            msgs,
            tools=tool_dicts,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
        )

    if not tools:
        return render(messages, None)
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools]
    with_tools = render(messages, tool_dicts)
    if with_tools != render(messages, None):
        return with_tools  # the template knows tools
    return render(_inject_tool_prompt(messages, tools, fmt or "hermes"), None)


def tool_system_prompt(tools: list[Tool], fmt: str) -> str:
    specs = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
    if fmt == "llama3":
        how = (
            'To call a function, reply with only a JSON object {"name": <function name>, '
            '"parameters": <arguments object>}.'
        )
    else:
        how = (
            "For each function call, return a JSON object with the function name and arguments "
            f'within {HERMES_START}{HERMES_END} tags:\n{HERMES_START}\n{{"name": <function-name>, '
            f'"arguments": <args-json-object>}}\n{HERMES_END}'
        )
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{specs}\n</tools>\n\n{how}"
    )


def _inject_tool_prompt(messages: list[dict[str, Any]], tools: list[Tool], fmt: str) -> list[dict[str, Any]]:
    """For templates without tool support: tools in the system prompt, earlier calls as text."""
    prompt = tool_system_prompt(tools, fmt)
    out = [dict(m) for m in messages]
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            text = "".join(
                f"{HERMES_START}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}\n{HERMES_END}"
                for c in calls
            )
            m["content"] = (m.get("content") or "") + text
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


# ----------------------------------------------------------------------------- response side
@dataclass
class ChoiceResult:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall] | None


def split_output(text: str, plan: ChatPlan) -> ChoiceResult:
    reasoning = None
    if plan.reasoning_parser:
        reasoning, text = split_reasoning(text, plan.reasoning_parser)
    if plan.tool_format is None:
        return ChoiceResult(text, reasoning, None)
    content, calls = parse_tool_calls(text, plan.tool_format)
    tool_calls = [
        ToolCall(index=None, id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]
    return ChoiceResult(content or (None if tool_calls else content), reasoning, tool_calls or None)


class ChoiceStream:
    """Turns one choice's growing text into OpenAI deltas (reasoning, content, tool calls)."""

    def __init__(self, plan: ChatPlan) -> None:
        self.reasoning = ReasoningStream.for_parser(plan.reasoning_parser) if plan.reasoning_parser else None
        self.tools = ToolCallStream(plan.tool_format) if plan.tool_format else None
        self.answer = ""  # the content part of the text (after reasoning) seen so far
        self.call_ids: dict[int, str] = {}

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.call_ids)

    def feed(self, text: str, final: bool) -> DeltaMessage | None:
        reasoning_delta = ""
        answer_delta = text
        if self.reasoning is not None:
            reasoning_delta, answer_delta = self.reasoning.feed(text, final)
        else:
            answer_delta = text[len(self.answer) :]
        self.answer += answer_delta
        content, calls = answer_delta, []
        if self.tools is not None:
            content, deltas = self.tools.feed(self.answer, final)
            calls = [self._tool_call(d.index, d.name, d.arguments) for d in deltas]
        if not (reasoning_delta or content or calls):
            return None
        return DeltaMessage(
            content=content or None, reasoning_content=reasoning_delta or None, tool_calls=calls or None
        )

    def _tool_call(self, index: int, name: str | None, arguments: str) -> ToolCall:
        if name is not None:
            self.call_ids[index] = new_call_id()
            return ToolCall(
                index=index,
                id=self.call_ids[index],
                type="function",
                function=FunctionCall(name=name, arguments=arguments),
            )
        return ToolCall(index=index, type=None, function=FunctionCall(arguments=arguments))


def choice_reasoning_tokens(output: dict[str, Any], plan: ChatPlan, tokenizer: Any) -> int:  # noqa: ANN401
    """One finished choice's reasoning tokens (0 without a reasoning parser)."""
    if plan.reasoning_parser is None:
        return 0
    return reasoning_token_count(output["text"], output["output_ids"], plan.reasoning_parser, tokenizer)
