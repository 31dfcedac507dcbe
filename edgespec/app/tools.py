"""Tool calls (OpenAI's `tools` / `tool_choice`) for chat templates that list
tools and wrap a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(the Hermes format that Qwen2.5's template renders).

The tools go into the prompt through the template's own `tools` variable.
What the answer may be depends on tool_choice:

* "none": the tools are left out of the prompt and the answer is text;
* "auto" (the default with tools): the answer is generated freely, and the
  `<tool_call>` blocks in it (each a JSON object naming one of the tools)
  become `tool_calls`;
* "required", or {"type": "function", "function": {"name": ...}}: the answer is
  constrained by a grammar to exactly one block calling one of the tools (the
  named one) with arguments that follow its `parameters` schema.  Under the
  grammar every token is still the model's own choice (edgespec's grammar
  sampling is lossless under the constraint).

A template that does not mention `tools`, or lists tools but not in this
format, gets a ToolError: its answers could not be read back as calls.
"""
from __future__ import annotations

import json
import re
import uuid

from edgespec.backend.chattokens import chat_tokens, render
from edgespec.errors import ConfigError
from edgespec.app.structured import ConstraintError, check_gbnf, schema_gbnf

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")       # OpenAI's rule for a function name
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
# a GBNF token: a literal, a character class, a comment, a word (a rule name), or one other character
_GBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*|[A-Za-z0-9-]+|.', re.S)


# How deeply a tool definition or a call's arguments may nest: the template
# renders them with a recursive tojson, so a deeper one would be a
# RecursionError (a 500) instead of a 400.
MAX_TOOL_DEPTH = MAX_ARGUMENT_DEPTH = 64


