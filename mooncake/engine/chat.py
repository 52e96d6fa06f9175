"""A chat as vLLM's server (0.32) reads it before its chat template, so that a prompt rendered here is the one a
vLLM server builds (the example cluster's gateway and the vLLM router render chats through
`Tokenizer.render_chat`, which applies this).

A message's content of text parts is joined by "\\n" (`content_text`), or, for a template that loops over a
message's content (vLLM's "openai" content format, found in its syntax tree as vLLM finds it:
`loops_over_content`), given as a list of `{"type": "text", "text": ...}` parts; the keys vLLM keeps (`name`, an
assistant's `tool_calls` with their arguments as objects and `reasoning`, also as `reasoning_content` and
`thinking` as transformers then gives it, a tool's `tool_call_id`); developer
messages as system ones, merged into one at the start, where the template never names the developer role
(`chat_conversation`). Torch-free; jinja2 only to read a template's syntax tree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mooncake import _json
from mooncake._checks import shown
from mooncake.errors import InvalidRequestError

__all__ = ["chat_conversation", "content_text", "loops_over_content"]

# A chat as vLLM's server (0.32) reads it before its template (`parse_chat_messages` of renderers/chat_utils.py,
# `safe_apply_chat_template` of renderers/hf.py): the content parts that carry text, and where their text is;
# the keys of a part vLLM knows (any other, `cache_control` say, stays on a text part given as a list).
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_SKIPPED_WITHOUT_TEXT = ("text", "refusal")  # vLLM drops such a part whose text is null
_KNOWN_PART_KEYS = frozenset(
    {"audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url", "input_audio"}
    | {"name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid", "video_embeds", "video_url"}
)
_BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's first system line, new on every request: vLLM drops it


def _text_parts(content: Any, *, system: bool = False) -> list[tuple[str, Mapping[str, Any]]]:
    """A message's content as vLLM reads it: each text part's text, with the part (a string: `{}`).

    Raises:
        InvalidRequestError: a content that is no string, list or null; a part with no text (an image: this
            package renders text only).
    """
    if content is None:
        return []
    if isinstance(content, str):
        content = [content]
    if not isinstance(content, list):
        raise InvalidRequestError(f"a message's content must be a string or a list of parts, got {shown(content)}")
    texts: list[tuple[str, Mapping[str, Any]]] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append((part, {}))
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS:
            raise InvalidRequestError(f"content[{j}] is no text part (type {shown(kind)}): only text is rendered here")
        text = part.get(_TEXT_PARTS[kind])
        if text is None and kind in _SKIPPED_WITHOUT_TEXT:
            continue
        if not isinstance(text, str):
            raise InvalidRequestError(f"content[{j}].{_TEXT_PARTS[kind]} must be a string, got {shown(text)}")
        texts.append((text, part))
    if not system:
        return texts
    kept = []
    for text, part in texts:  # vLLM drops the billing header's line (and the part, when that was all of it)
        if text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        kept.append((text, part))
    return kept


def content_text(content: Any) -> str:
    """A message's content as a chat template that takes a string sees it in vLLM: a string as given, a list of
    text parts (strings, or `{"type": "text", "text": ...}` and vLLM's other text kinds) their texts joined by
    "\\n", null "".

    Raises:
        InvalidRequestError: a content of another kind, or a part without text (an image).
    """
    return "\n".join(text for text, _ in _text_parts(content))


def _part_list(texts: list[tuple[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Text parts as vLLM gives them to a template that loops over a message's content (its "openai" format)."""
    return [
        {"type": "text", "text": text, **{k: v for k, v in part.items() if k not in _KNOWN_PART_KEYS}}
        for text, part in texts
    ]


def _arguments(value: Any) -> dict[str, Any]:
    """A tool call's `arguments` as vLLM hands them to a template: an object (JSON text parsed; else `{}`)."""
    if isinstance(value, str) and value:
        try:
            value = _json.loads(value)
        except ValueError:  # no JSON, or JSON Python cannot read (4,300+ digits, nested too deep)
            return {}
    return value if isinstance(value, dict) else {}


def _tool_calls(calls: Any) -> list[Any]:
    """An assistant's `tool_calls`, copied, with each function's arguments an object (vLLM's)."""
    if not isinstance(calls, list):
        return []
    copied = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or call.get("type", "function") != "function":
            raise InvalidRequestError("an assistant's tool_calls must be objects of type 'function'")
        copied.append({**call, "function": {**function, "arguments": _arguments(function.get("arguments"))}})
    return copied


# transformers' (5.25) names of a message's reasoning, in its order of precedence (`_REASONING_FIELDS`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with its reasoning under the names templates read, as transformers' `apply_chat_template` gives
    every message (`_alias_reasoning_fields`): the first of `reasoning_content`, `thinking`, `reasoning` that is
    not None becomes `reasoning_content` (overwritten, in its place) and `thinking` (first, unless the message
    has one: gpt-oss's templates read it); the message as it is without any."""
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def chat_conversation(
    messages: Sequence[Mapping[str, Any]], *, content_parts: bool = False, developer_role: bool = True
) -> list[dict[str, Any]]:
    """The messages as vLLM's server hands them to a chat template.

    Each message keeps its role and content, its `name` (a string), an assistant's `tool_calls` (empty: none;
    each function's `arguments` an object) and `reasoning` (also as `reasoning_content`, as vLLM gives it, and as
    `thinking`, first, as transformers' `apply_chat_template` adds it before rendering), a tool's
    `tool_call_id`, a developer's `tools`; every other key is dropped. The content is read by `content_text`
    (a system message's Claude Code billing header line dropped): as that string, or with `content_parts`
    (the template loops over a message's content) as a list of `{"type": "text", "text": ...}` parts (a tool's
    still joined). Without `developer_role` (the template never names the role) developer messages become
    system ones, and the system messages are merged into one at the start ("\\n\\n" between them).

    Raises:
        InvalidRequestError: a message with no role, a content that `content_text` refuses, a malformed
            tool call.
    """
    chat: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        if not isinstance(role, str):
            raise InvalidRequestError(f"messages[{i}] needs a role")
        try:
            texts = _text_parts(message.get("content"), system=role == "system")
        except InvalidRequestError as error:
            raise InvalidRequestError(f"messages[{i}].{error}") from None
        joined = "\n".join(text for text, _ in texts)
        entry: dict[str, Any] = {"role": role, "content": _part_list(texts) if content_parts else joined}
        if role == "assistant":
            calls = _tool_calls(message.get("tool_calls"))
            if calls:  # vLLM drops an empty list: the template takes its plain assistant path
                entry["tool_calls"] = calls
            if message.get("reasoning") is not None:
                entry["reasoning"] = entry["reasoning_content"] = message["reasoning"]
                entry = _alias_reasoning(entry)
        elif role == "tool":
            entry["content"] = joined
            if "tool_call_id" in message:
                entry["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        if isinstance(message.get("task"), str):
            entry["task"] = message["task"]
        if role == "developer":
            entry["tools"] = message.get("tools")
        chat.append(entry)
    if developer_role or not any(m["role"] == "developer" for m in chat):
        return chat
    for entry in chat:
        if entry["role"] == "developer":
            entry["role"] = "system"
            del entry["tools"]
    systems = [entry for entry in chat if entry["role"] == "system"]
    if len(systems) == 1 and chat[0] is systems[0]:
        return chat
    # A string even where the others are lists of parts: vLLM's `_consolidate_system_messages` merges so.
    merged = {"role": "system", "content": "\n\n".join(filter(None, (content_text(e["content"]) for e in systems)))}
    return [merged, *(entry for entry in chat if entry["role"] != "system")]


def loops_over_content(ast: Any) -> bool:
    """Whether a parsed chat template loops over a message's content, as vLLM's `_detect_content_format` finds
    it (then vLLM hands the template each content as a list of parts, else as a string): a `for` over
    `message.content` (or `message['content']`, filtered, tested or sliced) where `message` is a loop variable
    over `messages` (or over a variable assigned from it), over a macro's parameter that such a content is
    passed to, or over a variable named `content` outside any macro. Where vLLM's search meets a loop or an
    assignment that unpacks (`for i, m in ...`), it gives up and takes the string: so does this."""
    import jinja2.nodes as nodes

    def is_name(node: Any, name: str) -> bool:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name

    def reads(node: Any, name: str, key: str | None = None) -> bool:
        if isinstance(node, nodes.Filter | nodes.Test):
            return node.node is not None and reads(node.node, name, key)
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            return reads(node.node, name, key)
        if key is None:
            return is_name(node, name)
        if isinstance(node, nodes.Getitem):
            return is_name(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
        return isinstance(node, nodes.Getattr) and is_name(node.node, name) and node.attr == key

    class Unpacks(Exception):
        pass

    def target(node: Any) -> str:
        if not isinstance(node, nodes.Name):
            raise Unpacks
        return str(node.name)

    try:
        lists, pending = ["messages"], ["messages"]  # `messages` and what is assigned from it
        while pending:
            name = pending.pop(0)
            for assign in ast.find_all(nodes.Assign):
                if reads(assign.node, name):
                    lists.append(target(assign.target))
                    if lists[-1] != name:
                        pending.append(lists[-1])
        loops = list(ast.find_all(nodes.For))
        items = [target(loop.target) for loop in loops if any(reads(loop.iter, name) for name in lists)]

        def is_content(node: Any) -> bool:
            return any(reads(node, item, "content") for item in items)

        in_macros: set[int] = set()
        given: dict[int, set[str]] = {}  # a loop inside a macro: the macro's parameters that a content is passed to
        for macro in ast.find_all(nodes.Macro):
            params = {arg.name for arg in macro.args}
            passed: set[str] = set()
            for call in ast.find_all(nodes.Call):
                if is_name(call.node, macro.name):
                    passed |= {macro.args[i].name for i, a in enumerate(call.args[: len(macro.args)]) if is_content(a)}
                    passed |= {kw.key for kw in call.kwargs if kw.key in params and is_content(kw.value)}
            for loop in macro.find_all(nodes.For):
                in_macros.add(id(loop))
                if passed:
                    given[id(loop)] = passed
        for loop in loops:
            named = loop.iter.name if isinstance(loop.iter, nodes.Name) else None
            if (
                is_content(loop.iter)
                or (named is not None and named in given.get(id(loop), ()))
                or (named == "content" and id(loop) not in in_macros)
            ):
                target(loop.target)
                return True
    except Unpacks:
        return False
    return False
