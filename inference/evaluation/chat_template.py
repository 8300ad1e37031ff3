"""Chat-template rendering: the one function every rendering goes through, and the template options it passes.

Training data (train/data/chat.py), regeneration (train/data/regenerate.py), the training probe (train/fit/metrics.py), `draftsmith
eval`, `calibrate` and `doctor` all render conversations here, so a template option such as Qwen3's
`enable_thinking=False` reaches every one of them: a drafter trained on answers rendered in one mode and served in
the other loses most of its acceptance (a DFlash user measured 25% -> 60% once thinking was turned off everywhere).

Options (`template_kwargs`) are the variables the jinja template reads beyond `messages` and
`add_generation_prompt`; they come from the recipe's `data.chat_template_kwargs` or the `--chat-template-kwargs
key=value,...` flag. An option the template never reads is refused naming it (a typo would otherwise render the
default mode silently).

    ids = render_prompt(tokenizer, ["Hi"], [], True, {"enable_thinking": False})
"""

from __future__ import annotations

from typing import Any, Mapping

import yaml

# Variables transformers itself puts into every template's context; passing them as options would be ambiguous.
_RESERVED = {"messages", "add_generation_prompt", "tools", "documents", "continue_final_message"}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def require_chat_template(tokenizer: Any, chat_template: str | None = None) -> str:
    """The template to render with: the override, else the tokenizer's own; ValueError when there is neither."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"the target tokenizer {name!r} has no chat template; set data.chat_template in the recipe "
                         "(a jinja template string) to say how conversations are rendered")
    if isinstance(template, dict):  # tokenizers may hold several named templates
        if "default" not in template:
            raise ValueError(f"the tokenizer has named chat templates {sorted(template)} but no 'default'; "
                             "set data.chat_template")
        template = template["default"]
    return template


def template_variables(template: str) -> set[str] | None:
    """Every top-level variable the jinja template reads (undeclared in it); None when plain jinja cannot parse it
    (a transformers-only tag such as {% generation %}), so nothing can be said."""
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        parsed = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError:
        return None
    return set(meta.find_undeclared_variables(parsed))


def check_template_kwargs(template: str, template_kwargs: Mapping[str, Any] | None, where: str) -> None:
    """ValueError naming `where` and the option when an option is reserved or never read by the template."""
    if not template_kwargs:
        return
    read = template_variables(template)
    for key in template_kwargs:
        if key in _RESERVED:
            raise ValueError(f"{where}: {key!r} is set by draftsmith itself, not a template option")
        if read is not None and key not in read:
            options = sorted(read - _RESERVED - {"bos_token", "eos_token", "raise_exception", "strftime_now"})
            raise ValueError(f"{where}: the chat template never reads {key!r}, so it would change nothing; the "
                             f"template's own options are {options or 'none'}")


def check_chat_template(tokenizer: Any, use_chat_template: bool, target_name: str,
                        template_kwargs: Mapping[str, Any] | None = None) -> None:
    """The eval-side checks (ValueError naming the flag): a template exists, and it reads every option given."""
    if use_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"target {target_name!r} has no chat template in its tokenizer; pass --no-chat-template to "
                         "feed the prompts as plain text")
    if use_chat_template:
        check_template_kwargs(require_chat_template(tokenizer), template_kwargs, "--chat-template-kwargs")


def parse_template_kwargs(text: str | None, flag: str = "--chat-template-kwargs") -> dict[str, Any]:
    """"enable_thinking=false,foo=1" -> {"enable_thinking": False, "foo": 1} (values are YAML scalars)."""
    if not text:
        return {}
    options: dict[str, Any] = {}
    for item in (part.strip() for part in text.split(",")):
        key, sep, value = item.partition("=")
        if not item or not sep or not key.strip() or not key.strip().isidentifier():
            raise ValueError(f"{flag}: expected comma-separated name=value pairs (e.g. enable_thinking=false), "
                             f"got {item!r}")
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            parsed = None
        if parsed is None or isinstance(parsed, (dict, list)):
            raise ValueError(f"{flag}: {key.strip()}={value!r} must be a scalar (true, false, a number or text)")
        options[key.strip()] = parsed
    return options


def render_text(tokenizer: Any, messages: list[dict[str, str]], chat_template: str | None = None, *,
                add_generation_prompt: bool = False, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The conversation as text, exactly as the chat template writes it with `template_kwargs`."""
    template = require_chat_template(tokenizer, chat_template)
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **dict(template_kwargs or {}))


def render_prompt(tokenizer: Any, turns: list[str], answers: list[str], use_chat_template: bool,
                  template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of the conversation so far: turns[i] answered by answers[i], the last turn not yet answered."""
    if not use_chat_template:
        parts = [text for pair in zip(turns, answers + [None]) for text in pair if text is not None]
        return tokenizer("\n\n".join(parts))["input_ids"]
    messages = []
    for turn, answer in zip(turns, answers + [None]):
        messages.append({"role": "user", "content": turn})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    text = render_text(tokenizer, messages, add_generation_prompt=True, template_kwargs=template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def thinking_mismatch(answer: str, template_kwargs: Mapping[str, Any] | None) -> str | None:
    """Why an answer does not match the requested thinking mode, or None. With enable_thinking false the template
    closes an empty thinking block before the answer, so a `<think>` the model writes means the mode never reached
    it (another template, or an option the template ignores)."""
    if (template_kwargs or {}).get("enable_thinking") is False and THINK_OPEN in answer:
        return f"it contains {THINK_OPEN!r} although enable_thinking is false"
    return None


def trained_mode_mismatch(drafter_dir: str, template_kwargs: Mapping[str, Any] | None) -> str | None:
    """A warning when the recipe saved with a drafter checkpoint rendered with other template options than this
    run's (a drafter trained with thinking off and served with it on accepts far less), else None."""
    import os

    path = os.path.join(drafter_dir, "recipe.yaml")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        data = (yaml.safe_load(f) or {}).get("data") or {}
    trained = dict(data.get("chat_template_kwargs") or {})
    if trained == dict(template_kwargs or {}):
        return None
    given = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in trained.items()) or "(none)"
    return (f"{drafter_dir} was trained with data.chat_template_kwargs {trained}, this run renders with "
            f"{dict(template_kwargs or {})}; pass --chat-template-kwargs {given} to serve it in its training mode")