class ToolError(ConfigError):
    """A tools request that cannot be served; `param` names the field at fault."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


# ------------------------------------------------------------- the request
def check_tools(tools) -> list[dict]:
    """OpenAI function tools: [{"type": "function", "function": {"name",
    "description"?, "parameters"?}}], names unique."""
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of tool objects", "tools", "invalid_type")
    seen = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}', "tools",
                            "invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -", "tools")
        if name in seen:
            raise ToolError(f"tools[{i}]: the name {name!r} is given twice", "tools")
        seen.add(name)
        if not isinstance(fn.get("description", ""), str):
            raise ToolError(f"tools[{i}].function.description must be a string", "tools", "invalid_type")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools", "invalid_type")
        if _depth(t) > MAX_TOOL_DEPTH:            # rendered by the template's (recursive) tojson
            raise ToolError(f"tools[{i}] nests more than {MAX_TOOL_DEPTH} deep", "tools")
    return tools


def check_choice(choice, tools: list[dict]) -> tuple[str, str | None]:
    """(mode, name): mode "none", "auto", "required" or "function" (then name
    is the function's).  Without tool_choice: "auto" with tools, else "none"."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise ToolError('tool_choice "required" needs tools', "tool_choice")
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": ...}}', "tool_choice", "invalid_type")
    if name not in {t["function"]["name"] for t in tools}:
        raise ToolError(f"tool_choice names {name[:64]!r}, which is not one of the tools", "tool_choice")
    return "function", name


def check_template(template: str | None) -> None:
    """Refuse tools for a chat template that cannot render them or whose
    calls this module cannot read."""
    if not template or "tools" not in template:
        raise ToolError("this model's chat template has no tool support (it does not render `tools`); "
                        'leave tools out or set tool_choice to "none"', "tools", "unsupported")
    if OPEN not in template:
        raise ToolError(f"this model's chat template writes tool calls in a format edgespec does not read "
                        f"(only {OPEN} JSON blocks, as Qwen2.5's and Hermes' templates); leave tools out or "
                        'set tool_choice to "none"', "tools", "unsupported")


class ToolRequest:
    """The tools of one request that uses them (tool_choice not "none")."""

    def __init__(self, tools: list[dict], mode: str, name: str | None):
        self.tools, self.mode, self.name = tools, mode, name
        self.names = {t["function"]["name"] for t in tools}


def tool_request(tools, choice, template: str | None) -> ToolRequest | None:
    """The checked tools and tool_choice of a request, or None when no tool
    may be called (no tools, or tool_choice "none": the tools are then not
    rendered either)."""
    if tools is None or tools == []:
        check_choice(choice, [])         # "required" or a named function without tools: refused
        return None
    if choice != "none":
        check_template(template)         # first: a model without tool support says so, whatever the tools
    tools = check_tools(tools)
    mode, name = check_choice(choice, tools)
    return None if mode == "none" else ToolRequest(tools, mode, name)


# ------------------------------------------------------------ the history


def _depth(value) -> int:
    """How deeply lists and dicts nest in a JSON value (without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def history_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls, for the template: OpenAI's
    arguments JSON text as an object (what a template's `tojson` expects)."""
    if not isinstance(calls, list):
        raise ToolError(f"{where} must be a list", "messages", "invalid_type")
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(f'{where}[{i}] must be {{"type": "function", "function": {{"name": ..., "arguments": '
                            '...}}}}', "messages", "invalid_type")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                pass                     # kept as the text it is
        if _depth(args) > MAX_ARGUMENT_DEPTH:      # the template's tojson and our checks recurse
            raise ToolError(f"{where}[{i}].function.arguments nest more than {MAX_ARGUMENT_DEPTH} deep", "messages")
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def history_message(m: dict, i: int) -> dict:
    """A message as the template gets it: assistant tool_calls normalized
    (content None is ""), a tool message's tool_call_id and name kept."""
    if not isinstance(m, dict):
        return m                         # the renderer refuses it
    out = {"role": m.get("role"), "content": m.get("content")}
    if m.get("tool_calls"):
        out["tool_calls"] = history_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        if out["content"] is None:
            out["content"] = ""
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


# -------------------------------------------------------- prompt, grammar
def render_prompt(model, messages: list[dict], tools: list[dict]) -> str:
    """The template's rendering of messages with the tools (a SpecModel's
    apply_chat_template, which takes no tools)."""
    with model._gate.using():        # as SpecModel's own tokenizing: the model stays loaded meanwhile
        return render(model.vocab, messages, tools)


def prompt_tokens(model, messages: list[dict], tools: list[dict]):
    """SpecModel.prompt_tokens for messages rendered with tools (contents
    never special: edgespec.backend.chattokens)."""
    with model._gate.using():
        return chat_tokens(model.vocab, messages, tools)


def _literal(s: str) -> str:
    """A GBNF string literal matching exactly s."""
    esc = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{esc}"'


def _prefixed(gbnf: str, prefix: str) -> str:
    """A grammar with every rule name prefixed (so that several converted
    schemas live in one grammar); literals, classes and comments untouched."""
    return "".join(prefix + t if (t[0].isalnum() or t[0] == "-") and not t.isdigit() else t
                   for t in _GBNF_TOKEN.findall(gbnf))


def call_grammar(req: ToolRequest) -> str:
    """GBNF for one call block of one of the request's tools (the named one):
    `<tool_call>\\n{"name": "<name>", "arguments": <its parameters>}\\n</tool_call>`.
    Rule names: root, tool-call, tool-ws and tool-N ours, tN-* those of tool N's
    schema grammar (no clash: "tN-" never begins "tool-")."""
    tools = [t for t in req.tools if req.name is None or t["function"]["name"] == req.name]
    rules = [f"root ::= {_literal(OPEN + chr(10))} tool-call {_literal(chr(10) + CLOSE)}",
             "tool-call ::= " + " | ".join(f"tool-{i}" for i in range(len(tools))),
             "tool-ws ::= [ ]?"]
    for i, t in enumerate(tools):
        fn = t["function"]
        try:
            gbnf = schema_gbnf(fn.get("parameters") or {"type": "object"}, "tools")
        except ConstraintError as e:
            raise ToolError(f"the parameters of the tool {fn['name']!r}: {e}", "tools") from None
        rules.append(_prefixed(gbnf, f"t{i}-"))
        rules.append(f'tool-{i} ::= "{{" tool-ws {_literal(chr(34) + "name" + chr(34))} tool-ws ":" tool-ws '
                     f'{_literal(json.dumps(fn["name"]))} tool-ws "," tool-ws '
                     f'{_literal(chr(34) + "arguments" + chr(34))} tool-ws ":" tool-ws t{i}-root tool-ws "}}"')
    try:
        return check_gbnf("\n".join(rules) + "\n", "tools", "the tools' grammar")
    except ConstraintError as e:
        raise ToolError(str(e), "tools") from None


# ------------------------------------------------------------- the answer
def new_call(name: str, arguments) -> dict:
    """One entry of OpenAI's tool_calls; arguments as JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}


def parse_calls(text: str, names) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer: its <tool_call> blocks, each a JSON
    object whose name is one of `names`, and the text around them (None when
    blank).  One unreadable block and the whole answer is content: a call is
    never made up from text that does not state it."""
    calls = []
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except (ValueError, RecursionError):
            return text, []
        if (not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names
                or _depth(obj) > MAX_ARGUMENT_DEPTH + 1):
            return text, []
        calls.append(new_call(obj["name"], obj.get("arguments", {})))
    if not calls:
        return text, []
    return (_BLOCK.sub("", text).strip() or None), calls


def answer(text: str, stop_reason: str, req: ToolRequest) -> tuple[dict, str]:
    """The assistant message of a tools request's answer and its finish_reason
    ("tool_calls" when it calls tools)."""
    content, calls = parse_calls(text, req.names)
    if not calls:
        return {"role": "assistant", "content": text}, stop_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def deltas(message: dict) -> list[dict]:
    """The stream deltas of a gathered answer: its content, then its calls
    (each with its index, as OpenAI streams them)."""
    out = [{"content": message["content"]}] if message.get("content") else []
    calls = message.get("tool_calls") or []
    if calls:
        out.append({"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]})
    return out
