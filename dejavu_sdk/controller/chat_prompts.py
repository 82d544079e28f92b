"""A chat's messages as the prompt the model's chat template means: each message's role one the template handles,
and what the messages say tokenized as text.

Roles: system, user and assistant, and those the template compares a message's role with (`tool`, `ipython`,
`developer`, ...); any other (a role with special-token text or control characters among them) is a 400 that
names the allowed ones. Content: a special token spelled out in a message (`<|im_end|>`) is text, never the control
token the template writes itself (transformers' `apply_chat_template(..., sanitize_control_tokens=True)`: the
template's own markup keeps its special tokens, what came from the messages is tokenized with them split). A chat
without such text has the ids it always had: those of its rendered text tokenized.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jinja2
from jinja2 import nodes

from ..errors import quoted
from .api_errors import ApiError

#: The roles every chat template is taken to handle.
BASE_ROLES = ("system", "user", "assistant")
#: What a role a template names looks like to be allowed: a plain word.
ROLE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")


def chat_prompt(tokenizer: Any, messages: Any) -> list[int]:
    """The token ids of `messages` rendered with `tokenizer`'s chat template, the assistant's turn opened
    (ApiError 400: messages of the wrong shape or role, or ones the template refuses)."""
    checked = checked_messages(messages, template_roles(tokenizer.chat_template))
    try:
        ids = tokenizer.apply_chat_template(checked, add_generation_prompt=True, tokenize=True, return_dict=False,
                                            sanitize_control_tokens=True)
    except Exception as error:  # the template's own checks (roles that must alternate, ...)
        raise ApiError(400, f"the chat template refused the messages: {error}") from None
    return list(ids)


def checked_messages(messages: Any, roles: tuple[str, ...]) -> list[dict[str, str]]:
    """Chat messages as a template takes them: a role of `roles` and text content each (content parts of type
    text are joined)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects")
    checked = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"each message needs a 'role' ({', '.join(roles)}) and a 'content'")
        if message["role"] not in roles:
            raise ApiError(400, f"a message's role is one of {', '.join(roles)} (those this model's chat template "
                           f"handles), not {quoted(message['role'])}", code="invalid_role")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in content):
                raise ApiError(400, "only text content parts ({type: text, text}) are supported")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise ApiError(400, "a message's 'content' must be a text or a list of text parts")
        checked.append({"role": message["role"], "content": content})
    return checked


@functools.lru_cache(maxsize=16)
def template_roles(template: Any) -> tuple[str, ...]:
    """The roles chat template `template` handles: `BASE_ROLES`, then every plain word it compares a message's
    role with (`message['role'] == 'tool'`, `message.role in ['ipython', 'tool']`, `selectattr('role', 'equalto',
    'developer')`). A template given by name (a dict of them) is read whole."""
    sources = list(template.values()) if isinstance(template, dict) else [template]
    named: set[str] = set()
    for source in sources:
        try:
            tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
        except (jinja2.TemplateSyntaxError, TypeError):  # the template itself fails as it renders, a 400
            continue
        for compare in tree.find_all(nodes.Compare):
            operands = [compare.expr, *(operand.expr for operand in compare.ops)]
            if any(_is_role(operand) for operand in operands):
                named.update(text for operand in operands if not _is_role(operand) for text in _texts(operand))
        for selection in tree.find_all(nodes.Filter):
            args = selection.args
            if selection.name in ("selectattr", "rejectattr") and len(args) == 3 and _text(args[0]) == "role":
                named.update(_texts(args[2]))
    extra = sorted(name for name in named if ROLE_NAME.fullmatch(name) and name not in BASE_ROLES)
    return (*BASE_ROLES, *extra)


def _is_role(node: Any) -> bool:
    """Whether a template expression reads a message's role (`message['role']`, `message.role`, `role`)."""
    return ((isinstance(node, nodes.Getitem) and _text(node.arg) == "role")
            or (isinstance(node, nodes.Getattr) and node.attr == "role")
            or (isinstance(node, nodes.Name) and node.name == "role"))


def _texts(node: Any) -> list[str]:
    """The string constants in a template expression, itself included."""
    return [const.value for const in [node, *node.find_all(nodes.Const)]
            if isinstance(const, nodes.Const) and isinstance(const.value, str)]


def _text(node: Any) -> str | None:
    return node.value if isinstance(node, nodes.Const) and isinstance(node.value, str) else None
